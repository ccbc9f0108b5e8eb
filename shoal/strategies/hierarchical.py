"""Hierarchical SGD as a strategy (C3): nested groups average on their own periods."""

from __future__ import annotations

from typing import Mapping, Sequence

from shoal.averagers import Hierarchy, Levels, ModelAverager
from shoal.codecs.base import Codec
from shoal.comm.group import Group
from shoal.strategies.localsgd import AveragingStrategy


class Hierarchical(AveragingStrategy):
    """Groups of each size average parameters every ``period`` steps (C3).

    ``period_group_size`` is an ordered ``{period: group_size}`` map, finest
    level first; groups of size ``k`` are ``k`` consecutive ranks, formed once
    at :func:`shoal.wrap`. At a step (counted from 0, from ``warmup_steps`` on)
    only the level with the largest period dividing the step averages: the
    schedule of torch's ``HierarchicalModelAverager``. Nothing is synchronised
    during warm-up (:class:`shoal.PostLocalSGD` accepts the same map and
    all-reduces gradients then).

    Each averaging is a round (:class:`~shoal.strategies.rounds.Rounds`,
    ``AVERAGE_SURVIVORS``) over that level's group (``group.subgroup(by_slot(k))``,
    :class:`~shoal.averagers.Levels`). On an
    :class:`~shoal.elastic.ElasticGroup` that is the group in the current quorum:
    groups of size ``k`` are the live workers whose launch ``RANK`` (stable
    across restarts under ``shoal run --elastic``) divided by ``k`` is equal,
    i.e. the static groups, shrunk by lost workers; the last level is the
    whole quorum. A failure anywhere fails the round for every group; it is
    run again on the next quorum. A newcomer contributes zeros in its group;
    a group made only of newcomers keeps the healed copy. Workers need
    ``RANK`` set (``shoal run`` does); when ``WORLD_SIZE`` is set, the map is
    checked against it as on a static group. See docs/elastic.md.

    Raises :class:`~shoal.errors.ConfigError` for an empty map, a non-positive
    smallest period, negative ``warmup_steps`` (here) and a last group size
    other than the world size (at :func:`shoal.wrap`); warns when the largest
    period is 1. Meter tags: ``hierarchical/params/g<size>``.

    Example (4 ranks per host, 16 ranks)::

        model, opt = shoal.wrap(model, opt, shoal.Hierarchical({2: 4, 16: 16}))
        # after step 2, 4, 6, ...: hosts average; after step 16, 32, ...: everyone
    """

    name = "hierarchical"

    def __init__(self, period_group_size: Mapping[int, int], warmup_steps: int = 0,
                 codec: Codec | None = None, average_optimizer_state: bool | Sequence[str] = False) -> None:
        super().__init__(codec, average_optimizer_state)
        self.hierarchy = Hierarchy.from_dict(period_group_size, warmup_steps)

    def _make_averager(self, group: Group) -> ModelAverager:
        return Levels(self.hierarchy, group, self.codec, "Hierarchical")
