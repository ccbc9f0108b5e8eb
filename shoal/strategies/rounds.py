"""The round runner: "issue these collectives, vote, apply or roll back", for every strategy.

A strategy is a schedule of *rounds*: a DDP step's gradient mean, a
parameter average, a DiLoCo pseudo-gradient mean, DASO's host and leader
exchanges. Every round runs the same way on any group (see
:mod:`shoal.comm.stepping`)::

    open_step(group)            # group.begin_step(): elastic: adopt the latest quorum, heal newcomers
    round.reduce(contributes)   # collectives into scratch buffers
    if vote_step(group):        # group.commit(): the same verdict on every member
        round.apply()

A round is a :class:`Round` (its name, failure policy, ``reduce``,
``apply`` and an optional ``after_join``) added to the strategy's
:class:`Rounds`, the one runner that begins, votes and retries. A strategy
never writes ``begin_step(); ... commit()`` itself; code outside a strategy
runs a one-off round with :func:`run_round`. The runner opens and votes
steps only through :func:`~shoal.steps.open_step` and
:func:`~shoal.steps.vote_step`, which the steps that are no round (a DDP
step, ZeRO's, the elastic sampler's) call too: nothing above the membership
package calls ``begin_step`` or ``commit`` by hand (:mod:`shoal.steps`).

A round whose work stays in flight across optimizer steps (NonBlocking's
per-layer reductions: launched in backward, applied in the next forward)
names a ``land`` (wait for that work): :meth:`Rounds.launch` begins it and
:meth:`Rounds.land` votes it later, its step open in between. It is
``DISCARD``: its collectives ran outside the runner and cannot be run again.
Another round of the same runner first lands it on a group whose steps end at
their vote (:func:`~shoal.comm.asks.step_ends_at_vote`); on a group where
work may stay in flight across steps (``traits.work_in_flight``) it may
stay in flight meanwhile.

On a static group ``begin_step`` does nothing and ``commit`` is True, so the
static and elastic paths are one path. On an elastic group a round fails as
a whole: its collectives wrote only scratch buffers, state registered with
``rollback=True`` (codec error feedback) is restored by the group, and the
:class:`FailurePolicy` says what comes next:

- ``DISCARD``: the round is dropped on every member (a DDP step: the step's
  gradients are lost, parameters and optimizer stay as they were);
- ``AVERAGE_SURVIVORS``: it runs again on the next quorum, i.e. with the
  survivors, up to ``max_attempts`` times, then is skipped on every member
  alike (model averaging, DiLoCo: local progress is worth keeping).

A member healed in this round's ``begin_step`` (a newcomer, a restarted
worker) holds a copy of a peer's progress, not its own: :attr:`Rounds.contributes`
is False for it and :meth:`Rounds.mean` gives it zeros and rescales, so a mean
divides by the number of live contributors. The name of the round in progress
travels with the healed state, so a newcomer runs the same collectives as its
peers even when it lands in the retry of a failed round. After a committed
round, if a newer quorum is waiting, an empty round (``ADOPT``) admits it at
once instead of a period later.

The rule of admission: :meth:`Rounds.run` admits a joiner only after the
round's ``apply``, never between the vote and the apply. The admitting
round's heal copies the peers' registered state as it is at that moment; a
joiner admitted before the apply would copy a half-finished step (the vote
taken, the update not yet in) and never apply it, while its peers do: its
state would differ from theirs for good. For the same reason everything a
committed round changes in registered state belongs in its ``apply``, not in
code that runs after :meth:`Rounds.run` returns (DASO lands a global mean in
the round's apply for this: ``tests/dist/test_daso_admission.py``); a round
run with ``admit=False`` leaves the admission to the next one.

Example (periodic parameter averaging that survives a lost peer)::

    rounds = Rounds(group, "avg")
    params = rounds.add(Round("params", reduce=lambda live: rounds.mean(scratch, names, codec, "avg"),
                              apply=lambda: copy_into_params(scratch)))
    rounds.register(model, opt, codec)
    rounds.join()
    rounds.run(params)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from shoal.codecs.base import Codec
from shoal.codecs.identity import Identity
from shoal.comm.asks import step_ends_at_vote
from shoal.comm.group import Group
from shoal.errors import ConfigError
from shoal.steps import open_step, vote_step
from shoal.strategies.resume import ResumableMean

ADOPT = "adopt"  # a round with no collective: adopt the latest quorum, heal newcomers


class FailurePolicy(enum.Enum):
    """What the runner does with a round that failed (see the module docstring)."""

    DISCARD = "discard"
    AVERAGE_SURVIVORS = "average_survivors"


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Round:
    """One kind of round: what it reduces, what it applies, what a failure costs.

    Args:
        name: unique among the runner's rounds; it travels with the healed
            state, so a newcomer runs the round its peers are in.
        reduce: ``reduce(contributes)`` issues the round's collectives into
            scratch buffers (``contributes`` is False for a member healed in
            this round: see :meth:`Rounds.mean`).
        apply: ``apply()`` applies the round once it committed on every member.
        policy: this round's :class:`FailurePolicy` (None: the runner's).
        after_join: run once by :meth:`Rounds.join` after the first round
            (on every member, newcomers included), e.g. to copy a healed
            state into scratch buffers.
        discard: run on every member when an attempt is discarded: drop
            what its ``reduce`` left (the scratch is not applied).
        land: set for a round whose work stays in flight across steps:
            ``reduce`` only starts that work, :meth:`Rounds.launch` returns,
            and ``land()`` waits for it when :meth:`Rounds.land` votes the
            round (its policy is ``DISCARD``).

    Example (the parameters' mean over the live members, applied once every member committed)::

        import torch
        from shoal import Round, Rounds
        from shoal.codecs import Identity

        rounds = Rounds(group, "avg")
        scratch = [p.detach().clone() for p in params]

        def reduce(contributes: bool) -> None:     # collectives into scratch only
            torch._foreach_copy_(scratch, [p.detach() for p in params])
            rounds.mean(scratch, names, Identity(), "avg/params")

        def apply() -> None:                       # committed on every member
            with torch.no_grad():
                torch._foreach_copy_(params, scratch)

        average = rounds.add(Round("params", reduce=reduce, apply=apply))
        rounds.register(model, optimizer)          # what a newcomer heals
        rounds.join()
        rounds.run(average)                        # True: committed and applied everywhere
    """

    name: str
    reduce: Callable[[bool], None] = lambda contributes: None
    apply: Callable[[], None] = _nothing
    policy: FailurePolicy | None = None
    after_join: Callable[[], None] | None = None
    discard: Callable[[], None] = _nothing
    land: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a Round needs a non-empty name, got {self.name!r}")
        if self.policy is not None and not isinstance(self.policy, FailurePolicy):
            raise ConfigError(f"policy must be a FailurePolicy, got {self.policy!r}")
        if self.land is not None and self.policy is FailurePolicy.AVERAGE_SURVIVORS:
            raise ConfigError(f"round {self.name!r} stays in flight (land is set): its collectives ran outside "
                              "the runner and cannot be run again, so its policy is DISCARD, not AVERAGE_SURVIVORS")

    @property
    def in_flight(self) -> bool:
        """Whether this round's work stays in flight across steps (run by :meth:`Rounds.launch`)."""
        return self.land is not None


class Rounds:
    """Runs one strategy's rounds on any group (see the module docstring).

    Args:
        group: the group (static or elastic).
        name: the strategy's name (prefix of the state keys it registers).
        policy: :class:`FailurePolicy` of the rounds (a :class:`Round` may
            name its own).
        max_attempts: tries per round under ``AVERAGE_SURVIVORS``; past them the
            round is skipped on every member alike (training goes on locally).
        background: the strategy can heal joiners in the background
            (``SHOAL_HEAL=background``, :mod:`shoal.membership.catchup`): it
            registers a replay of its rounds, and a joiner still catching up
            is one of :attr:`~shoal.comm.Group.newcomers` (zero weight in
            :meth:`mean`). False (the default): its quorums heal blocking.

    Example::

        rounds = Rounds(group, "avg")
        params = rounds.add(Round("params", reduce=average_into_scratch, apply=copy_scratch_in))
        rounds.register(model, opt, codec)
        rounds.join()
        committed = rounds.run(params)
    """

    def __init__(self, group: Group, name: str, policy: FailurePolicy = FailurePolicy.AVERAGE_SURVIVORS,
                 max_attempts: int = 3, background: bool = False) -> None:
        if not isinstance(group, Group):
            raise ConfigError(f"Rounds needs a shoal Group, got {type(group).__name__}")
        if not isinstance(policy, FailurePolicy):
            raise ConfigError(f"policy must be a FailurePolicy, got {policy!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self.group, self.name = group, name
        if not background:   # no replay of its rounds: a joiner still downloading could never catch up
            group.refuse_background_heal(f"the rounds of {name!r} have no replay for a background heal")
        self._tries = max_attempts
        self.max_attempts = 1 if policy is FailurePolicy.DISCARD else max_attempts
        self.module: nn.Module | None = None   # registered by register(); broadcast by join() on a static group
        self._rounds: dict[str, Round] = {}   # typed rounds by name (add)
        self.current = ADOPT      # the round in progress; healed, so a newcomer joins the same one
        self.flying: Round | None = None   # a launched round not voted yet (see launch)
        self.last_kind = ADOPT    # the round the last run() ran
        self.commits = 0
        self.contributed = 0      # committed rounds (other than adopt) that carried this worker's update
        self.skipped = 0          # rounds given up after max_attempts
        self.resume = ResumableMean()   # mean(resumable=True): what a failed attempt finished, for the next
        self.started = 0          # run()/launch() calls: a resumable mean keeps chunks only within one of them
        # State keys are unique on the group (two strategies over one static Group do not collide;
        # every member builds them in the same order, so the keys agree).
        self.key = group.unique_name(name)
        group.register_state(f"{self.key}/round", lambda: {"kind": self.current}, self._load_round)

    def register(self, module: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 codec: Codec | None = None, get_state: Callable[[], Any] | None = None,
                 load_state: Callable[[Any], None] | None = None) -> None:
        """Register what newcomers heal: module, optimizer, the strategy's own state, and the codec.

        The codec is registered with rollback (a failed round may have
        half-updated it) and heals as :meth:`Codec.newcomer_state` (a peer's
        PowerSGD Qs, but zero error feedback of its own).
        """
        g, name = self.group, self.key
        if module is not None:
            self.module = module
            g.register_state(f"{name}/module", module.state_dict, module.load_state_dict)
        if optimizer is not None:
            g.register_state(f"{name}/optimizer", optimizer.state_dict, optimizer.load_state_dict)
        if get_state is not None and load_state is not None:
            g.register_state(f"{name}/strategy", get_state, load_state)
        if codec is not None:
            g.register_state(f"{name}/codec", codec.state_dict, codec.load_state_dict, rollback=True,
                             heal_load=lambda s: codec.load_state_dict(codec.newcomer_state(s)),
                             snapshot=codec.rollback_state)

    def add(self, round: Round) -> Round:
        """Make ``round`` one of this runner's rounds (every member adds the same ones); returns it.

        A round named :data:`ADOPT` replaces the empty round's default (no
        collective), e.g. with a strategy's own heal of this round's newcomers.
        """
        if not isinstance(round, Round):
            raise ConfigError(f"add needs a Round, got {type(round).__name__}")
        if round.name in self._rounds:
            raise ConfigError(f"{self.name!r} already has a round named {round.name!r}: round names must be unique")
        self._rounds[round.name] = round
        return round

    def _round(self, name: str) -> Round:
        """The round named ``name`` (a healed newcomer knows only its peers' round's name)."""
        found = self._rounds.get(name)
        if found is not None:
            return found
        if name == ADOPT:
            return _ADOPT
        raise ConfigError(f"{self.name!r} has no round named {name!r} (its rounds: {sorted(self._rounds)}); "
                          "every member must add the same rounds before join()")

    def _load_round(self, state: dict[str, Any]) -> None:
        self.current = str(state["kind"])

    def join(self, first: Callable[[], None] | None = None) -> str:
        """The first round (collective, in the strategy's setup): returns the kind that ran.

        For the first workers it is an empty round whose heal copies rank 0's
        state everywhere. A newcomer waits here until its peers reach a
        round, and runs that round with them. ``first()`` runs before that
        round on every group (default: :meth:`~shoal.comm.Group.start_state`
        of the module given to :meth:`register`, under ``<name>/init``: a
        static group, which heals no one, checks the model and gives every
        member rank 0's; an elastic group does nothing there).
        """
        (first or self._start_state)()
        self.run(ADOPT)
        for r in self._rounds.values():
            if r.after_join is not None:
                r.after_join()
        return self.last_kind

    def _start_state(self) -> None:
        if self.module is not None:
            self.group.start_state(self.module, tag=f"{self.name}/init")

    def run(self, round: Round | str, policy: FailurePolicy | None = None, admit: bool = True) -> bool:
        """Run ``round`` (a :class:`Round` or a round's name) until it commits (True) or its attempts failed (False).

        ``policy`` (default: the round's, else the runner's) applies to this run only: e.g.
        ``DISCARD`` for a gradient mean among rounds that otherwise retry.
        ``admit=False``: no empty round admits a waiting newcomer right after
        this one (more of the same optimizer step follows, which a newcomer
        admitted now would miss); the next round admits it.
        """
        kind = self._check_added(round)
        self.started += 1
        if self._round(kind).in_flight:
            raise ConfigError(f"round {kind!r} stays in flight across steps: start it with rounds.launch(round) "
                              "and vote it with rounds.land()")
        if self.flying is not None and step_ends_at_vote(self.group):
            self.land()   # its step ends at its vote: before this round's step begins
        if policy is None and isinstance(round, Round):
            policy = round.policy
        attempts = self.max_attempts if policy is None else (1 if policy is FailurePolicy.DISCARD else self._tries)
        for _ in range(attempts):
            self.current = kind
            open_step(self.group)
            kind = self.last_kind = self.current   # a newcomer just healed runs its peers' round
            now = self._round(kind)
            contributes = self.contributes
            now.reduce(contributes)
            if self._vote(now, contributes):
                if admit and kind != ADOPT and self.group.quorum_pending:
                    self.run(ADOPT)          # admit a waiting newcomer now, not a period later
                    self.last_kind = kind
                return True
        self.current = ADOPT
        self.skipped += 1
        self.resume.clear()      # given up: the next round of this kind starts from nothing
        return False

    def _check_added(self, round: Round | str) -> str:
        kind = round.name if isinstance(round, Round) else round
        if isinstance(round, Round) and self._rounds.get(kind) is not round:
            raise ConfigError(f"round {kind!r} was not added to {self.name!r}: call rounds.add(round) in setup, "
                              "on every member, so that a newcomer can run it by name")
        return kind

    def _vote(self, now: Round, contributes: bool) -> bool:
        """The group's verdict on ``now``'s attempt: apply it (True) or discard it, on every member alike."""
        if vote_step(self.group):
            self.resume.clear()
            now.apply()
            self.commits += 1
            self.contributed += int(contributes and now.name != ADOPT)
            self.current = ADOPT
            return True
        self.resume.snapshot()   # before the retry overwrites the scratch: what every chunk finished
        now.discard()
        return False

    def launch(self, round: Round) -> None:
        """Begin a round whose work stays in flight (``round.land`` set); :meth:`land` votes it later.

        Its step begins (elastic: adopt the latest quorum, heal newcomers)
        and ``reduce`` starts its work; the step stays open until
        :meth:`land`. While a launched round is in flight, launching again
        is the same step (every member launches the same rounds: a training
        loop's forward does) and changes nothing; ``begin_step``'s hooks
        (registered with ``group.before_begin_step``) may land it first.

        Example (NonBlocking's exchange: launched by the forward, voted before the next one)::

            exchange = rounds.add(Round("exchange", land=wait_every_layer, apply=apply_means,
                                        discard=drop_means, policy=FailurePolicy.DISCARD))
            group.before_begin_step(lambda: rounds.land() if work_done() else None)
            rounds.launch(exchange)      # forward; backward launches the reductions
            ...
            rounds.land()                # before the next forward: wait, vote, apply or drop
        """
        kind = self._check_added(round)
        if not round.in_flight:
            raise ConfigError(f"round {kind!r} does not stay in flight (no land): run it with rounds.run(round)")
        open_step(self.group)          # its hooks may land the round in flight: then this is a new step
        if self.flying is not None:
            return
        self.started += 1
        self.current = self.last_kind = kind
        round.reduce(self.contributes)
        self.flying = round

    def land(self) -> bool | None:
        """Vote the launched round (:meth:`launch`): wait for its work, then apply it or discard it.

        True: committed and applied on every member; False: discarded on
        every member (``round.discard()``, rollback state restored); None:
        no round was in flight. No empty round follows: the next step
        admits a waiting newcomer.
        """
        now = self.flying
        if now is None:
            return None
        self.flying = None
        contributes = self.contributes
        if now.land is not None:
            now.land()
        if self._vote(now, contributes):
            return True
        self.current = ADOPT
        self.skipped += 1
        self.resume.clear()
        return False

    @property
    def contributes(self) -> bool:
        """False for a member healed in this round: it holds a copy of a peer's progress, not its own."""
        return self.group.rank not in self.group.newcomers

    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], codec: Codec, tag: str,
             group: Any = None, resumable: bool = False) -> None:
        """Overwrite scratch ``tensors`` with their mean over this round's live contributors.

        Non-contributors send zeros; the codec's mean over all members is then
        scaled by ``size / contributors`` (a joiner that entered between two
        rounds counts as the share of a period it trained,
        :meth:`~shoal.membership.catchup.CatchUp.shortfall`). ``group`` (default: the round's
        group) may be a subgroup (:meth:`Group.subgroup`): the mean is then
        over its members, and when every one of them was healed in this round
        (none brings progress of its own) it is skipped and the tensors keep
        their values (a copy of a peer's state).

        ``resumable`` (an exact mean, :class:`~shoal.codecs.Identity`, on an elastic group): the mean runs
        in chunks, and the next attempt of a failed round keeps the chunks every member finished
        (:mod:`shoal.strategies.resume`), so a member lost mid-round costs about one chunk, not the round.
        """
        g = self.group if group is None else group
        newcomers = g.newcomers
        # A joiner that entered between rounds brings the share of a period it trained (membership.catchup).
        live = g.size - len(newcomers) - g.shortfall()
        if len(newcomers) == g.size:
            return
        if g.rank in newcomers:
            for t in tensors:
                t.zero_()
        scale = g.size / live if 0 < live < g.size else 1.0
        if (resumable and type(codec) is Identity and getattr(g, "elastic", False) and g.size > 1
                and all(t.is_contiguous() for t in tensors)):
            if g.rank in newcomers:   # healed into this attempt: it brings nothing kept (the others agree on 0)
                self.resume.forget(tag)
            self.resume.mean(tensors, names, codec, g, tag, key=(self.current, self.started), scale=scale)
            return
        with torch.no_grad():
            codec.mean(list(tensors), list(names), g, tag)
            if scale != 1.0:
                torch._foreach_mul_(list(tensors), scale)


_ADOPT = Round(ADOPT)


def run_round(group: Group, fn: Callable[[], None] | None = None,
              policy: FailurePolicy = FailurePolicy.DISCARD, max_attempts: int = 3) -> bool:
    """Run one round ``fn`` on ``group`` under ``policy``; True if it committed.

    ``fn`` issues the round's collectives and writes their results in place;
    state it changes must be registered with ``rollback=True`` so that a
    failed attempt leaves no trace before the next one. The one-off form of
    :class:`Rounds`, for code outside a strategy. Without ``fn`` it is the
    vote that ends a step whose collectives already ran (a DDP step's
    gradient means): the step's verdict, always True on a static group, and
    the one place outside :class:`Rounds` where a strategy votes.

    Example (periodic parameter averaging that survives a lost peer)::

        group.register_state("params", lambda: [p.detach().clone() for p in params],
                             lambda s: [p.data.copy_(v) for p, v in zip(params, s)], rollback=True)
        def average() -> None:
            for p in params:
                group.all_reduce(p.data, op="avg", tag="avg/params").wait()
        run_round(group, average, FailurePolicy.AVERAGE_SURVIVORS)
    """
    if not isinstance(policy, FailurePolicy):
        raise ConfigError(f"policy must be a FailurePolicy, got {policy!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
    if fn is not None:   # its collectives count every member: a joiner still downloading has no state yet
        group.refuse_background_heal("a round of collectives (run_round with a function) means every member")
    attempts = 1 if policy is FailurePolicy.DISCARD else max_attempts
    for _ in range(attempts):
        open_step(group)        # a step with no collective still needs a quorum to vote in
        if fn is not None:
            fn()
        if vote_step(group):
            return True
    return False
