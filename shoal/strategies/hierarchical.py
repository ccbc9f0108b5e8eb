"""Hierarchical SGD as a strategy (C3): nested groups average on their own periods."""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from shoal.averagers import HierarchicalModelAverager, Hierarchy, ModelAverager
import torch
from torch import nn

from shoal.codecs.base import Codec
from shoal.comm.elastic import ElasticGroup
from shoal.comm.elastic_sub import ElasticSubgroup, by_slot
from shoal.comm.group import Group
from shoal.errors import ConfigError
from shoal.strategies.localsgd import AveragingStrategy

TAG = "hierarchical/params"


class Hierarchical(AveragingStrategy):
    """Groups of each size average parameters every ``period`` steps (C3).

    ``period_group_size`` is an ordered ``{period: group_size}`` map, finest
    level first; groups of size ``k`` are ``k`` consecutive ranks, formed once
    at :func:`shoal.wrap`. At a step (counted from 0, from ``warmup_steps`` on)
    only the level with the largest period dividing the step averages: the
    schedule of torch's ``HierarchicalModelAverager``. Nothing is synchronised
    during warm-up (:class:`shoal.PostLocalSGD` accepts the same map and
    all-reduces gradients then).

    On an :class:`~shoal.elastic.ElasticGroup` each averaging is an elastic
    round (:class:`~shoal.strategies.elastic.ElasticRounds`,
    ``AVERAGE_SURVIVORS``) over that level's group in the current quorum:
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

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        if isinstance(group, ElasticGroup):
            slot = os.environ.get("RANK", "")
            if not slot.isdigit():
                raise ConfigError(
                    "Hierarchical on an ElasticGroup places each worker in its level groups by its launch RANK "
                    f"(stable across restarts), but RANK is {slot!r}; launch with `shoal run --elastic` or set "
                    "RANK to the worker's slot 0..N-1"
                )
            world = os.environ.get("WORLD_SIZE", "")
            if world.isdigit():
                self.hierarchy.check_world(int(world))
        return super().setup(model, optimizer, group)

    def _make_averager(self, group: Group) -> ModelAverager:
        if isinstance(group, ElasticGroup):
            return ElasticLevels(self.hierarchy, group, self.codec)
        return HierarchicalModelAverager(dict(self.hierarchy.levels), self.hierarchy.warmup_steps, group, self.codec)

    def _elastic_kind(self, step: int) -> str | None:
        level = self.hierarchy.level_at(step)
        return None if level is None else f"params@{level}"

    def _elastic_target(self, kind: str) -> tuple[ElasticGroup, str]:
        if not isinstance(self.averager, ElasticLevels):  # pragma: no cover - set up together
            raise ConfigError("Hierarchical is not set up on an elastic group")
        level = int(kind.partition("@")[2])
        return self.averager.groups[level], f"{TAG}/g{self.hierarchy.levels[level][1]}"


class ElasticLevels(ModelAverager):
    """The schedule of :class:`HierarchicalModelAverager` over per-quorum groups (no split).

    Level ``i < last`` is an :class:`~shoal.comm.elastic_sub.ElasticSubgroup`
    by launch slot (``by_slot(size)``); the last level is the elastic group
    itself. Used by :class:`Hierarchical` on an elastic group, whose rounds
    do the averaging (:meth:`average_named` is not for elastic use).
    """

    tag = TAG

    def __init__(self, hierarchy: Hierarchy, group: ElasticGroup, codec: Codec | None) -> None:
        super().__init__(group, codec)
        self.hierarchy = hierarchy
        last = len(hierarchy.levels) - 1
        self.groups: list[ElasticGroup] = [
            group if i == last else ElasticSubgroup(group, f"hierarchical/level{i}", by_slot(size))
            for i, (_, size) in enumerate(hierarchy.levels)
        ]

    def _group_at(self, step: int) -> tuple[Group, str] | None:
        level = self.hierarchy.level_at(step)
        if level is None:
            return None
        return self.groups[level], f"{self.tag}/g{self.hierarchy.levels[level][1]}"
