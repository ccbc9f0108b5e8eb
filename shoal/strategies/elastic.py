"""Strategies on an :class:`~shoal.comm.elastic.ElasticGroup`: rounds that outlive lost peers.

Local SGD, post-local SGD and DiLoCo synchronise in *rounds* (a parameter
average, a pseudo-gradient mean); the steps between rounds are local and need
no vote. On an elastic group each round is one elastic step,
``start_step(); collectives; should_commit()``, with the policy
:attr:`~shoal.elastic.FailurePolicy.AVERAGE_SURVIVORS`:

- the round's collectives work on scratch copies, so a failed round leaves
  parameters, optimizer and outer state untouched (codec state is registered
  with ``rollback=True`` and restored by the group); it is run again on the
  next quorum, i.e. averaged with the survivors;
- a member healed in this round's ``start_step`` (a newcomer, a restarted
  worker) contributes zeros and the mean is rescaled, so averages divide by
  the number of *live contributors*: a newcomer holds a copy of a peer's
  state and would otherwise count that peer twice;
- a newcomer waits in :func:`shoal.wrap` until the others reach a round; the
  kind of that round travels with the healed state, so it runs the same
  collectives as its peers even when it lands in the retry of a failed round;
- after a committed round, if a newer quorum is waiting (someone joined), an
  empty round adopts it at once instead of a period later.

Module, optimizer, strategy and codec state are registered for healing; a
newcomer gets the codec's :meth:`~shoal.codecs.Codec.newcomer_state` (a
peer's PowerSGD Qs, but zero error feedback of its own).

Example (what :class:`shoal.LocalSGD` does on an elastic group)::

    rounds = ElasticRounds(group, "localsgd", model, opt, codec, strategy_state, load_strategy_state,
                           reduce=lambda kind, contribute: ..., apply=lambda kind: ...)
    rounds.join()               # in setup: first quorum, or admission of a newcomer
    rounds.run("params")        # in after_step when an average is due
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from shoal.averagers import Hierarchy, ModelAverager
from shoal.codecs.base import Codec
from shoal.comm.elastic import ElasticGroup
from shoal.comm.elastic_sub import ElasticSubgroup, by_slot
from shoal.comm.group import Group
from shoal.errors import ConfigError
from shoal.strategies.rounds import ADOPT, FailurePolicy, Rounds

__all__ = ["ADOPT", "ElasticRounds", "ElasticLevels", "check_slots"]



class ElasticRounds(Rounds):
    """:class:`~shoal.strategies.rounds.Rounds` with its heal state registered at once (the older form).

    Example::

        rounds = ElasticRounds(group, "diloco", model, opt, codec, get, load, reduce, apply)
        rounds.join()
        committed = rounds.run("frag:0")
    """

    def __init__(self, group: Group, name: str, module: nn.Module, optimizer: torch.optim.Optimizer,
                 codec: Codec, get_state: Callable[[], Any], load_state: Callable[[Any], None],
                 reduce: Callable[[str, bool], None], apply: Callable[[str], None], max_attempts: int = 3) -> None:
        super().__init__(group, name, reduce, apply, FailurePolicy.AVERAGE_SURVIVORS, max_attempts)
        self.codec = codec
        self.register(module, optimizer, codec, get_state, load_state)


def check_slots(hierarchy: Hierarchy, who: str) -> None:
    """Level groups on an elastic group are launch slots (``$RANK``): it must be set; the map is
    checked against ``$WORLD_SIZE`` (the launched world) when that is set."""
    slot = os.environ.get("RANK", "")
    if not slot.isdigit():
        raise ConfigError(
            f"{who} on an ElasticGroup places each worker in its level groups by its launch RANK "
            f"(stable across restarts), but RANK is {slot!r}; launch with `shoal run --elastic` or set "
            "RANK to the worker's slot 0..N-1"
        )
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit():
        hierarchy.check_world(int(world))


class ElasticLevels(ModelAverager):
    """The schedule of :class:`~shoal.averagers.HierarchicalModelAverager` over per-quorum groups.

    Level ``i < last`` is an :class:`~shoal.comm.elastic_sub.ElasticSubgroup`
    by launch slot (``by_slot(size)``): the static groups of consecutive
    ranks when the quorum is complete, shrunk by lost workers, rejoined by
    restarted ones (same ``RANK``); the last level is the elastic group
    itself. Strategies run its averagings as elastic rounds of kind
    ``params@<level>`` (:meth:`kind_at`, :meth:`target`).
    """

    tag = "hierarchical/params"

    def __init__(self, hierarchy: Hierarchy, group: ElasticGroup, codec: Codec | None) -> None:
        super().__init__(group, codec)
        self.hierarchy = hierarchy
        last = len(hierarchy.levels) - 1
        self.groups: list[ElasticGroup | ElasticSubgroup] = [
            group if i == last else ElasticSubgroup(group, f"levels/{i}", by_slot(size))
            for i, (_, size) in enumerate(hierarchy.levels)
        ]

    def _group_at(self, step: int) -> tuple[Group, str] | None:
        level = self.hierarchy.level_at(step)
        if level is None:
            return None
        return self.groups[level], f"{self.tag}/g{self.hierarchy.levels[level][1]}"

    def kind_at(self, step: int) -> str | None:
        """The round due after optimizer step ``step``, if any."""
        level = self.hierarchy.level_at(step)
        return None if level is None else f"params@{level}"

    def target(self, kind: str) -> tuple[ElasticGroup | ElasticSubgroup, str]:
        """The group and meter tag of a round of ``kind``."""
        level = int(kind.partition("@")[2])
        return self.groups[level], f"{self.tag}/g{self.hierarchy.levels[level][1]}"
