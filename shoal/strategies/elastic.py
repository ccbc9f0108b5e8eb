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

ADOPT = "adopt"  # a round with no collective: adopt the latest quorum, heal newcomers


class ElasticRounds:
    """Runs one strategy's synchronisation rounds on an elastic group (see the module docstring).

    Args:
        group: the elastic group.
        name: the strategy's name (prefix of the registered state keys).
        module, optimizer: healed into newcomers.
        codec: registered with rollback (a failed round may have half-updated
            it) and healed as :meth:`Codec.newcomer_state`.
        get_state, load_state: the strategy's own state (counters, outer
            optimizers, global copies) for healing.
        reduce: ``reduce(kind, contribute)`` issues a round's collectives into
            scratch buffers (see :meth:`mean`).
        apply: ``apply(kind)`` applies a committed round.
        max_attempts: tries per round; past them the round is skipped on
            every member alike (training goes on locally).

    Example::

        rounds = ElasticRounds(group, "diloco", model, opt, codec, get, load, reduce, apply)
        rounds.join()
        committed = rounds.run("frag:0")
    """

    def __init__(self, group: ElasticGroup, name: str, module: nn.Module, optimizer: torch.optim.Optimizer,
                 codec: Codec, get_state: Callable[[], Any], load_state: Callable[[Any], None],
                 reduce: Callable[[str, bool], None], apply: Callable[[str], None], max_attempts: int = 3) -> None:
        if not isinstance(group, ElasticGroup):
            raise ConfigError(f"ElasticRounds needs a shoal ElasticGroup, got {type(group).__name__}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self.group, self.codec, self.max_attempts = group, codec, max_attempts
        self._reduce, self._apply = reduce, apply
        self.current = ADOPT      # the round in progress; healed, so a newcomer joins the same one
        self.last_kind = ADOPT    # the round the last run() ran
        self.commits = 0
        self.contributed = 0      # committed rounds (other than adopt) that carried this worker's update
        self.skipped = 0          # rounds given up after max_attempts
        group.register_state(f"{name}/module", module.state_dict, module.load_state_dict)
        group.register_state(f"{name}/optimizer", optimizer.state_dict, optimizer.load_state_dict)
        group.register_state(f"{name}/strategy", get_state, load_state)
        group.register_state(f"{name}/codec", codec.state_dict, codec.load_state_dict, rollback=True,
                             heal_load=lambda s: codec.load_state_dict(codec.newcomer_state(s)),
                             snapshot=codec.rollback_state)
        group.register_state(f"{name}/round", lambda: {"kind": self.current}, self._load_round)

    def _load_round(self, state: dict[str, Any]) -> None:
        self.current = str(state["kind"])

    def join(self) -> str:
        """The first round (collective, in the strategy's setup): returns the kind that ran.

        For the first workers it is an empty round whose heal copies rank 0's
        state everywhere (as a broadcast would). A newcomer waits here until
        its peers reach a round, and runs that round with them.
        """
        self.run(ADOPT)
        return self.last_kind

    def run(self, kind: str) -> bool:
        """Run round ``kind`` until it commits (True) or ``max_attempts`` failed (False)."""
        for _ in range(self.max_attempts):
            self.current = kind
            self.group.start_step()
            kind = self.last_kind = self.current   # a newcomer just healed runs its peers' round
            contributes = self.contributes
            self._reduce(kind, contributes)
            if self.group.should_commit():
                self._apply(kind)
                self.commits += 1
                self.contributed += int(contributes and kind != ADOPT)
                self.current = ADOPT
                if kind != ADOPT and self.group.quorum_pending:
                    self.run(ADOPT)          # admit a waiting newcomer now, not a period later
                    self.last_kind = kind
                return True
        self.current = ADOPT
        self.skipped += 1
        return False

    @property
    def contributes(self) -> bool:
        """False for a member healed in this round: it holds a copy of a peer's progress, not its own."""
        return self.group.rank not in self.group.newcomers

    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], codec: Codec, tag: str,
             group: ElasticGroup | None = None) -> None:
        """Overwrite scratch ``tensors`` with their mean over this round's live contributors.

        Non-contributors send zeros; the codec's mean over all members is then
        scaled by ``size / contributors``. ``group`` (default: the round's
        group) may be a per-quorum subgroup
        (:class:`~shoal.comm.elastic_sub.ElasticSubgroup`): the mean is then
        over its members, and when every one of them was healed in this round
        (none brings progress of its own) it is skipped and the tensors keep
        their values (a copy of a peer's state).
        """
        g = self.group if group is None else group
        newcomers = g.newcomers
        live = g.size - len(newcomers)
        if live == 0:
            return
        if g.rank in newcomers:
            for t in tensors:
                t.zero_()
        with torch.no_grad():
            codec.mean(list(tensors), list(names), g, tag)
            if 0 < live < g.size:
                torch._foreach_mul_(list(tensors), g.size / live)


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
        self.groups: list[ElasticGroup] = [
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

    def target(self, kind: str) -> tuple[ElasticGroup, str]:
        """The group and meter tag of a round of ``kind``."""
        level = int(kind.partition("@")[2])
        return self.groups[level], f"{self.tag}/g{self.hierarchy.levels[level][1]}"
