"""ElasticGroup: a group that follows the quorums of a run, with a process group per quorum.

Workers come and go; an ElasticGroup stays the same Python object while the
gloo group under it is replaced for every quorum (a fresh store prefix, a
fresh ``ProcessGroupGloo`` built directly, never the default group). A step
on an elastic group has three parts::

    group.begin_step()      # adopt the latest quorum: rebuild, heal newcomers
    ...collectives...       # failures are recorded, never raised, never waited out
    group.commit()          # the same True/False on every member of the quorum

This module owns the group itself: adopting a quorum (rendezvous, building its process group, healing,
abandoning it after a failure) and the step (begin, vote, commit or roll back). It composes the rest
(see :mod:`shoal.membership`): collectives that record failures in :attr:`ElasticGroup.error` instead
of raising (:mod:`~shoal.membership.transport`); the abort flag and the commit vote, through the store,
peer to peer while the coordinator is down (:mod:`~shoal.membership.vote`); healing and rollback
(:mod:`~shoal.membership.heal`, checked before loading: :mod:`~shoal.membership.received`; joiners
download while training with ``SHOAL_HEAL=background``: :mod:`~shoal.membership.catchup`); subgroups
(:mod:`~shoal.membership.views`); an orderly leave (:mod:`~shoal.membership.leaving`); the watch over
members lost between rounds (a :class:`~shoal.membership.watch.PeerWatcher` the group owns); the run
token every member proves when it joins (:mod:`~shoal.membership.auth`).

Example::

    group = ElasticGroup("run1", coordinator="127.0.0.1:29400", token="s3cret-token")
    group.register_state("model", model.state_dict, model.load_state_dict)
    while training:
        group.begin_step()
        group.all_reduce(grad, op="avg", tag="grad").wait()
        if group.commit():
            opt.step()
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from shoal.membership.auth import env_or, run_token
from shoal.membership.catchup import CatchUp, Replayer
from shoal.membership.heal import (CONTROL_TAG, HEAL_CHUNK, HEAL_TAG, healed_barrier, load_blob, plan_heal, restore,
                                     send_state, snapshot, state_blob)
from shoal.membership.leaving import PastCount, mark_life, run_counter
from shoal.membership.rendezvous import Rendezvous
from shoal.membership.transport import (BackendFactory, BackendSpec, ElasticCollectives, ElasticStats, Link, Seat,
                                        gloo_backend)
from shoal.membership.views import ElasticHostGroups, ElasticSubgroup
from shoal.membership.vote import Ballot, DiscardStreak, Failures
from shoal.membership.watch import PeerWatcher
from shoal.comm.group import Group, Handle
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, Timeouts, Trace
from shoal.comm.meter import Meter
from shoal.comm.rules import Partition
from shoal.comm.stepping import StepHooks
from shoal.comm.topology import host_identity
from shoal.errors import ConfigError, PeerLostError, ShoalError

__all__ = ["ElasticGroup", "ElasticStats", "BackendSpec", "BackendFactory", "gloo_backend", "run_token",
           "CONTROL_TAG", "HEAL_TAG", "HEAL_CHUNK"]


class ElasticGroup(ElasticCollectives):
    """A Group whose members follow the run's quorums; see the module docstring.

    Args:
        run_id: names the run at the coordinator (default: ``$SHOAL_RUN_ID``).
        coordinator: ``"host:port"`` of the coordinator (default: ``$SHOAL_COORDINATOR``).
        timeouts: the run's :class:`~shoal.membership.coordinator.Timeouts`; ``op`` is
            this group's per-collective timeout.
        min_workers: no quorum forms with fewer live workers (default:
            ``$SHOAL_MIN_WORKERS``, set by ``shoal run --min-workers``, else 1).
        meter: where bytes are counted (kept across quorums).
        backend_factory: builds a quorum's process group from a
            :class:`BackendSpec` (default :func:`gloo_backend`; tests wrap it
            to inject faults, see :mod:`shoal.testing.faults`).
        host_id: this worker's host identity, published with its join
            record so that per-quorum subgroups (:mod:`shoal.membership.views`)
            know who shares a host (default: ``$SHOAL_HOST_ID``, else the hostname).
        token: the run token (at least 8 characters), proved to the
            coordinator at the join without being sent (default:
            ``$SHOAL_TOKEN``, which ``shoal run --elastic`` sets; an argument
            wins over it). Required: without either, ConfigError. A wrong one
            raises :class:`~shoal.errors.AuthError` at the first
            :meth:`begin_step`.
        orderly_leave: count this member's collectives on each quorum so
            that :meth:`leave` waits for the others to be past them
            (:mod:`shoal.membership.leaving`); False for a caller whose every
            quorum ends in its own vote (:meth:`enter_quorum`, :meth:`vote_quorum`).

    It is not a subclass of :class:`~shoal.comm.Group`: it holds a
    :class:`~shoal.membership.transport.Seat` (rank, size, process group)
    that it replaces with each quorum, and implements the same collectives
    and step interface (``isinstance(group, Group)`` holds: it is registered
    as a virtual subclass).

    Example::

        group = ElasticGroup()                 # under `shoal run --elastic`
        model = shoal.DistributedDataParallel(net, process_group=group)
    """

    def __init__(self, run_id: str | None = None, *, coordinator: str | None = None,
                 timeouts: Timeouts | None = None, min_workers: int | None = None, meter: Meter | None = None,
                 backend_factory: BackendFactory | None = None, client: MemberClient | None = None,
                 host_id: str | None = None, token: str | None = None, orderly_leave: bool = True) -> None:
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise ConfigError(f"timeouts must be a shoal Timeouts, got {type(timeouts).__name__}")
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.seat = Seat()   # this member's place in the current quorum's group; replaced with each quorum
        self.step = 0
        self.quorum: Quorum | None = None
        self.stats = ElasticStats()
        self._snapshots: dict[str, Any] = {}
        self._in_step = False
        self._entering = False       # past a new quorum's barrier, not in the step yet (its heal's collectives)
        self._after = 0              # adopt a quorum newer than this one at the next begin_step
        self._fresh = True           # holds no state received from the run yet
        self._healed_since_commit = False  # loaded a heal since this member's last committed step
        self.heal_chunk = HEAL_CHUNK  # bytes per heal message; each must arrive within Timeouts.op
        self.newcomers: tuple[int, ...] = ()  # ranks healed at this step's begin_step, or catching up
        min_workers = int(os.environ.get("SHOAL_MIN_WORKERS", "1")) if min_workers is None else min_workers
        info = {"rank": os.environ.get("RANK", "?"), "pid": os.getpid(), "host": host_identity(host_id)}
        self.client = client or MemberClient(env_or("SHOAL_COORDINATOR", coordinator, "coordinator"),
                                             env_or("SHOAL_RUN_ID", run_id, "run_id"), self.timeouts, min_workers, info,
                                             token=run_token(token))
        self.hooks = StepHooks()   # registered states (healed, rolled back) and step hooks
        self.trace = Trace()
        failures = Failures(self.client, lambda: self.quorum.prefix if self.quorum is not None else None, self.trace)
        super().__init__(Link(self.client, self.timeouts, backend_factory or gloo_backend, failures, lambda: self.step),
                         meter if meter is not None else Meter(), self.timeouts.op)
        self.past: PastCount | None = PastCount(self.client) if orderly_leave else None
        self.ballot = Ballot(self.client, self.timeouts, failures, lambda: (self.pg, self.rank, self.device))
        self.discards = DiscardStreak()   # why each step since the last commit was discarded
        self.register_state("elastic/discards", self.discards.state, self.discards.load)
        self.catchup = CatchUp(self)      # the background heal (SHOAL_HEAL=background): shoal.membership.catchup
        failures.on_failure.append(self.catchup.step_failed)   # a paced download pauses while the step re-runs
        self.watcher = PeerWatcher(self.client, lambda: self.quorum, self.timeouts.probe)   # watch_peers() starts it
        # Joining waits for the first begin_step: a newcomer announced while building its model would stall others.

    @property
    def rank(self) -> int:
        """This member's rank in the current quorum (0 before the first)."""
        return self.seat.rank

    @property
    def size(self) -> int:
        """The current quorum's size (1 before the first)."""
        return self.seat.size

    @property
    def pg(self) -> Any:
        """The current quorum's process group (None: a quorum of one, none yet, or abandoned after a failure)."""
        return self.seat.pg

    def _live_pg(self) -> Any:
        return self.seat.pg

    def _started(self) -> bool:
        return self.quorum is not None

    # --- the registry (the step interface's, see shoal.comm.stepping) -------------------
    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any],
                       rollback: bool = False, heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None:
        """State that newcomers receive when they heal and, with ``rollback``, that a discard restores
        (the arguments: :meth:`shoal.comm.Group.register_state`)."""
        self.hooks.register(key, get, load, rollback, heal_load, snapshot)

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every committed step (e.g. to advance a data cursor)."""
        self.hooks.on_commit.append(fn)

    def before_begin_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the top of every :meth:`begin_step` (e.g. to end a lazily ended step)."""
        self.hooks.before_begin.append(fn)

    def unique_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``... if taken on this group (every worker asks in the same order)."""
        return self.hooks.unique_name(name)

    @property
    def quorum_pending(self) -> bool:
        """Whether the next :meth:`begin_step` adopts a new quorum (the same answer on every member).

        Strategies that vote only every few steps (local SGD, DiLoCo) run an
        extra, empty round when it is True so that a newcomer waiting to be
        admitted does not wait for another period.
        """
        return self.quorum is None or self._after >= self.quorum.qid

    # --- the step ------------------------------------------------------------
    def begin_step(self) -> None:
        """Begin a step: adopt a newer quorum if one is due (rebuild + heal). Idempotent per step.

        The :meth:`before_begin_step` hooks run first, even within a step.
        Afterwards :attr:`newcomers` lists the ranks that received the run's
        state in this call (empty when no quorum was adopted) and the joiners
        still catching up in the background (:mod:`shoal.membership.catchup`):
        they bring no progress of their own to this step.
        """
        hooks = self.hooks
        for fn in hooks.before_begin:
            fn()
        if self._in_step:
            return
        self._tell()
        self.newcomers = ()
        if self.client.member_id == 0:
            self.client.join()
        if self.quorum is None or self._after >= self.quorum.qid:
            t0 = time.monotonic()
            self._reconfigure()
            self.stats.reconfigure_s = time.monotonic() - t0
            if self.past is not None:
                self.past.reset()   # the heal's collectives differ per member
        self.error = None
        self.catchup.at_begin()   # may record a failure (a download that failed); adds joiners catching up to newcomers
        self._snapshots = snapshot(hooks.states)
        self._in_step, self._entering = True, False

    def commit(self) -> bool:
        """End the step: the same verdict on every member (True: apply it; False: drop it).

        On True the :meth:`on_commit` hooks run. On False, rollback state is
        restored and the next :meth:`begin_step` moves to a new quorum without
        the failed peer; once ``Timeouts.max_consecutive_discards`` steps in a
        row were discarded, :class:`~shoal.errors.PeerLostError` is raised.
        """
        if not self._in_step or self.quorum is None:
            raise ShoalError("commit() called outside a step: call begin_step() first "
                             "(shoal's DistributedDataParallel does so in forward)")
        self._in_step = False
        q, hooks = self.quorum, self.hooks
        verdict = self.ballot.vote(q, self.step, self.size)
        self.trace("vote", verdict=verdict, qid=q.qid, step=self.step, member=self.client.member_id)
        if verdict.startswith("commit"):
            self._tell(agreed=True)
            self.step += 1
            self._healed_since_commit = False
            self.stats.commits += 1
            if self.stats.commits == 1:   # once per life: the launcher reads it (shoal.cli.elastic_launch)
                mark_life(self.client, "trained")
            self.discards.reset()
            if int(verdict.partition(":")[2] or 0) > q.qid:
                self._after = q.qid   # before the hooks: they see quorum_pending (e.g. the paced heal)
            for fn in hooks.on_commit:
                fn()
            return True
        self.stats.discards += 1
        self.catchup.step_failed()   # also where no failure was recorded here (another member's abort flag)
        restore(hooks.states, self._snapshots)
        self._leave(q)
        self.discards.count(self.error, self.link.failures.aborted, self.timeouts.max_consecutive_discards)
        return False

    # --- a member lost between rounds (shoal.membership.watch) -------------------------
    def watch_peers(self) -> None:
        """Watch the quorum's heartbeats from now on (idempotent; averaging strategies turn it on)."""
        self.watcher.start()

    def renew_if_dissolved(self) -> bool:
        """Before a round, outside a step: leave the current quorum now if its abort flag is raised; True if it left.
        The next ``begin_step`` adopts the coordinator's next quorum and the round runs once, instead of failing
        and running again: nothing is discarded (:mod:`shoal.membership.watch`).

        Example::

            group.renew_if_dissolved()   # a peer died during the local steps: re-form first
            group.begin_step()           # adopts the survivors' quorum; the round then runs once
        """
        q = self.watcher.due(self._in_step, self._after)
        if q is not None:
            self.trace("dissolved", qid=q.qid, step=self.step)
            self._leave(q)
        return q is not None

    # --- structure -------------------------------------------------------------------
    def subgroup(self, rule: Partition, name: str) -> ElasticSubgroup:
        """This worker's subgroup under ``rule``, re-applied to every quorum (an ElasticSubgroup)."""
        return ElasticSubgroup(self, self.unique_name(name), rule)

    def host_groups(self, name: str) -> ElasticHostGroups:
        """The two levels of a host-aware mean, recomputed for each quorum (an ElasticHostGroups)."""
        return ElasticHostGroups(self, name)

    # --- quorums ---------------------------------------------------------------
    def _reconfigure(self) -> None:
        limit = self.timeouts.join if self._fresh else self.timeouts.quorum
        deadline = time.monotonic() + limit
        while True:
            q = self.client.wait_quorum(self._after, max(deadline - time.monotonic(), 0.0))
            self.trace("quorum", qid=q.qid, members=list(q.members), me=self.client.member_id)
            try:
                if self._enter(q, deadline):
                    return
            except RuntimeError:   # the coordinator's store went away mid-rendezvous: wait for the next quorum
                self._abandon()
            self._after = q.qid
            if time.monotonic() > deadline:
                raise ShoalError(f"could not form a working group within {limit} s "
                                 f"(last error: {self.error}); see docs/elastic.md on timeouts")

    def _enter(self, q: Quorum, deadline: float) -> bool:
        """Rendezvous, build the group, heal; False if superseded or failed (then try the next)."""
        self._abandon()
        # Both waits give up once the group cannot form, e.g. a member lost there (shoal.membership.rendezvous).
        rv = Rendezvous(self.client, self.link, q, deadline, self.timeouts.probe)
        self.client.abort.watch(q.prefix)
        self._entering = False     # not past this quorum's barrier yet (an earlier one's failed entry cleared)
        self.catchup.prefetch(q)   # a joiner of an averaging strategy: its download may start while it waits here
        why = rv.meet()
        if why is not None:
            self.trace("unmet", qid=q.qid, why=why)
            return False
        self.trace("barrier", qid=q.qid)
        self._entering = True   # the quorum's members are all here: its build, heal and step use the links now
        self.quorum, self.seat = q, Seat(q.rank_of(self.client.member_id), len(q.members))
        self.error = None
        try:
            if self.size > 1:
                self.seat = replace(self.seat, pg=rv.build(self.rank))
        except Exception as e:  # noqa: BLE001 - a peer did not connect, or was lost meanwhile: next quorum
            self._record(PeerLostError(f"building the group of quorum {q.qid} failed: {e}"))
        self.stats.quorums += 1
        self.trace("built", qid=q.qid, ok=self.error is None, error=self.error and str(self.error)[:200])
        if self.error is None:
            self._heal(q)
            self.trace("healed", qid=q.qid, ok=self.error is None)
        if self.error is not None:
            self._leave(q)
            return False
        return True

    def _heal(self, q: Quorum) -> None:
        """Bring the quorum's needy members to the run's state (see :mod:`shoal.membership.heal`)."""
        t0 = time.monotonic()
        finished = self._fresh and run_counter(self.client, "finished", 0) > 0   # read before the gather: one verdict
        # "Fresh" in the plan: holds none of the run's state, also a background joiner still downloading.
        plan = plan_heal(self, self.step, not self.catchup.caught_up, self._healed_since_commit,
                         *self.catchup.column(), run_finished=finished)
        if plan is None:
            return
        if plan.run_over:
            self._depart()
            raise ShoalError(f"run {self.client.run_id!r} is over: every worker that trained it has finished "
                                "and left, and this quorum holds none of its state; this worker would train "
                                "from scratch alone, so it stops (start a new run with a new run id instead)")
        self.quorum = replace(q, max_step=plan.top)
        if self.catchup.adopt(q, plan):   # the needy were admitted as downloaders (newcomers): nobody waits for them
            return
        if plan.needy:
            blob = send_state(self, plan, self._blob, self.heal_chunk)
            healed_barrier(self, q.prefix)
            if self.error is not None:
                return
            self.stats.heal_bytes = blob.numel()
            if self.rank in plan.needy:
                self._load_blob(blob, plan.src)
                self.catchup.state_replaced()
                self.step = plan.top
                self.stats.heals_received += 1
                self._healed_since_commit = True   # a copy of a peer's progress until a step commits
            self.stats.heal_s = time.monotonic() - t0
        self.newcomers = plan.newcomers
        self._fresh = False

    # The background heal (shoal.membership.catchup): a joiner catching up counts zero, replays what it received
    # while downloading; a component that cannot have a non-contributor makes quorums heal blocking.
    def contribution(self) -> tuple[bool, int]:
        return self.catchup.contribution()

    def shortfall(self) -> float:
        """The weight this step's means lack from joiners entering with part of a period (0.0 mostly)."""
        return self.catchup.shortfall()

    def out_ranks(self) -> frozenset[int]:
        return frozenset(self.catchup.out_ranks())

    def register_replay(self, replayer: Replayer) -> None:
        self.catchup.register(replayer)

    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None:
        self.catchup.refuse(why, when)

    def _blob(self) -> torch.Tensor:
        return state_blob(self.hooks.states)

    def _load_blob(self, blob: torch.Tensor, src: int) -> None:
        """Load the healing peer's state, all of it or (refused: leave the run and raise) none of it."""
        member = self.quorum.members[src] if self.quorum is not None else "?"
        load_blob(self.hooks.states, blob, src, member, self._depart)

    def _leave(self, q: Quorum) -> None:
        """Leave quorum ``q`` (failed or dissolved): drop its group; the next begin_step adopts a newer one."""
        self._abandon()
        self.client.request_quorum(q.qid)
        self._after = q.qid

    def _abandon(self) -> None:
        self.link.retire(self.seat.pg)
        self.seat = replace(self.seat, pg=None)
        for drop in self.link.on_abandon:
            drop()

    # --- quorums that the caller forms (collaborative rounds) ----------------------------
    def enter_quorum(self, q: Quorum, deadline: float) -> bool:
        """Work in ``q``, a quorum formed by the caller rather than the coordinator (e.g. by matchmaking).

        The current group is kept when ``q`` has its prefix and members and no
        failure; else rendezvous, build and heal as :meth:`begin_step` does,
        giving up at ``deadline`` (``time.monotonic()``) or on a newer quorum.
        False: not entered. Its work ends with :meth:`vote_quorum`
        (example: :mod:`shoal.collaborative.rounds`).
        """
        cur = self.quorum
        if cur is not None and q.prefix == cur.prefix and q.members == cur.members \
                and (self.pg is not None or self.size == 1) and self.error is None:
            self.quorum = q
            return True
        self.error = None
        return self._enter(q, deadline)

    def vote_quorum(self) -> bool:
        """The commit vote on the work done in the entered quorum: the same True/False on every member.

        Outside :meth:`begin_step`/:meth:`commit`: nothing is rolled back
        and no hook runs; the step counter advances either way (each vote is
        one step of the run's numbering).
        """
        q = self.quorum
        if q is None:
            raise ShoalError("vote_quorum() without a quorum: enter one first (enter_quorum)")
        verdict = self.ballot.vote(q, self.step, self.size)
        self.step += 1
        return verdict.startswith("commit")

    def abandon(self) -> None:
        """Drop the current quorum's group (never reused; its subgroups' too) and forget the quorum."""
        self._abandon()
        self.quorum = None

    def leave(self, finished: bool | None = None) -> None:
        """Leave the run: the others go on without this worker (at most one step is discarded).

        An orderly departure: it first waits until every member of the quorum
        is past the collectives this member went through (e.g.
        ``consolidate_state_dict``'s gather after the last step; bounded by
        ``Timeouts.quorum``; docs/elastic.md, "Leaving").

        A worker that finished its part of the run is marked so
        (``finished/<RANK>-<SHOAL_RESTART>@<SHOAL_LAUNCH_ID>`` in the store): ``shoal run
        --elastic`` does not restart it, and a run whose every trained worker
        finished is over (docs/elastic.md, "When the run is over").
        ``finished=None`` (the default) means: it committed a step in this life
        and no exception is propagating, so a ``leave()`` in a ``finally:``
        that an error passes through never passes that error off as a finished
        part (the launcher then treats the exit as the crash it is).

        Example::

            try:
                train(group)
            finally:
                group.leave()      # marked finished only when train() returned
        """
        if finished is None:
            finished = self.stats.commits > 0 and sys.exc_info()[1] is None
        self.catchup.finish()   # a joiner still catching up finishes; a source serves what it still owes
        if finished:
            mark_life(self.client, "finished")
            run_counter(self.client, "finished", 1)
        self._await_peers()
        self._depart()

    # --- an orderly leave (shoal.membership.leaving) ------------------------------------
    def _issue(self, tag: str, result: Any, launch: Callable[[Any], Any],
               post: Callable[[Any], Any] | None = None, whole: bool = False) -> Handle:
        handle = super()._issue(tag, result, launch, post, whole)
        if self.size > 1 and self.past is not None:
            self.past.add(handle)
        return handle

    def _tell(self, agreed: bool = False) -> None:
        """Publish this member's collective count on this quorum if it grew (``agreed``: a committed vote said it)."""
        if self.past is not None:
            self.past.agree() if agreed else self.past.tell(self.quorum)

    def _await_peers(self) -> None:
        """Before leaving: wait until every member is past this member's collectives on this quorum."""
        if self.past is not None:
            self.past.await_peers(self.quorum, self.size, self.link.failures, self.timeouts.quorum,
                                  lambda: self.error)

    def _depart(self) -> None:
        """Leave without the finished mark (a refused heal: the launcher may restart this worker)."""
        self.watcher.stop()
        self.client.leave()
        self._abandon()

    def __repr__(self) -> str:
        qid = self.quorum.qid if self.quorum else None
        return f"ElasticGroup(member={self.client.member_id}, quorum={qid}, rank={self.rank}, size={self.size}, step={self.step})"


# Not a subclass (no fixed process group to wrap, no Group.__init__ to run) but the same interface: code
# that asks ``isinstance(g, Group)`` before wrapping a torch ProcessGroup takes an elastic group as it is.
Group.register(ElasticGroup)
