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
its own model while downloading is dropped) or, where its host kept its last
life's (``SHOAL_STATE_CACHE``, :mod:`shoal.membership.seed`), resumes that
one, and the small rest (the codec's counters, the module's buffers) comes
with the top-up. Except where the joiner had loaded before (its host's copy)
and trained from that: a fragment whose global copy the load finds bitwise
unchanged since keeps its parameters and their span, and then the inner
optimizer goes on (:meth:`OuterReplay.caught_up`).

A worker that asked to join before the survivors' next round may begin its
download before that round: the survivors offer it their snapshot from
their inner steps (the global copies and outer state do not change there).
Where the survivors' quorum lost no member (a newcomer, or a restart that
asked after the survivors' quorum without it had formed), a survivor
that sees the newer quorum dissolves theirs, so that the next round
admits the newcomer, not the round after it (a period later). A restart whose
early download ends before that round (or that takes it from its host's copy,
:mod:`shoal.membership.seed`) loads it in set-up and trains until the survivors
wait for it at that round's barrier (:func:`train_before_admission`,
:mod:`shoal.membership.preadmit`); the round takes those inner steps.

It loads as soon as its download has finished, after whichever inner step
that is (:func:`enter_between_rounds`), not at the next round's begin: the
inner steps it trains from there go into the next round's mean, weighted by
their share of the period (``k`` steps of ``H``: weight ``k/H``, and the mean
divides by the contributors' summed weight, so a short pseudo-gradient
neither shrinks nor dominates the outer step). Every member learns that
weight at the round's begin from one all-reduce of the joiners' weights
(:meth:`~shoal.membership.catchup.CatchUp.shortfall`), the same table
everywhere. From a fragment's second round on its pseudo-gradient spans a
period and it weighs 1. A joiner whose download ends at a round's begin
loads there and brings nothing to that round (weight 0: it has trained no
step from the global copies yet), unless that round's fragment is one the
load kept (below: it weighs the steps kept); its weight counts from there.

Streaming DiLoCo with ``overlap_steps > 0``: a reduction launched while a
joiner catches up runs on the communication thread with the joiner's part
zeroed and the mean rescaled to the contributors (``contribution()``, the
same answer on every member between two rounds), so the joiner holds the
same landed mean and the ``merge:<k>`` round's check passes; its landed means
are its own (``<key>/pending`` is not downloaded). A launch between two rounds
reads who contributes, so there a joiner loads only at a round's begin and
contributes from the round after, with weight 1, as before.

Where this cannot be exact the group heals blocking (a refusal, see
:meth:`~shoal.membership.elastic.ElasticGroup.refuse_background_heal`):
in a quorum formed while a reduction launched before it has yet to be merged
as it landed (the joiner never received that mean; a retry that reduces in
the foreground is fine), and with a codec that keeps state of each worker's
own (error feedback, PowerSGD: it overrides
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
from shoal.membership.stateserve import clone_tree


class OuterReplay:
    """Records each committed outer round's averaged pseudo-gradient; replays it through the outer optimizer.

    Covers ``<key>/strategy`` (global copies, outer optimizer state); needs
    ``<key>/round`` and ``<key>/schedule`` at admission; ``<key>/optimizer``
    (the inner optimizer) is each member's own: it restarts empty, or from
    what its host kept of its last life's (:meth:`keep_own`, :meth:`restore_own`).
    """

    # The joiner's download starts once the round that admitted it committed (shoal.membership.catchup): a round
    # uses the link, the inner steps that follow do not.
    after_commit = True

    def __init__(self, strategy: Any, key: str, optimizer: torch.optim.Optimizer) -> None:   # a DiLoCo
        self.strategy, self.key, self.optimizer = strategy, key, optimizer
        # Without overlapped reductions nothing reads who contributes between two rounds, so a joiner may load
        # there (enter_between_rounds); with them a launch does, and a joiner loads at a round's begin as before.
        self.enters_between_rounds = strategy.config.overlap_steps == 0
        self.entered: int | None = None   # the inner step at whose end it loaded (its progress counts from there)
        n = len(strategy.fragments)
        # Per fragment, the inner steps its parameters carried from before that load (kept progress, below):
        # its pseudo-gradient spans those too.
        self.extra = [0] * n
        # While a joiner: the global copies its model went on from (clones, taken at its last load), the
        # trained_steps count then, and what each fragment carried from before it; and, during a load, its
        # parameters from before it (before_load). A later load keeps a fragment's parameters where its
        # global copy is still those bytes (caught_up).
        self.base: list[torch.Tensor] | None = None
        self.base_count = 0
        self.base_ahead = [0] * n
        self._held: list[list[torch.Tensor]] | None = None
        self._final = False       # this load is for good: no base to keep after it
        # The step from which every fragment's span counts at most (spans_now): the run's start, or a blocking heal.
        self.reset_at = 0
        self.kept_fragments = 0   # fragments whose progress a load kept (counted over this life)

    def _spans(self) -> list[int]:
        """Per fragment, the inner steps its pseudo-gradient spans now (a joiner: since it loaded, plus what the
        fragment carried from before)."""
        assert self.entered is not None   # internal: only asked of a joiner that has loaded
        since = self.strategy.step - self.entered
        return [since + e for e in self.extra]

    def weight(self) -> float:
        """This joiner's share of a member's weight in the round now: the inner steps the round's fragment's
        pseudo-gradient spans (trained since it loaded, and what a load kept of that fragment's progress) over
        the period (1.0 from a fragment's second round on: its pseudo-gradient then spans a period)."""
        if self.entered is None:
            return 1.0
        spans = self._spans()
        k = self._round_fragment()
        # Capped at 1: after a round given up the others' pseudo-gradients span two periods and the joiner's
        # one and a bit, so it weighs a little more than its share there (rare; the cap keeps it simple).
        return min(1.0, (spans[k] if k is not None else min(spans)) / self.strategy.config.inner_steps)

    def full(self) -> bool:
        """Whether every fragment's pseudo-gradient spans a period now: from here on every round weighs it 1 (a
        kept fragment may weigh 1 in its own round before that)."""
        return self.entered is None or min(self._spans()) >= self.strategy.config.inner_steps

    def longest(self) -> int:
        """The inner steps the longest-going fragment's pseudo-gradient spans now (0 before it loaded)."""
        return 0 if self.entered is None else max(self._spans())

    def _round_fragment(self) -> int | None:
        """The fragment whose round this step runs (``fragment:<k>``, ``merge:<k>``), or None (another round)."""
        rounds = getattr(self.strategy, "rounds", None)
        kind = str(getattr(rounds, "current", ""))
        if kind.startswith(("fragment:", "merge:")):
            k = int(kind.split(":", 1)[1])
            return k if 0 <= k < len(self.extra) else None
        return None

    def trained(self) -> int:
        """The inner steps trained since it loaded (0 before)."""
        return 0 if self.entered is None else self.strategy.step - self.entered

    def rebase(self, trained: int | None) -> None:
        """At an admission that loaded the survivors' schedule (their step counter): its progress counts from
        ``trained`` inner steps before that step, what it trained before its admission (None: not loaded; the
        global copies it went on from stay, for its next load to compare: :meth:`caught_up`)."""
        self.entered = None if trained is None else self.strategy.step - trained
        if trained is None:
            self.extra = [0] * len(self.extra)

    def covers(self, states: dict[str, StateEntry]) -> set[str]:
        return {f"{self.key}/strategy"}

    def admission(self, states: dict[str, StateEntry]) -> set[str]:
        return {f"{self.key}/round", f"{self.key}/schedule"}

    def own(self, states: dict[str, StateEntry]) -> set[str]:
        return {f"{self.key}/optimizer", f"{self.key}/pending"}

    def record(self) -> tuple[int, torch.Tensor] | None:
        """The committing round's mean (``fragment:<k>``, ``merge:<k>``), or None (an empty round)."""
        rounds = self.strategy.rounds
        kind = rounds.current if rounds is not None else ""
        if not kind.startswith(("fragment:", "merge:")):
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
        if read_flag(nonfinite_flag([mean])):
            return
        # The outer gradient may be the reduction buffer, which may hold a landed mean this round merges.
        held = f.delta.clone() if f.grad is f.delta and f.merge_at is not None else None
        f.grad.copy_(mean)
        f.outer.step()
        if held is not None:
            f.delta.copy_(held)

    @torch.no_grad()
    def before_load(self, final: bool = True) -> None:
        """Before a load overwrites the model (the heal's load resets it to the loaded global copies): hold its
        parameters, if an earlier load's global copies are known to compare with (:meth:`caught_up`).
        ``final``: loaded for good (no later load of this life compares with it: no copy of it is kept)."""
        self._final = final
        self._held = None if self.base is None or not self.enters_between_rounds else [
            [p.detach().clone() for p in f.params] for f in self.strategy.fragments]

    @torch.no_grad()
    def caught_up(self) -> bool:
        """After a load: the model restarts from the loaded global copies, except a fragment whose global copy is
        bitwise the one its parameters went on from at this joiner's last load (no round of it committed since:
        its inner steps since then are still progress from that copy, as a member's would be); that fragment
        keeps its parameters and their span. The inner optimizer starts afresh unless a fragment was kept (then
        it is the one those steps trained with). True if a fragment was kept.

        Streaming DiLoCo's restarts are the case for it: its fragments' rounds come a period apart each, so a
        host's copy a round or two old still holds most fragments' global copies, and the steps trained from it
        (its last life's, resumed from the progress file, and its own since) on those fragments count."""
        fragments, held, base = self.strategy.fragments, self._held, self.base
        since = self.strategy.trained_steps - self.base_count
        kept = [held is not None and base is not None and torch.equal(base[i], f.snapshot)
                for i, f in enumerate(fragments)]
        for i, f in enumerate(fragments):
            if kept[i]:
                assert held is not None   # internal: kept only where held
                torch._foreach_copy_([p.detach() for p in f.params], held[i])
            else:
                self.strategy._reset_to_global(f)
        if not any(kept):
            self.optimizer.state.clear()   # trained on the joiner's own model while it downloaded: start afresh
        self.extra = [since + a if k else 0 for k, a in zip(kept, self.base_ahead)]
        self.entered = self.strategy.step   # (or from its last life's, restore_own, where this host kept it)
        self.kept_fragments += sum(kept)
        self._held = None
        # What the next load compares with (none after a load for good: forget_base follows).
        self.base = None if self._final else [f.snapshot.clone() for f in fragments]
        self.base_count, self.base_ahead, self._final = self.strategy.trained_steps, list(self.extra), False
        return any(kept)

    def forget_base(self) -> None:
        """Loaded for good (or a load failed): no later load of this life compares with this one's copies."""
        self.base, self._held = None, None

    def replaced(self) -> None:
        """A blocking heal loaded the run's state and reset the model to its global copies: nothing from before
        is kept, and every fragment's span counts from now (:meth:`spans_now`)."""
        self.forget_base()
        self.reset_at = self.strategy.step

    def keep_own(self) -> dict[str, Any] | None:
        """The inner optimizer's per-parameter state (None before its first step), for this worker slot's next
        life on this host: it then resumes a warm optimizer instead of an empty one (a fresh Adam's first steps
        are about the learning rate in every coordinate, several times a warm one's). The live tensors, not a
        copy: :func:`~shoal.membership.seed.keep_own` copies them to the host at once (no GPU memory taken)."""
        state = self.optimizer.state_dict()["state"]
        return {"type": type(self.optimizer).__name__, "state": state} if state else None

    def keep_progress(self) -> dict[str, Any] | None:
        """This member's progress since its last round, for this worker slot's next life on this host: its model's
        parameters, its inner optimizer's state (the live tensors; :func:`~shoal.membership.seed.keep_progress`
        copies them to the host) and, per fragment, the inner steps its parameters went on for since they last
        took in its global copy (``spans``: streaming DiLoCo's fragments synchronise at different steps, so each
        has its own; every fragment's global copy in the latest copy is the one it went on from). None with
        overlapped reductions (a joiner then loads only at a round's begin)."""
        if not self.keeps_progress:
            return None
        return {"type": type(self.optimizer).__name__, "params": [p.detach() for p in self._params()],
                "state": self.optimizer.state_dict()["state"], "spans": self.spans_now()}

    def spans_now(self) -> list[int]:
        """Per fragment, the inner steps since its parameters last took in its global copy: since its last round
        by the schedule (a given-up round is not seen: fewer, never more), and for a joiner at most its span
        since it loaded."""
        period = self.strategy.config.inner_steps
        step = self.strategy.step
        sched = [(step - f.offset) % period for f in self.strategy.fragments]
        # Not before the run's start (a fragment's first round may not have come yet) or a blocking heal.
        sched = [min(x, max(0, step - self.reset_at)) for x in sched]
        if self.entered is None:
            return sched
        return [min(a, b) for a, b in zip(sched, self._spans())]

    @property
    def keeps_progress(self) -> bool:
        """Whether a restart could go on from this member's progress exactly (see :meth:`keep_progress`)."""
        return self.enters_between_rounds

    def _params(self) -> list[torch.Tensor]:
        """The inner optimizer's parameters, in its state's order (the module's trained parameters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def progress_fits(self, kept: Any) -> str | None:
        """Why ``kept`` (:meth:`keep_progress` of an earlier life) cannot be resumed here, or None."""
        if not self.keeps_progress:
            return "this strategy keeps no progress"
        params = self._params()
        got = kept.get("params") if isinstance(kept, dict) else None
        if not isinstance(got, list) or len(got) != len(params):
            return f"it holds {len(got) if isinstance(got, list) else 'no'} parameters, the model {len(params)}"
        for i, (v, p) in enumerate(zip(got, params)):
            if not isinstance(v, torch.Tensor) or v.shape != p.shape or v.dtype != p.dtype:
                return f"its parameter {i} is not a {p.dtype} tensor of shape {tuple(p.shape)}"
        spans = kept.get("spans")
        n = len(self.strategy.fragments)
        if spans is None and n == 1:   # written before spans were kept: one fragment, its span the steps since
            return self._own_fits(kept)
        if not (isinstance(spans, list) and len(spans) == n and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in spans)):
            return f"it holds no span for each of the {n} fragments"
        return self._own_fits(kept)

    @torch.no_grad()
    def restore_progress(self, kept: dict[str, Any], steps: int) -> str | None:
        """Load ``kept`` (checked by :meth:`progress_fits`) into the model and the inner optimizer, just after
        this joiner loaded the copy it was kept from, and count its ``steps`` inner steps as trained since it
        loaded; None, or why not (then the model is back at the global copies and the optimizer empty)."""
        for p, v in zip(self._params(), kept["params"]):
            p.copy_(v)
        why = self.restore_own(kept)
        if why is not None:
            self.base = None   # (the copy was just loaded: nothing to keep from before it)
            self.caught_up()
            return why
        self.entered = self.strategy.step - steps
        # The fragment whose round made the copy went on for ``steps`` since; the others for longer.
        spans = kept.get("spans") or [steps]
        self.extra = [max(0, x - steps) for x in spans]
        self.base_ahead = list(spans)   # a later load that keeps a fragment counts these with its own
        return None

    def _own_fits(self, kept: Any) -> str | None:
        """Why ``kept`` (an own or progress part) does not fit the inner optimizer, or None."""
        opt, params = self.optimizer, self._params()
        if not isinstance(kept, dict) or kept.get("type") != type(opt).__name__ or not isinstance(
                kept.get("state"), dict):
            return f"it was kept by another optimizer than this {type(opt).__name__}"
        for i, st in kept["state"].items():
            if not isinstance(i, int) or not 0 <= i < len(params) or not isinstance(st, dict):
                return f"it names parameter {i!r}, of {len(params)}"
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != params[i].shape:
                    return (f"its {name!r} of parameter {i} has shape {tuple(v.shape)}, the parameter "
                            f"{tuple(params[i].shape)}")
        return None

    def restore_own(self, kept: Any) -> str | None:
        """Load the inner optimizer state ``kept`` (:meth:`keep_own` of an earlier life) into the empty inner
        optimizer, keeping this life's hyperparameters (a scheduler's learning rate): None if loaded, else why
        not (a different optimizer, parameters of other shapes)."""
        opt = self.optimizer
        why = self._own_fits(kept)
        if why is not None:
            return why
        # A copy: on the CPU load_state_dict keeps the tensors it is given, which the optimizer then updates.
        try:
            opt.load_state_dict({"state": clone_tree(kept["state"]), "param_groups": opt.state_dict()["param_groups"]})
        except Exception as e:  # noqa: BLE001 - whatever else does not fit: this worker trains on, from empty
            opt.state.clear()
            return f"loading it raised {type(e).__name__}: {e}"
        return None


def enter_between_rounds(strategy: Any) -> None:
    """After an inner step: a joiner whose download has finished loads now, so that the rest of the period's
    inner steps go into the next round (:meth:`~shoal.membership.catchup.CatchUp.enter_between_rounds`); a
    source offers its snapshot to the newcomers of a quorum published since its last round
    (:meth:`~shoal.membership.catchup.CatchUp.offer_early`, which dissolves a quorum that lost no member so that
    its next round admits them), who download it while they wait for that round.
    Only without overlapped reductions (``OuterReplay.enters_between_rounds``): then none is ever in flight
    or waiting to be merged between two rounds, so nothing lands in the parameters it resets."""
    catchup = getattr(strategy.group, "catchup", None)   # a static group has no background heal
    if catchup is not None:
        catchup.enter_between_rounds()
        catchup.offer_early(steps_to_round(strategy))   # a source: a joiner waiting for the next round may fetch now


def train_before_admission(strategy: Any) -> bool:
    """In set-up, a worker joining a run in progress: True if it loaded the survivors' state before its admission
    and trains until their next round, which takes its inner steps (:mod:`shoal.membership.preadmit`)."""
    catchup = getattr(strategy.group, "catchup", None)
    return catchup is not None and strategy.config.overlap_steps == 0 and catchup.enter_before_admission()


def admission_due(strategy: Any) -> bool:
    """After an inner step trained before the admission: whether to enter the survivors' round now. They wait
    for it at their round's barrier; or it has trained a whole period from a state its download checked (its
    host's copy, the resumed steps of its last life included): its pseudo-gradient then spans as many inner
    steps as the others', and it waits at the barrier with them (a straggler among them would otherwise let it
    train on, and its drift, weighted 1 like theirs, outgrow theirs)."""
    catchup = strategy.group.catchup
    if catchup.admission_due():
        return True
    pre = catchup.pre
    # (the longest span: a fragment a reload kept goes on with the steps it had)
    return pre is not None and not pre.from_seed and catchup.longest() >= strategy.config.inner_steps


def save_seed(strategy: Any) -> None:
    """At the end of an inner step, after its rounds were applied: a member that committed a round since it last
    wrote (or has never written) writes this host's copy of the global copies and outer state for its next
    life (``SHOAL_STATE_CACHE``, :mod:`shoal.membership.seed`), from a background thread."""
    catchup = getattr(strategy.group, "catchup", None)
    if catchup is not None:
        catchup.save_seed()


def steps_to_round(strategy: Any) -> int:
    """The inner steps this member runs before its next round (0: a round runs at the end of this step)."""
    period = strategy.config.inner_steps
    return min((f.offset - strategy.step) % period for f in strategy.fragments)


def landing_without_joiner(strategy: Any) -> bool:
    """Whether a background reduction launched in this quorum would be merged in a later round as it landed
    (a joiner admitted now never received that mean; a retry that reduces in the foreground is fine)."""
    return any(f.merge_at is not None and not f.redo for f in strategy.fragments)


def own_codec_state(codec: Codec) -> bool:
    """Whether ``codec`` keeps state of each worker's own (it zeroes some of it for a newcomer)."""
    return type(codec).newcomer_state is not Codec.newcomer_state


def enable_background_heal(strategy: Any, group: Any, optimizer: torch.optim.Optimizer) -> None:
    """Register DiLoCo's replay on ``group``, or the reason its quorums heal blocking."""
    if strategy.rounds is None:  # pragma: no cover - setup made them
        return
    group.refuse_background_heal(f"{strategy.name}: a reduction launched before the admission lands after it, "
                                 "without the joiner", lambda: landing_without_joiner(strategy))
    if own_codec_state(strategy.codec):
        group.refuse_background_heal(f"{strategy.name}: the codec {type(strategy.codec).__name__} keeps state "
                                     "of each worker's own")
    group.register_replay(OuterReplay(strategy, strategy.rounds.key, optimizer))
