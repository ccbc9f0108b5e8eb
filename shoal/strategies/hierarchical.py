"""Hierarchical SGD as a strategy (C3): nested groups average on their own periods."""

from __future__ import annotations

from typing import Mapping, Sequence

from shoal.averagers import HierarchicalModelAverager, Hierarchy, _Averager
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

    def _make_averager(self, group: Group) -> _Averager:
        return HierarchicalModelAverager(dict(self.hierarchy.levels), self.hierarchy.warmup_steps, group, self.codec)
