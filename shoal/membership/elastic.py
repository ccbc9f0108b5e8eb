"""ElasticGroup: a :class:`~shoal.comm.Group` rebuilt for each quorum of a run.

Workers come and go; an ElasticGroup stays the same Python object while the
gloo group under it is replaced for every quorum (a fresh store prefix, a
fresh ``ProcessGroupGloo`` built directly, never the default group). A step
on an elastic group has three parts::

    group.begin_step()      # adopt the latest quorum: rebuild, heal newcomers
    ...collectives...       # failures are recorded, never raised, never waited out
    group.commit()          # the same True/False on every member of the quorum

This module owns the group itself: adopting a quorum (rendezvous, building
its process group, healing, abandoning it after a failure) and the step
(begin, vote, commit or roll back). The rest is split by responsibility:

- :mod:`shoal.membership.transport`: the process group of a quorum and the
  collectives over it; collective failures (a peer's socket closed, the op
  timeout passed, another member reporting a failure) are recorded as
  :class:`~shoal.errors.PeerLostError` or :class:`~shoal.errors.CommTimeoutError`
  in :attr:`ElasticGroup.error`; from then on this step's collectives return
  at once with unreduced data, so the step finishes quickly and the vote
  discards it. A failed gloo group is abandoned: never waited on, never
  destroyed in the training thread (its destructor would wait for its
  stuck operations).
- :mod:`shoal.membership.vote`: the abort flag, the commit vote and the
  limit on consecutive discards.
- :mod:`shoal.membership.heal`: healing newcomers and the rollback
  snapshot of the registered state (the step interface's one registry,
  :mod:`shoal.comm.stepping`).
- :mod:`shoal.membership.views`: subgroups, views over this group's quorums.

The commit vote goes through the coordinator's store; every member reads one
signed decision (:mod:`shoal.membership.vote`).

Healing: in each new group the members exchange (committed step, fresh); if
anyone is behind or new, the lowest-ranked up-to-date member sends every
registered state (model, optimizer, codec, counters) as one serialised blob,
point to point and in chunks, to those members only. A receiver checks it
against its own state before loading any of it (:mod:`shoal.membership.received`:
shapes, dtypes, NaN/Inf); state that fails is refused and never loaded: the
receiver logs why, leaves the run and raises :class:`~shoal.errors.ShoalError`.

Authentication: every member proves it holds the run token when it joins
(:mod:`shoal.membership.auth`); the token is ``ElasticGroup(token=...)``, else
``$SHOAL_TOKEN`` (set by ``shoal run --elastic``), and a group without either
refuses to start (ConfigError). A wrong token gets
:class:`~shoal.errors.AuthError` at the first :meth:`ElasticGroup.begin_step`,
and its holder is never admitted into a quorum.

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
from typing import Any, Callable, Sequence

import torch

from shoal.membership.auth import check_token
from shoal.membership.heal import (CONTROL_TAG, HEAL_CHUNK, HEAL_TAG, healed_barrier, load_blob, plan_heal, restore,
                                     send_state, snapshot, state_blob)
from shoal.membership.transport import BackendFactory, BackendSpec, ElasticCollectives, ElasticStats, Link, gloo_backend
from shoal.membership.views import ElasticHostGroups, ElasticSubgroup
from shoal.membership.vote import Ballot, DiscardStreak, Failures
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


def _env(name: str, value: str | None, what: str) -> str:
    if value is not None:
        return value
    found = os.environ.get(name)
    if not found:
        raise ConfigError(f"{what} not given and {name} is not set; `shoal run --elastic` sets it, "
                          f"or pass it explicitly")
    return found


def run_token(token: str | None) -> str:
    """The elastic run's token: ``token`` if given (it wins over the environment), else ``$SHOAL_TOKEN``."""
    if token is not None:
        return str(check_token(token))
    found = os.environ.get("SHOAL_TOKEN")
    if not found:
        raise ConfigError("an elastic group needs the run token, so that only workers holding it join the "
                          "run: pass ElasticGroup(token=...) or set $SHOAL_TOKEN (`shoal run --elastic` sets "
                          "it for its workers; with `--coordinator` or `shoal coordinator` give them the same "
                          "--token)")
    return str(check_token(found))


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

    Example::

        group = ElasticGroup()                 # under `shoal run --elastic`
        model = shoal.DistributedDataParallel(net, process_group=group)
    """

    def __init__(self, run_id: str | None = None, *, coordinator: str | None = None,
                 timeouts: Timeouts | None = None, min_workers: int | None = None, meter: Meter | None = None,
                 backend_factory: BackendFactory | None = None, client: MemberClient | None = None,
                 host_id: str | None = None, token: str | None = None) -> None:
        # Group.__init__ wants the default process group; an elastic group has none.
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise ConfigError(f"timeouts must be a shoal Timeouts, got {type(timeouts).__name__}")
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.timeout: float | None = self.timeouts.op
        self.meter = meter if meter is not None else Meter()
        self.pg: Any = None
        self.rank, self.size = 0, 1
        self._global_ranks = [0]
        self.step = 0
        self.quorum: Quorum | None = None
        self.stats = ElasticStats()
        self._snapshots: dict[str, Any] = {}
        self._in_step = False
        self._pending: list[Handle] = []  # collectives issued on this quorum since the last _tell
        self._issued = self._told = 0     # collectives issued on this quorum; the count last published
        self._after = 0              # adopt a quorum newer than this one at the next begin_step
        self._fresh = True           # holds no state received from the run yet
        self._healed_since_commit = False  # loaded a heal since this member's last committed step
        self.heal_chunk = HEAL_CHUNK  # bytes per heal message; each must arrive within Timeouts.op
        self.newcomers: tuple[int, ...] = ()  # ranks healed at this step's begin_step
        if min_workers is None:
            min_workers = int(os.environ.get("SHOAL_MIN_WORKERS", "1"))
        info = {"rank": os.environ.get("RANK", "?"), "pid": os.getpid(), "host": host_identity(host_id)}
        # ``client``: a subclass that joins with its own MemberClient (a token, a role) passes it, so
        # that no second store connection is opened for nothing.
        self.client = client or MemberClient(_env("SHOAL_COORDINATOR", coordinator, "coordinator"),
                                             _env("SHOAL_RUN_ID", run_id, "run_id"), self.timeouts, min_workers, info,
                                             token=run_token(token))
        self.hooks = StepHooks()   # registered states (healed, rolled back) and step hooks
        self.trace = Trace()
        failures = Failures(self.client, lambda: self.quorum.prefix if self.quorum is not None else None, self.trace)
        self.link = Link(self.client, self.timeouts, backend_factory or gloo_backend, failures, lambda: self.step)
        self.ballot = Ballot(self.client, self.timeouts, failures)
        self.discards = DiscardStreak()   # why each step since the last commit was discarded
        self.register_state("elastic/discards", self.discards.state, self.discards.load)
        # Joining waits for the first begin_step: a newcomer that announced itself
        # while still building its model would keep the others waiting for it.

    def _live_pg(self) -> Any:
        return self.pg

    def _started(self) -> bool:
        return self.quorum is not None

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
        state in this call (empty when no quorum was adopted): they bring no
        progress of their own to this step.
        """
        hooks = self.hooks
        for fn in hooks.before_begin:
            fn()
        if self._in_step:
            return
        self._tell()
        self.newcomers = ()
        self.link.release()
        if self.client.member_id == 0:
            self.client.join()
        if self.quorum is None or self._after >= self.quorum.qid:
            t0 = time.monotonic()
            self._reconfigure()
            self.stats.reconfigure_s = time.monotonic() - t0
            self._pending, self._issued, self._told = [], 0, 0   # the heal's collectives differ per member
        self._snapshots = snapshot(hooks.states)
        self.error = None
        self._in_step = True

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
        self._tell()   # a member leaving in this step waits for it (see _await_peers)
        verdict = self._vote(q)
        self.trace("vote", verdict=verdict, qid=q.qid, step=self.step, member=self.client.member_id)
        if verdict.startswith("commit"):
            self.step += 1
            self._healed_since_commit = False
            self.stats.commits += 1
            if self.stats.commits == 1:   # once per life: the launcher reads it (shoal.cli.elastic_launch)
                self._mark("trained")
            self.discards.reset()
            for fn in hooks.on_commit:
                fn()
            if int(verdict.partition(":")[2] or 0) > q.qid:
                self._after = q.qid
            return True
        self.stats.discards += 1
        restore(hooks.states, self._snapshots)
        self._abandon()
        self.client.request_quorum(q.qid)
        self._after = q.qid
        self.discards.count(self.error, self.link.failures.aborted, self.timeouts.max_consecutive_discards)
        return False

    def start_step(self) -> None:
        """The older name of :meth:`begin_step`."""
        self.begin_step()

    def should_commit(self) -> bool:
        """The older name of :meth:`commit`."""
        return self.commit()

    def before_start_step(self, fn: Callable[[], None]) -> None:
        """The older name of :meth:`before_begin_step`: call ``fn()`` at the top of every step's begin.

        For a strategy whose step ends lazily (NonBlocking votes an exchange
        when it waits for it, in the next forward): ``fn`` ends the open step
        (``commit()``), so that whatever begins the next one (a sampler's
        ``next_batch``, a forward) begins it after the verdict.
        """
        self.before_begin_step(fn)

    def _vote(self, q: Quorum) -> str:
        return self.ballot.vote(q, self.step, self.size)

    # --- structure -------------------------------------------------------------------
    def subgroup(self, rule: Partition, name: str) -> ElasticSubgroup:
        """This worker's subgroup under ``rule``, re-applied to every quorum (an ElasticSubgroup)."""
        return ElasticSubgroup(self, self.unique_name(name), rule)

    def host_groups(self, name: str) -> ElasticHostGroups:
        """The two levels of a host-aware mean, recomputed for each quorum (an ElasticHostGroups)."""
        return ElasticHostGroups(self, name)

    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "Group | None":
        raise ShoalError("an elastic group cannot be split: its members change from one quorum to the "
                         "next; use shoal.membership.views.ElasticSubgroup (a rule applied to each quorum)")

    # --- quorums ---------------------------------------------------------------
    def _reconfigure(self) -> None:
        limit = self.timeouts.join if self._fresh else self.timeouts.quorum
        deadline = time.monotonic() + limit
        while True:
            q = self.client.wait_quorum(self._after, max(deadline - time.monotonic(), 0.0))
            self.trace("quorum", qid=q.qid, size=len(q.members))
            if self._enter(q, deadline):
                return
            self._after = q.qid
            if time.monotonic() > deadline:
                raise ShoalError(f"could not form a working group within {limit} s "
                                 f"(last error: {self.error}); see docs/elastic.md on timeouts")

    def _enter(self, q: Quorum, deadline: float) -> bool:
        """Rendezvous, build the group, heal; False if superseded or failed (then try the next)."""
        self._abandon()
        st = self.client.store
        st.add(q.prefix + "arrive", 1)
        # A store-level barrier first: unlike the gloo constructor it can give up
        # as soon as a newer quorum supersedes this one.
        while st.add(q.prefix + "arrive", 0) < len(q.members):
            if self.client.latest() > q.qid or time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        self.trace("barrier", qid=q.qid)
        self.client.abort.watch(q.prefix)
        self.quorum, self.rank, self.size = q, q.rank_of(self.client.member_id), len(q.members)
        self._global_ranks = list(range(self.size))
        self.error = None
        try:
            self.pg = self.link.build(q.prefix + "pg/", self.rank, self.size) if self.size > 1 else None
        except Exception as e:  # noqa: BLE001 - a peer did not connect: next quorum
            self._record(PeerLostError(f"building the group of quorum {q.qid} failed: {e}"))
        self.stats.quorums += 1
        self.trace("built", qid=q.qid, ok=self.error is None)
        if self.error is None:
            self._heal(q)
            self.trace("healed", qid=q.qid, ok=self.error is None)
        if self.error is not None:
            self._abandon()
            self.client.request_quorum(q.qid)
            return False
        return True

    def _heal(self, q: Quorum) -> None:
        """Bring the quorum's needy members to the run's state (see :mod:`shoal.membership.heal`)."""
        t0 = time.monotonic()
        finished = self._fresh and self._store_add("finished", 0) > 0   # read before the gather: one verdict
        plan = plan_heal(self, self.step, self._fresh, self._healed_since_commit, finished)
        if plan is None:
            return
        if plan.run_over:
            self._depart()
            raise ShoalError(f"run {self.client.run_id!r} is over: every worker that trained it has finished "
                                "and left, and this quorum holds none of its state; this worker would train "
                                "from scratch alone, so it stops (start a new run with a new run id instead)")
        self.quorum = replace(q, max_step=plan.top)
        if plan.needy:
            blob = send_state(self, plan, self._blob, self.heal_chunk)
            healed_barrier(self, q.prefix)
            if self.error is not None:
                return
            self.stats.heal_bytes = blob.numel()
            if self.rank in plan.needy:
                self._load_blob(blob, plan.src)
                self.step = plan.top
                self.stats.heals_received += 1
                self._healed_since_commit = True   # a copy of a peer's progress until a step commits
            self.stats.heal_s = time.monotonic() - t0
        self.newcomers = plan.newcomers
        self._fresh = False

    def _blob(self) -> torch.Tensor:
        return state_blob(self.hooks.states)

    def _load_blob(self, blob: torch.Tensor, src: int) -> None:
        """Load the healing peer's state, all of it or (refused: leave the run and raise) none of it."""
        member = self.quorum.members[src] if self.quorum is not None else "?"
        load_blob(self.hooks.states, blob, src, member, self._depart)

    def _abandon(self) -> None:
        self.link.retire(self.pg)
        self.pg = None
        for drop in self.link.on_abandon:
            drop()

    def _release_abandoned(self) -> None:
        self.link.release()

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
        if finished:
            self._mark("finished")
            self._store_add("finished", 1)
        self._await_peers()
        self._depart()

    # --- an orderly leave ----------------------------------------------------------------------
    # Collectives that no vote covers (ZeroRedundancyOptimizer.consolidate_state_dict's gather after the
    # last step) end at different times on different members: one that finished may leave at once, and its
    # leave makes the coordinator abort the quorum under a slower member still inside. So each member
    # publishes how many collectives it has been through on this quorum (``past/<member id>`` under the
    # quorum's prefix) before each vote, at each begin_step and at its leave, and leave() waits until every
    # member has published at least its own count.
    def _issue(self, tag: str, result: Any, launch: Callable[[Any], Any],
               post: Callable[[Any], Any] | None = None, whole: bool = False) -> Handle:
        handle = super()._issue(tag, result, launch, post, whole)
        if self.size > 1:
            self._pending.append(handle)
            self._issued += 1
        return handle

    def _tell(self) -> None:
        """Publish this member's collective count on this quorum, if it grew since the last time."""
        if self._issued > self._told and self.quorum is not None:
            self._pending = []
            try:
                self.client.store.set(f"{self.quorum.prefix}past/{self.client.member_id}", str(self._issued))
            except Exception:  # noqa: BLE001 - the coordinator is gone: the step fails on its own
                pass
            self._told = self._issued

    def _await_peers(self) -> None:
        """Before leaving: wait until every member is past this member's collectives on this quorum
        (bounded by ``Timeouts.quorum``; a failure, an abort or a newer quorum ends the wait)."""
        q = self.quorum
        if q is None or self._issued == 0 or self.size == 1:
            return
        for h in self._pending:
            h.wait()
        mine = self._issued
        self._tell()
        if self.error is not None:
            return
        st, deadline = self.client.store, time.monotonic() + self.timeouts.quorum
        keys = [f"{q.prefix}past/{m}" for m in q.members]
        while time.monotonic() < deadline:
            if st.check(keys) and all(int(v) >= mine for v in st.multi_get(keys)):
                return
            if self.link.failures.aborted or self.client.latest() > q.qid:
                return
            time.sleep(0.002)

    def _depart(self) -> None:
        """Leave without the finished mark (a refused heal: the launcher may restart this worker)."""
        self.client.leave()
        self._abandon()

    def _label(self) -> str:
        """This life's launcher label, ``RANK-SHOAL_RESTART@SHOAL_LAUNCH_ID`` (``m<member id>`` outside a
        launcher; without a launch id, no ``@`` part)."""
        rank, launch = os.environ.get("RANK"), os.environ.get("SHOAL_LAUNCH_ID")
        if not rank:
            return f"m{self.client.member_id}"
        return f"{rank}-{os.environ.get('SHOAL_RESTART', '0')}" + (f"@{launch}" if launch else "")

    def _mark(self, what: str) -> None:
        self._store_set(f"{what}/{self._label()}", "1")

    def _store_set(self, key: str, value: str) -> None:
        try:
            self.client.store.set(self.client.key(key), value)
        except Exception:  # noqa: BLE001 - the coordinator is gone: nobody is left to read it
            pass

    def _store_add(self, key: str, n: int) -> int:
        try:
            return int(self.client.store.add(self.client.key(key), n))
        except Exception:  # noqa: BLE001 - as above
            return 0

    def __repr__(self) -> str:
        qid = self.quorum.qid if self.quorum else None
        return f"ElasticGroup(member={self.client.member_id}, quorum={qid}, rank={self.rank}, size={self.size}, step={self.step})"
