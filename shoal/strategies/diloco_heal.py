"""DiLoCo's background heal (``SHOAL_HEAL=background``): a joiner replays the outer steps it missed.

A joiner of an averaging strategy is admitted at once, as a zero-weight
member of the outer rounds (:attr:`Rounds.contributes` is False for it, and
:meth:`Rounds.mean` rescales by the live contributors), and downloads the
run's state in the background (:mod:`shoal.membership.catchup`) while the
survivors run their inner steps. What it needs at once is the schedule: the
round in progress and the inner-step counter, broadcast in the admitting
quorum (a few bytes). What it downloads is what every member holds alike:
the global copies and the outer optimizer's state (:class:`OuterReplay`
covers ``<key>/strategy``). Each outer round that commits during the download
hands every member, the joiner too, the same averaged pseudo-gradient; the
joiner keeps it and, once the snapshot is loaded, steps its outer optimizer
with it: the same operation on the same values as the survivors ran, so its
global copies and outer state are then bitwise theirs. Its parameters are
rebuilt from the global copies (as after a blocking heal), its inner
optimizer starts afresh (each worker's own in DiLoCo; what it accumulated on
its own model while downloading is dropped), and the small rest (the codec's
counters, the module's buffers) comes with the top-up. It contributes from
the round after the one at which it caught up (it then trained its inner
steps from the global copies like everyone).

Where this cannot be exact the group heals blocking (a refusal, see
:meth:`~shoal.membership.elastic.ElasticGroup.refuse_background_heal`):
``overlap_steps > 0`` (a reduction launched before the admission lands
without the joiner, so it never receives that mean), and a codec that keeps
state of each worker's own (error feedback, PowerSGD: it overrides
:meth:`~shoal.codecs.Codec.newcomer_state`).

Example (what :class:`shoal.DiLoCo` does in ``setup`` on an elastic group)::

    enable_background_heal(strategy, group, optimizer)
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.codecs.base import Codec
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.stepping import StateEntry


class OuterReplay:
    """Records each committed outer round's averaged pseudo-gradient; replays it through the outer optimizer.

    Covers ``<key>/strategy`` (global copies, outer optimizer state); needs
    ``<key>/round`` and ``<key>/schedule`` at admission; ``<key>/optimizer``
    (the inner optimizer) is each member's own and restarts empty.
    """

    def __init__(self, strategy: Any, key: str, optimizer: torch.optim.Optimizer) -> None:   # a DiLoCo
        self.strategy, self.key, self.optimizer = strategy, key, optimizer

    def covers(self, states: dict[str, StateEntry]) -> set[str]:
        return {f"{self.key}/strategy"}

    def admission(self, states: dict[str, StateEntry]) -> set[str]:
        return {f"{self.key}/round", f"{self.key}/schedule"}

    def own(self, states: dict[str, StateEntry]) -> set[str]:
        return {f"{self.key}/optimizer"}

    def record(self) -> tuple[int, torch.Tensor] | None:
        """The committing round's mean (``fragment:<k>``), or None (an empty round: nothing to replay)."""
        rounds = self.strategy.rounds
        kind = rounds.current if rounds is not None else ""
        if not kind.startswith("fragment:"):
            return None
        f = self.strategy.fragments[int(kind.split(":", 1)[1])]
        return f.index, f.delta.detach().clone()

    @torch.no_grad()
    def replay(self, update: tuple[int, torch.Tensor] | None) -> None:
        """The outer step the survivors ran on this mean (skipped alike when it is not finite)."""
        if update is None:
            return
        index, mean = update
        f = self.strategy.fragments[index]
        f.delta.copy_(mean)
        if read_flag(nonfinite_flag([f.delta])):
            return
        if f.grad is not f.delta:
            f.grad.copy_(f.delta)
        f.outer.step()

    @torch.no_grad()
    def caught_up(self) -> None:
        for f in self.strategy.fragments:
            self.strategy._reset_to_global(f)
        self.optimizer.state.clear()   # trained on the joiner's own model while it downloaded: start afresh


def own_codec_state(codec: Codec) -> bool:
    """Whether ``codec`` keeps state of each worker's own (it zeroes some of it for a newcomer)."""
    return type(codec).newcomer_state is not Codec.newcomer_state


def enable_background_heal(strategy: Any, group: Any, optimizer: torch.optim.Optimizer) -> None:
    """Register DiLoCo's replay on ``group``, or the reason its quorums heal blocking."""
    if strategy.rounds is None:  # pragma: no cover - setup made them
        return
    if strategy.config.overlap_steps > 0:
        group.refuse_background_heal(f"{strategy.name}: overlap_steps > 0 (a reduction in flight at the "
                                     "admission lands without the joiner)")
    if own_codec_state(strategy.codec):
        group.refuse_background_heal(f"{strategy.name}: the codec {type(strategy.codec).__name__} keeps state "
                                     "of each worker's own")
    group.register_replay(OuterReplay(strategy, strategy.rounds.key, optimizer))
