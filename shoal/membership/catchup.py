"""The background heal: a joiner is admitted at once, downloads the run's state while the others train,
replays the steps it missed, and contributes from then on. No survivor waits for the transfer.

Enabled with ``SHOAL_HEAL=background`` (or ``group.catchup.enabled = True`` on
every worker before the first step), for training whose updates can be
replayed: shoal's DistributedDataParallel without a codec or comm hook,
stepped by :class:`~shoal.elastic.ElasticOptimizer` (which registers its
:class:`OptimizerReplay`), and DiLoCo's outer rounds
(:mod:`shoal.strategies.diloco_heal`: the joiner also receives the strategy's
schedule at its admission, :meth:`Replayer.admission`, and its inner
optimizer is its own, :meth:`Replayer.own`). Where a quorum's members do not all
enable it, or none of them holds the run's state, the blocking heal of
:mod:`shoal.membership.heal` runs as before.

How a join goes (``t`` is the run's committed step)::

    admission (quorum q, step t0)   every member: plan (one all_gather); the joiner takes step t0 and
                                    is a non-contributor: it zeroes its gradients, the others divide by
                                    the contributors; each source clones its state (no host sync) and a
                                    side thread serialises and serves it (stateserve.SnapshotServer)
    steps t0 .. t-1                 survivors train and commit; the joiner fetches the snapshot striped
                                    over every source (paced by the commits: SHOAL_HEAL_PACE, pace.py), and
                                    records each committed step's averaged gradients (as a zero-weight member)
    begin_step(t), download done    joiner: publish "contributes from t+1" with the state keys the
                                    replay does not cover, then load the snapshot (checked as any
                                    heal) and replay the t - t0 recorded steps (optimizer steps): its
                                    model and optimizer now equal the survivors' at t
    begin_step(t+1)                 every member reads that record (signed, in the store): from this
                                    step on the joiner contributes; the lowest-ranked source writes
                                    the uncovered states (the sampler's cursor, the discard streak:
                                    a few bytes) to the store, the joiner loads them

Every member computes the contributors from the same facts: who was
admitted (the plan, the same table everywhere) and the joiner's signed
record, which it writes before its vote on step ``t``, so every member
reads it before ``begin_step(t+1)`` (no one passes step ``t`` without that
vote). A source that dies mid-transfer loses its ranges to the other
sources; if all of them fail, the joiner fails that step and asks for a
new quorum, where it is needy again (a new snapshot, from whoever is there).
A download the joiner gives up on (that quorum heals it blocking, or admits
it again) is stopped, not left running (:mod:`shoal.membership.fetch`).

Example::

    # every worker, before its first step (or SHOAL_HEAL=background in their environment)
    group = ElasticGroup()
    group.catchup.enabled = True
    model = shoal.DistributedDataParallel(net, process_group=group)
    opt = ElasticOptimizer(torch.optim.AdamW(model.parameters()), group)   # registers the replay
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shoal.comm.objects import from_bytes, to_bytes
from shoal.errors import CommTimeoutError, ConfigError, PeerLostError, ShoalError
from shoal.membership.fetch import Fetch
from shoal.membership.heal import CONTROL_TAG as _CONTROL_TAG, HealPlan, broadcast_object, load_blob
from shoal.membership.pace import StepPace, heal_pace, heal_rate
from shoal.membership.preadmit import ADMIT_WAIT_S, EarlyEntry, held_mark
from shoal.membership.received import check_received
from shoal.membership.replay import OptimizerReplay, Replayer
from shoal.membership.seed import StateSeed, keep_own, keep_progress, restore_own, resume_progress
from shoal.membership.stateserve import SnapshotServer, clone_tree, local_address

log = logging.getLogger("shoal.elastic")
MODES = ("blocking", "background")
EARLY_PEEK_S = 0.5   # a source between rounds reads a newer quorum's record at most this often
JOIN_MARGIN = 2      # ... and dissolves its quorum for a join only this many inner steps or more before a round
OWN_TAG = "own-state"   # the store-key name whose run-qualified form tags a slot's own-state file (seed.restore_own)
__all__ = ["CatchUp", "CatchUpStats", "OptimizerReplay", "Pending", "Replayer", "MODES", "heal_pace", "heal_rate"]


@dataclass
class Pending:
    """A joiner still catching up, as every member of the quorum sees it."""

    hid: int                      # the heal it downloads (the quorum id of its admission)
    ready: int | None = None      # the step from which it contributes (its signed record; entering between
    #                               rounds: the exchange at each begin_step, see CatchUp.enter_between_rounds)
    keys: tuple[str, ...] = ()    # the state keys its replay does not cover (topped up at ``ready``)
    read: bool = False            # its signed "ready" record was read
    weight: float = 1.0           # its share of a member's weight in this step's means (entering between rounds)
    full_at: int | None = None    # the step from which it is a full member: its top-up's step (``ready``, or later for a
    #                               joiner entering between rounds: until then it stays a downloader in every
    #                               quorum's plan, so its weight is agreed in each)


@dataclass
class CatchUpStats:
    """What this worker's background heals did (a joiner's side and a source's side)."""

    admitted_step: int = -1       # the step at which this worker was admitted as a non-contributor
    caught_up_step: int = -1      # the step at whose begin it loaded and replayed (contributes from the next)
    replayed: int = 0             # steps replayed (the survivors' commits during the download)
    download_bytes: int = 0
    download_s: float = 0.0
    download_held_s: float = 0.0  # seconds its requests waited while it was in a round (averaging strategies)
    admitted_at: float = 0.0      # time.time() of the admission and of the first contributing step
    contributes_at: float = 0.0
    entered_between_rounds: bool = False   # loaded between two rounds (an averaging strategy's joiner)
    trained_before_admission: int = -1    # inner steps it trained before the round that admitted it took them
    #                                       (preadmit.py; -1: it did not, or they were dropped as stale)
    early_from_copy: bool = False         # ... it began training from this host's copy (SHOAL_STATE_CACHE)
    early_reloads: int = 0                # ... that copy was stale: it reloaded the offered state meanwhile
    own_restored: int = 0         # loads after which its own state (DiLoCo's inner optimizer) resumed its last
    #                               life's, kept on this host (seed.py), instead of starting empty
    resumed_steps: int = 0        # inner steps of its last life since this host's copy that it went on from
    #                               (seed.resume_progress: its model and own optimizer; 0: none)
    kept_fragments: int = 0       # fragments whose progress a load kept (their global copy had not changed)
    first_weight: float = 0.0     # its weight in the first round it contributed to (its share of a period)
    by_source: dict[int, int] = field(default_factory=dict)   # bytes received from each source member
    failed_sources: list[int] = field(default_factory=list)
    prefetched_bytes: int = 0     # bytes it had received when it was admitted (a download begun before: prefetch)
    seeded_bytes: int = 0         # bytes of its download taken from this host's copy (SHOAL_STATE_CACHE, seed.py)
    served: int = 0               # snapshots this worker offered as a source
    offered_early: int = 0        # of them, offered between two rounds to a quorum not adopted yet (offer_early)
    dissolved_for_join: int = 0   # quorums this worker dissolved between rounds to admit newcomers (offer_early)
    admissions: int = 0           # times admitted as a downloader (again after a download that failed)
    slots: int = 0                # paced download (SHOAL_HEAL_PACE): the commits that opened a slot
    pauses: int = 0               # ... the failed steps that paused it (pace.StepPace.pause)


class CatchUp:
    """The background heal of one :class:`~shoal.membership.elastic.ElasticGroup` (see the module docstring)."""

    def __init__(self, group: Any) -> None:
        mode = os.environ.get("SHOAL_HEAL", "blocking")
        if mode not in MODES:
            raise ConfigError(f"SHOAL_HEAL must be one of {MODES}, got {mode!r}")
        self.group = group
        self.enabled = mode == "background"
        self.rate = heal_rate()                 # a source's bytes/s to joiners (SHOAL_HEAL_RATE), None: no limit
        self.pace_fraction = heal_pace()        # a joiner's share of each step (SHOAL_HEAL_PACE), None: no pace
        self.pace: StepPace | None = None       # joiner: this download's slots (pace.py)
        self.replayers: list[Replayer] = []
        self.refusals: list[tuple[str, Callable[[], bool] | None]] = []   # why (and when) it cannot
        self.fetch: Fetch | None = None         # joiner: this admission's download (fetch.py); None when none
        self.early: Fetch | None = None         # joiner: a download begun before its admission (prefetch)
        self.pre: EarlyEntry | None = None      # joiner: loaded that download and trains until it is admitted
        self._held_told = False                 # this life has marked in the store that the run holds state
        self._seen = -1                         # source: the newest quorum offer_early has read
        self._offers: dict[int, int] = {}       # source: heal id -> the step whose begin state it offered
        self._peeked = 0.0                      # source: when it last read a newer quorum's record
        self.pending: dict[int, Pending] = {}   # member id -> joiner still catching up, this quorum
        self.server: SnapshotServer | None = None
        self.stats = CatchUpStats()
        self.before_chunk: Any = None           # tests: handed to the Download (parks it)
        self.seed = StateSeed.from_env()        # this worker slot's copy of the state on this host (seed.py)
        self._seed_blob: bytes | None = None    # joiner: what the last life wrote there, read once
        self._seed_read = False
        self._seed_lock = threading.Lock()      # the fetch threads read it (an early one, then the admission's)
        self._seed_due = True                   # a member holding the state writes it after the next inner step
        self._copy_gen = 0                      # copies asked to be written (their progress names the one it is of)
        self._since_copy = 0                    # inner steps since the last copy was asked to be written
        self.hid = -1                           # joiner: the heal it downloads, -1 when none
        self.records: list[list[Any]] = []
        self.loaded = False
        self._covered_keys: set[str] = set()
        group.on_commit(self._record)

    # --- what every member sees -------------------------------------------------------
    def register(self, replayer: Replayer) -> None:
        self.replayers.append(replayer)

    def refuse(self, why: str, when: Callable[[], bool] | None = None) -> None:
        """A component that cannot have a non-contributor among its members (whenever ``when()`` is True,
        asked at each quorum's plan; default: always): those quorums heal blocking. Asked again with the
        same ``why`` (a round run every few steps), it is kept once."""
        if all(w != why for w, _ in self.refusals):
            self.refusals.append((why, when))

    def column(self) -> tuple[int, bool]:
        """This member's entries of the heal plan's table: the heal it downloads (-1: none), capable."""
        refused = any(when is None or when() for _, when in self.refusals)
        return self.hid, self.enabled and bool(self.replayers) and not refused

    def contribution(self) -> tuple[bool, int]:
        """(whether this member contributes to this step's means, how many members do)."""
        g = self.group
        if not self.pending or g.quorum is None:
            return True, g.size
        out = [m for m, p in self.pending.items() if p.ready is None or p.ready > g.step]
        return g.client.member_id not in out, g.size - len(out)

    def shortfall(self) -> float:
        """How much weight this step's means lack from joiners that entered between rounds: each contributes
        the share of a period it trained since it loaded (:meth:`enter_between_rounds`), so a mean over the
        contributors divides by ``contributors - shortfall``. 0.0 otherwise; the same on every member."""
        g = self.group
        if not self.pending or g.quorum is None:
            return 0.0
        return sum(1.0 - p.weight for p in self.pending.values() if p.ready is not None and p.ready <= g.step)

    def out_ranks(self) -> set[int]:
        """The ranks of this step's non-contributors (joiners still catching up), the same on every member."""
        g = self.group
        if not self.pending or g.quorum is None:
            return set()
        return {g.quorum.rank_of(m) for m, p in self.pending.items() if p.ready is None or p.ready > g.step}

    def _snapshot(self) -> Any:
        """A copy of what the replay keeps current (what a source serves and a member's host copy holds; the rest
        is topped up, or each member's own), cloned on the training thread's stream."""
        states = self.group.hooks.states
        return clone_tree({k: states[k].get() for k in sorted(self._covered())})

    def _covered(self) -> set[str]:
        """The states a snapshot holds: those the replayers keep up to date (the same keys on every member)."""
        states = self.group.hooks.states
        return set().union(*(r.covers(states) for r in self.replayers))

    def adopt(self, q: Any, plan: HealPlan) -> bool:
        """A new quorum's plan: who is still catching up; admit the needy as downloaders if all can.

        True when the needy members were admitted this way (no blocking heal).
        """
        old = self.pending
        self.pending = {}
        for r, hid in plan.downloading.items():
            kept = old.get(q.members[r])
            self.pending[q.members[r]] = kept if kept is not None and kept.hid == hid else Pending(hid)
        g, me = self.group, self.group.client.member_id
        joiners = {q.members[r] for r in plan.needy} if plan.background else set()
        if self.server is not None:   # a joiner that died or gave up no longer needs its snapshot
            self.server.keep({(m, p.hid) for m, p in self.pending.items()} | {(m, q.qid) for m in joiners})
        if self.early is not None and (me not in joiners or self.early.hid != q.qid):
            self._stop_early()   # begun for another quorum, or this one heals it blocking: never used
        if self.pre is not None and me not in joiners:
            self._drop_pre("this quorum heals it blocking", self.trained())
        trained = self.trained()   # (a joiner training before its admission) before the schedule is loaded
        if self.hid >= 0 and g.rank in plan.needy and not plan.background:
            log.warning("giving up the background heal %d: this quorum heals blocking", self.hid)
            self.hid = -1
            self._abandon()
        if not (plan.background and plan.needy):
            return False
        if not self._send_admission(plan):
            return True   # the broadcast failed (recorded): this quorum is given up, nobody was admitted
        g.newcomers, g._fresh = plan.newcomers, False
        for m in joiners:
            self.pending[m] = Pending(q.qid)
        sources = [q.members[r] for r in plan.ready]
        if me in joiners:
            self._admit(q.qid, sources, plan.top, trained)
        elif me in sources:
            self._serve(q.qid, joiners)
        return True

    def _send_admission(self, plan: HealPlan) -> bool:
        """The states joiners need at once (a strategy's schedule: a few bytes), from ``plan.src`` to every
        member, loaded by the joiners; False if the broadcast failed."""
        g, states = self.group, self.group.hooks.states
        keys = sorted(set().union(*(r.admission(states) for r in self.replayers)))
        if not keys:
            return True
        got = broadcast_object(g, plan.src, {k: states[k].get() for k in keys} if g.rank == plan.src else None)
        if g.error is not None:
            return False
        if g.rank in plan.needy:
            why = "it does not verify" if not isinstance(got, dict) or set(got) != set(keys) else \
                check_received(got, {k: states[k].get() for k in keys})
            if why is not None:
                log.error("refusing the admission state of rank %d: %s; this worker leaves the run", plan.src, why)
                g._depart()
                raise ShoalError(f"refused the admission state of the background heal: {why}")
            for k in keys:
                states[k].load(got[k])
        return True

    def at_begin(self) -> None:
        """Every begin_step, after the quorum is adopted and before the rollback snapshot: joiners still
        catching up are this step's newcomers too (they bring no progress of their own)."""
        if self.pace is not None:
            self.pace.step_begun()   # a failure of this step pauses the download again (StepPace.pause)
        if not self.pending:
            return
        g = self.group
        t, me = g.step, g.client.member_id
        self._ready_or_fail()
        if me in self.pending and not self.loaded and self.fetch is not None and self.fetch.done.is_set():
            self._catch_up(self.pending[me], t, self.fetch)
        if self._between_rounds() and any(p.full_at is None or p.full_at >= t for p in self.pending.values()):
            self._exchange(t)   # until every joiner of this quorum is a full member (full_at: agreed everywhere)
        if me not in self.pending:
            self._write_topups(t)
        elif self.loaded and self.hid >= 0 and g.error is None:
            p = self.pending[me]
            if p.full_at is not None and p.full_at <= t:
                self._top_up(p, t)
        # A joiner admitted now that trained from this step's state before (preadmit.py) is needy in the plan, yet
        # contributes from this step (its weight, agreed in the exchange above): not a newcomer.
        entered = {g.quorum.rank_of(m) for m, p in self.pending.items() if p.ready is not None and p.ready <= t}
        g.newcomers = tuple(sorted((set(g.newcomers) - entered) | self.out_ranks()))

    def _between_rounds(self) -> bool:
        """Whether joiners may load between two rounds (an averaging strategy without overlapped reductions):
        then who contributes, and with what weight, is agreed at each begin_step by :meth:`_exchange`."""
        return any(getattr(r, "enters_between_rounds", False) for r in self.replayers)

    def _exchange(self, t: int) -> None:
        """Every member: the weight each joiner brings to step ``t``'s means, agreed in one all-reduce.

        A joiner that loaded between rounds cannot publish that in time for
        the others to read it before this step (a record written during the
        inner steps may land after a peer's begin_step), so each joiner puts
        its own weight in its slot (the share of a period it trained since it
        loaded, 0 while downloading) and every member reads the same table. It
        runs at every begin_step until every joiner of the quorum is a full member, on
        every member alike (the pending set comes from the quorum's plan, and
        ``full_at`` from these exchanges). A joiner is topped up, and stops
        being a downloader in later quorums' plans, only once it is a full member: until
        then each quorum it is in agrees on its weight here.
        """
        g = self.group
        me = g.client.member_id
        # Row 0: each joiner's weight in this step's means; row 1: 1.0 once it is a full member (every part of
        # its progress spans a period; streaming DiLoCo's kept fragment may weigh 1 in its round before that).
        table = torch.zeros(2, g.size, dtype=torch.float64, device=g.device)
        if me in self.pending and self.loaded:
            table[0, g.rank] = self._weight()
            table[1, g.rank] = float(self._full())
        g.all_reduce(table, op="max", tag=_CONTROL_TAG).wait()
        if g.error is not None:
            return
        (weights, fulls), unread = table.tolist(), False
        for m, p in self.pending.items():
            r = g.quorum.rank_of(m)
            w, full = min(1.0, float(weights[r])), fulls[r] >= 1.0
            if w > 0.0:
                p.ready, p.weight = t if p.ready is None or p.ready > t else p.ready, w   # the first: t
                if not full:   # not yet (a step with no inner steps since the last one, e.g. an admission's
                    p.full_at = None   # empty round, keeps its weight); the joiner's own _catch_up set t + 1
                elif p.full_at is None or p.full_at > t:
                    p.full_at = t    # its top-up's step; it stays a downloader until then (see Pending)
                unread |= not p.read and m != me
            else:
                p.ready, p.weight, p.full_at = None, 1.0, None
        if unread:   # a joiner entering now wrote its record (the keys it lacks) before it took part in this
            self._ready_or_fail()
            lacking = [m for m, p in self.pending.items() if p.full_at == t and not p.read and m != me]
            if lacking and g.error is None:   # no top-up can be written without the keys: fail the step
                g._record(ShoalError(f"the ready records of joiners {lacking} were not in the store although they "
                                     "entered this step (written before the exchange)"))
        own = self.pending.get(me)
        if own is not None and own.ready == t and self.stats.contributes_at < self.stats.admitted_at:
            self.stats.first_weight, self.stats.contributes_at = own.weight, time.time()

    def _weight(self) -> float:
        """This joiner's weight now: the smallest its replayers give (1.0 for a replayer without one)."""
        return min((float(r.weight()) for r in self.replayers if hasattr(r, "weight")), default=1.0)

    def _full(self) -> bool:
        """Whether this joiner is a full member now: every replayer says so (one without ``full``: weight 1)."""
        for r in self.replayers:
            if hasattr(r, "full"):
                if not r.full():
                    return False
            elif hasattr(r, "weight") and float(r.weight()) < 1.0:
                return False
        return True

    def longest(self) -> int:
        """The inner steps the longest-going part of a joiner's progress spans (what it trained since it loaded,
        and the steps a load kept; :meth:`trained` for a replayer without such parts)."""
        return max([int(r.longest()) for r in self.replayers if hasattr(r, "longest")], default=self.trained())

    def enter_between_rounds(self) -> bool:
        """A joiner of an averaging strategy, between two rounds: if its download has finished, load the
        snapshot and replay now (its model restarts from the global copies), so that the inner steps it
        trains from here on go into the next round, weighted by their share of the period (:meth:`shortfall`),
        instead of waiting for the next begin_step. A failed download is left to that begin_step (it fails the
        step and asks for a new quorum). True if it loaded now."""
        g = self.group
        me = g.client.member_id
        fetch = self.fetch
        if (self.hid < 0 or self.loaded or g._in_step or fetch is None or not fetch.done.is_set()
                or me not in self.pending or not self._between_rounds() or g.client.down.is_set()):
            return False   # (during a coordinator outage its ready record could not be written: later)
        blob, error = fetch.result
        if blob is None or error is not None:
            return False
        self._catch_up(self.pending[me], g.step, fetch, in_step=False)
        self.stats.entered_between_rounds = self.loaded
        return self.loaded

    @property
    def entering(self) -> bool:
        """A joiner that loaded between rounds and has not contributed yet: its inner steps from now on go into
        its first contribution (e.g. what a benchmark counts as its committed work)."""
        return self._between_rounds() and (self.pre is not None or (self.hid >= 0 and self.loaded))

    def _key(self, hid: int, what: str) -> str:
        return str(self.group.client.key(f"heal/{hid}/{what}"))

    def _read_ready(self) -> bool:
        """Read the joiners' "ready" records not read yet; False if the coordinator's store did not answer."""
        st, book = self.group.client.store, self.group.client.book
        try:
            agreed = self._between_rounds()   # then the exchange decides when it contributes; the record gives keys
            for m, p in self.pending.items():
                if p.read or m == self.group.client.member_id:
                    continue
                k = self._key(p.hid, f"ready/{m}")
                if st.check([k]):
                    rec = book.open(st.get(k), writer=m, kind="heal ready")
                    if rec is not None:
                        p.keys, p.read = tuple(str(x) for x in rec["keys"]), True
                        if not agreed:
                            p.ready = p.full_at = int(rec["from"])
        except Exception as e:  # noqa: BLE001 - the coordinator is unreachable: a blip or an outage
            log.debug("reading the joiners' ready records failed (%s)", e)
            return False
        return True

    def _ready_or_fail(self) -> None:
        """At a step's begin: read the ready records, or fail the step if the coordinator cannot tell.

        A record this member cannot read (the coordinator's store does not
        answer) is no answer: the joiner may be contributing from this step on
        its peers (who read it), and counting it out here would make every mean
        of the step wrong. So, as the heartbeat does, a blip is tried again
        (until the client declares an outage, at most ``heartbeat_timeout``),
        and past it this step fails on every member; the next one waits for the
        coordinator, as a membership change does during an outage."""
        g = self.group
        deadline = time.monotonic() + g.timeouts.heartbeat_timeout
        while not self._read_ready():
            if g.client.down.is_set() or time.monotonic() > deadline:
                g._record(CommTimeoutError(f"the coordinator at {g.client.address} did not answer: this member "
                                           "cannot read whether the joiners catching up contribute to this step"))
                return
            time.sleep(0.01)

    def _stored(self, what: str, call: Callable[[], Any], wait: float) -> tuple[bool, Any]:
        """``(True, call())`` once the coordinator's store answers ``call``; a blip is tried again for up to
        ``wait`` s, an outage the client declared is not waited for: then ``(False, None)``, logged."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return True, call()
            except Exception as e:  # noqa: BLE001 - the coordinator is unreachable: a blip or an outage
                if self.group.client.down.is_set() or time.monotonic() > deadline:
                    log.warning("the coordinator's store did not answer %s (%s)", what, e)
                    return False, None
            time.sleep(0.01)

    def _write_topups(self, t: int) -> None:
        """The lowest-ranked member holding the run's state writes what joiners that are full members from now on still
        lack (not for one whose keys it could not read: that step has failed, see :meth:`_exchange`). A write
        the coordinator does not take fails the step (every member then discards it; the next one writes
        again), as the joiner would otherwise wait for it and the others count it in."""
        g = self.group
        holders = [r for r, m in enumerate(g.quorum.members) if m not in self.pending]
        if not holders or g.rank != holders[0]:
            return
        states = g.hooks.states
        for m, p in self.pending.items():
            if p.full_at == t and p.read:
                blob = to_bytes({k: states[k].get() for k in p.keys})
                body = {"b": base64.b64encode(blob.numpy().tobytes()).decode()}
                key = self._key(p.hid, f"top/{m}/{t}")
                ok, _ = self._stored(f"the top-up of joiner {m}", lambda: g.client.store.set(
                    key, g.client.book.seal(body)), g.timeouts.heartbeat_timeout)
                if not ok:
                    g._record(CommTimeoutError(f"the coordinator at {g.client.address} did not take the top-up of "
                                               f"joiner {m} (heal {p.hid}): this step fails on every member"))
                    return

    # --- a source -------------------------------------------------------------------------
    def _serve(self, hid: int, joiners: set[int]) -> None:
        g = self.group
        if self.server is None:
            self.server = SnapshotServer(g.client.token, g.client.run_id, local_address(g.client.address),
                                         idle=g.timeouts.join, rate=self.rate)
        # Offered between the rounds (offer_early) with no step committed since: the same state as now.
        offered, self._offers = self._offers.get(hid), {h: st for h, st in self._offers.items() if h > hid}
        left = self.server.admit(hid, joiners, g.step) if offered == g.step else joiners
        if left:   # to those that have not fetched it; it replaces an offer made before a step committed since
            self._offer(hid, left)

    def _offer(self, hid: int, joiners: set[int]) -> None:
        """Clone what the replay covers now and serve it as heal ``hid`` to ``joiners``; its record (published
        once serialised) names the step it is the state at the begin of, which the joiner checks."""
        g = self.group
        server, key, step = self.server, self._key(hid, f"src/{g.client.member_id}"), g.step
        if server is None:   # pragma: no cover - _serve and offer_early start it first
            raise ShoalError("a snapshot offered before this member's snapshot server was started")
        tree = self._snapshot()   # the step boundary
        book, client = g.client.book, g.client
        self._offers[hid] = step

        def published(size: int, sha: str, digests: list[str]) -> None:   # on the serialising thread: its own
            # store connection; the range digests let a joiner keep what its host's copy has right (seed.py)
            client.store.clone().set(key, book.seal({"addr": server.address, "size": size, "sha": sha,
                                                     "step": step, "digests": digests}))

        server.offer(hid, tree, joiners, published, step)
        self.stats.served += 1

    def offer_early(self, steps_left: int = 0) -> bool:
        """A source between two rounds (an averaging strategy's inner step): if the coordinator published a
        quorum with newcomers, serve them its snapshot now, so their download runs during the inner steps left
        before that quorum's first round, when the links are idle. ``steps_left``: the inner steps this member
        runs before its next round.

        What it serves is what it would clone at that round's begin (:meth:`_serve`): the replay covers only
        the global copies and the outer optimizer's state, which no inner step changes, and a dissolved
        quorum (its abort flag raised) commits no step: the next round leaves it (``renew_if_dissolved``) and
        adopts that quorum, or a newer one whose joiners then download afresh. A quorum lost no member when
        the newer one holds all of its members and more (a join): a member that sees it dissolves it
        (:meth:`_dissolve_for_join`), so that the next round admits the newcomers instead of running once
        more without them (which would make the offer stale and the newcomers wait a period). Not within
        ``JOIN_MARGIN`` inner steps of the next round: a faster member may already be in that round, which
        the flag would make it discard; the round's vote then tells of the newcomers, as before. Should a
        step commit anyway, the record names the step, :meth:`_serve` offers again and the joiner drops what
        it fetched (:meth:`~shoal.membership.fetch.Fetch.want`). The newest quorum id comes from the
        heartbeat thread (``MemberClient.peek_latest``: no store call here); a newer quorum's record is read
        at most every ``EARLY_PEEK_S`` (not during the coordinator's outage). True if it offered now."""
        g = self.group
        q = g.quorum
        if (time.monotonic() - self._peeked < EARLY_PEEK_S or q is None or g._in_step or self.hid >= 0
                or g._fresh or g.client.down.is_set() or not self._between_rounds() or not self.column()[1]):
            return False
        g.client.peek_latest.set()   # from now on the heartbeat thread reads the newest quorum id for us
        dissolved = g.client.abort.raised(q.prefix)
        if not dissolved and (steps_left < JOIN_MARGIN or g._after >= q.qid):
            return False
        latest = g.client.latest_seen
        if latest <= max(q.qid, self._seen):
            return False
        self._peeked = time.monotonic()
        try:
            nxt = g.client.quorum(latest)
        except Exception as e:  # noqa: BLE001 - unreadable (the coordinator is down, a bad record): no offer
            log.debug("could not read quorum %d to offer its joiners a snapshot early (%s)", latest, e)
            return False
        newcomers = {m for m in nxt.members if m not in q.members}
        if g.client.member_id not in nxt.members or not newcomers:
            self._seen = latest   # each published quorum is read once (none to offer it to)
            return False
        if not dissolved and not self._dissolve_for_join(q, nxt, newcomers):
            return False   # a member lost: its flag comes from the peer watch or the coordinator; read again until then
        self._seen = latest
        if self.server is None:
            self.server = SnapshotServer(g.client.token, g.client.run_id, local_address(g.client.address),
                                         idle=g.timeouts.join, rate=self.rate)
        for h in [h for h in self._offers if q.qid < h < nxt.qid]:   # an earlier quorum's, never adopted
            self.server.drop(h)
            del self._offers[h]
        self._offer(nxt.qid, newcomers)
        self.stats.offered_early += 1
        log.info("offered the joiners %s of quorum %d a snapshot before its first round", sorted(newcomers), nxt.qid)
        return True

    def _dissolve_for_join(self, q: Any, nxt: Any, newcomers: set[int]) -> bool:
        """Raise quorum ``q``'s abort flag because quorum ``nxt`` adds ``newcomers`` to all of its members;
        False (nothing raised) if ``nxt`` lacks one of them or the store did not answer."""
        g = self.group
        if not set(q.members) <= set(nxt.members):
            return False
        try:
            g.client.store.set(q.prefix + "abort", f"newcomers {sorted(newcomers)} in quorum {nxt.qid}")
        except Exception as e:  # noqa: BLE001 - a blip: the next peek tries again, or the round's vote tells
            log.debug("could not dissolve quorum %d for the joiners of quorum %d (%s)", q.qid, nxt.qid, e)
            return False
        g.client.abort.saw(q.prefix)
        self.stats.dissolved_for_join += 1
        g.trace("dissolve-for-join", qid=q.qid, latest=nxt.qid, newcomers=sorted(newcomers), step=g.step)
        log.info("quorum %d dissolved between rounds: quorum %d adds %s; its next round admits them", q.qid, nxt.qid,
                 sorted(newcomers))
        return True

    # --- the joiner -------------------------------------------------------------------------
    def prefetch(self, q: Any) -> None:
        """A worker that holds none of the run's state, about to wait for quorum ``q``'s other members to reach
        its first step: start downloading the snapshot they may offer before that step (:meth:`offer_early`).
        Only where it would be admitted in the background into an averaging strategy's rounds (a replayer
        that enters between rounds); the admission keeps the download if it is of that quorum's heal, else
        it is stopped unused (:meth:`adopt`)."""
        g = self.group
        if self.early is not None and self.early.hid == q.qid:
            return
        self._stop_early()
        others = [m for m in q.members if m != g.client.member_id]
        if not (g._fresh and self.hid < 0 and others and self._between_rounds() and self.column()[1]):
            return
        early = Fetch(g, q.qid, others, g.step, True, None, self.before_chunk, early=True, seed=self._seeding())
        early.start()        # its store connection may fail (a blip): then there is no early download to stop
        self.early = early
        log.info("waiting for quorum %d: fetching its snapshot early from whoever of %s offers it", q.qid, others)

    def _stop_early(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            early.stop(wait=min(2.0, self.group.timeouts.op))

    def enter_before_admission(self) -> bool:
        """A fresh worker joining an averaging strategy's run in progress, in the strategy's set-up: if the
        snapshot the survivors offer for its quorum arrives before their next round, load it now (as a joiner
        loads between two rounds) and return True: it trains its inner steps until :meth:`admission_due`, and the
        round that admits it takes them (:mod:`shoal.membership.preadmit`). False: it enters the usual way."""
        entry = EarlyEntry.wait(self)
        if entry is None:
            return False
        try:   # a host's copy that does not load (another program's, cut off) is no reason to leave the run
            self._replay(entry.blob, count=False, leave=(lambda: None) if entry.from_seed else None)
        except ShoalError as e:
            log.warning("could not load this host's copy of the state (%s): waiting for the admission", e)
            self._rebase(None)
            return False
        if entry.from_seed and self.seed is not None:   # ... and its last life's inner steps since that copy
            self.stats.resumed_steps = resume_progress(self.seed, self.replayers, self.group.client.key(OWN_TAG),
                                                       entry.blob)
            if self.stats.resumed_steps:
                self.group.trace("progress-resumed", steps=self.stats.resumed_steps)
        if not entry.announce(self):
            self._rebase(None)   # (its admission heals it as a downloader: the load then resets the model)
            self.stats.resumed_steps = 0
            return False
        with self._seed_lock:   # a later download (a newer quorum's) keeps the ranges this copy still has right
            self._seed_blob, self._seed_read = entry.blob, True
        self.pre = entry
        self.stats.early_from_copy = entry.from_seed
        self.group.trace("early-entry", qid=entry.q.qid, seed=entry.from_seed)
        return True

    def host_copy(self) -> bytes | None:
        """This worker slot's copy of the state on this host (its last life's, ``SHOAL_STATE_CACHE``), read once;
        None without one or for a strategy that is not an averaging one."""
        return self._seed() if self.seed is not None and self._after_commit() else None

    def admission_due(self) -> bool:
        """A joiner training before its admission, after an inner step: whether to enter its quorum now
        (its other members wait at the barrier, or the quorum changed; store reads). First, trained from its
        host's copy: if the download has ended with other bytes, it loads those and trains from them."""
        pre = self.pre
        if pre is None:
            return True
        blob = pre.fresher()
        if blob is not None:   # trained from a stale host's copy: from the state the survivors offered from now on
            self._replay(blob, count=False)
            pre.blob = blob
            self.stats.early_reloads += 1
            self.stats.resumed_steps = 0   # (its last life's steps went on from that copy: dropped with it, but
            # where a fragment's global copy is unchanged: kept, CatchUpStats.kept_fragments)
            with self._seed_lock:
                self._seed_blob = blob
            log.info("this host's copy was stale: training from the state offered for quorum %d from now on",
                     pre.q.qid)
            self.group.trace("early-entry-reloaded", qid=pre.q.qid)
        return pre.due(self)

    def trained(self) -> int:
        """The inner steps a joiner training before its admission has trained since it loaded, those of its last
        life it went on from included (0 when it has not loaded)."""
        return min((int(r.trained()) for r in self.replayers if hasattr(r, "trained")), default=0)

    def _rebase(self, trained: int | None) -> None:
        """After the admission loaded the schedule: the replayers count the joiner's progress from ``trained``
        inner steps before the step it has now (None: from nothing, it has not loaded)."""
        for r in self.replayers:
            if hasattr(r, "rebase"):
                r.rebase(trained)

    def _drop_pre(self, why: str, trained: int) -> None:
        """The steps trained before the admission do not count: it is a zero-weight downloader as before."""
        self.pre = None
        self._rebase(None)
        self.stats.resumed_steps = 0   # (those of its last life it went on from are dropped with them)
        log.warning("dropping the %d inner steps trained before the admission as this round's (%s); its next load "
                    "keeps those of the fragments no round changed since", trained, why)
        self.group.trace("early-entry-dropped", trained=trained, why=why)

    def _enter_admitted(self, t: int, trained: int) -> None:
        """Admitted at step ``t`` holding that step's state since before (loaded by
        :meth:`enter_before_admission`): it contributes to this step's round the ``trained`` inner steps,
        weighted as a joiner that loaded between two rounds (the weight exchange at this begin_step). Its signed
        "ready" record (the keys the top-up brings) goes to the store first; a record the coordinator does not
        take fails this step, and the next quorum heals this worker again."""
        g = self.group
        fetch = self.fetch
        blob, _ = self._downloaded(fetch) if fetch is not None else (None, None)
        self.fetch = None
        keys = self._write_ready(t, g.timeouts.heartbeat_timeout)
        if keys is None or blob is None:
            self._ready_not_taken()
            self._rebase(None)
            self.stats.resumed_steps = 0   # (dropped with the steps it trained)
            self.hid, g._fresh = -1, True   # needy again in the next quorum
            return
        self._rebase(trained)
        self._forget_base()   # loaded for good: what it trained from is this step's state
        p = self.pending[g.client.member_id]
        p.ready = p.full_at = t + 1   # the exchange at this begin_step decides (between rounds)
        p.keys, p.read = keys, True
        self._covered_keys, self.loaded = self._covered(), True
        with self._seed_lock:   # loaded for good: no later download of this life needs the copy
            self._seed_blob = None
        self.stats.caught_up_step, self.stats.entered_between_rounds = t, True
        self.stats.trained_before_admission = trained
        g.stats.heals_received += 1
        g.stats.heal_bytes = len(blob)
        g.trace("early-entry-admitted", step=t, trained=trained)
        log.info("admitted at step %d holding its state since before: the %d inner steps it trained go into this "
                 "round", t, trained)

    def _admit(self, hid: int, sources: list[int], top: int, trained: int = 0) -> None:
        g = self.group
        g.step = top
        g._healed_since_commit = True
        self.hid, self.records, self.loaded = hid, [], False
        self.stats.admitted_step, self.stats.admitted_at = top, time.time()
        self.stats.admissions += 1
        self._abandon()   # an earlier download given up on (admitted again): stopped, never used
        early, self.early = self.early, None
        pre, self.pre = self.pre, None
        # Begun before this admission: kept if it fetches (or, still choosing its sources, will fetch only) the
        # state at this step's begin and has not failed; a snapshot offered before a step that committed since
        # is stale.
        kept = early is not None and early.hid == hid and early.want(top, sources)
        if pre is not None and not (kept and pre.fetch is early and self._checked(pre, g)):
            self.pre = pre   # (a newer quorum's download, or a round committed since the offer it loaded)
            self._drop_pre(f"the state it trained from is not the one at step {top}'s begin", trained)
            pre = None
        if early is not None and kept:
            self.fetch, self.stats.prefetched_bytes = early, early.received
            if pre is not None:   # loaded before what it now downloaded: it trained from this step's state
                self._enter_admitted(top, trained)
                return
            log.info("admitted at step %d as a non-contributor; heal %d already under way (%d bytes)", top, hid,
                     early.received)
            return
        if early is not None:
            early.stop(wait=min(2.0, g.timeouts.op))
        after = self._after_commit()
        if self.pace_fraction is not None and not after:
            self.pace = StepPace(self.pace_fraction)   # step-synchronous only: DiLoCo downloads in its idle inner steps
            self.pace.admitted(time.monotonic())
        self.fetch = Fetch(g, hid, sources, top, after, self.pace, self.before_chunk, seed=self._seeding())
        self.fetch.start()
        log.info("admitted at step %d as a non-contributor; fetching heal %d from members %s", top, hid, sources)

    @staticmethod
    def _checked(pre: EarlyEntry, g: Any) -> bool:
        """At the admission that kept ``pre``'s download (of this step's state): whether what it trained from is
        that state, byte for byte. Loaded from its host's copy, it waits for the download to end first (a copy
        whose ranges all match ends within a second of the sources' offer; at most ``ADMIT_WAIT_S``), but not
        once the download asks the network for ranges: those are held while this member is in a round
        (``Download.hold``), so the copy is stale and waiting would only hold the survivors."""
        deadline = time.monotonic() + min(ADMIT_WAIT_S, g.timeouts.op / 2)
        while not pre.fetch.done.is_set() and time.monotonic() < deadline:
            dl = pre.fetch.download
            if dl is not None and dl.to_fetch:
                return False
            pre.fetch.done.wait(0.005)
        if not pre.fetch.done.is_set():
            return False
        blob, error = pre.fetch.result
        return blob is not None and error is None and blob == pre.blob

    def _after_commit(self) -> bool:
        """An averaging strategy's joiner (DiLoCo): it downloads once its admitting step committed, in the
        idle inner steps, unpaced; a step-synchronous one downloads while training, paced if asked."""
        return any(getattr(r, "after_commit", False) for r in self.replayers)

    def step_failed(self) -> None:
        """This step failed (its first recorded failure, or a discard verdict): a paced download pauses until the
        retried step commits (:meth:`~shoal.membership.pace.StepPace.pause`), so the survivors' recovery and
        retried step do not share the link with it. Any thread; nothing to do without a paced download."""
        pace = self.pace
        if pace is not None:
            pace.pause(time.monotonic())
            self.stats.pauses = pace.pauses

    def _unpace(self) -> None:
        """``leave()``: the rest of the download goes flat out (no pace, no holding during rounds)."""
        if self.pace is not None:
            self.pace.release()
        self.pace = None
        if self.fetch is not None:
            self.fetch.release()

    def _abandon(self) -> None:
        """Stop and forget the download given up on (fetch.py): its pace is not lifted, nothing it fetched
        is used (the result lives on the forgotten Fetch). Its thread ends within a poll (50 ms) and one
        store write; it is joined for up to 2 s (or ``Timeouts.op`` if shorter), else left to end alone."""
        fetch, self.fetch, self.pace = self.fetch, None, None
        if fetch is not None and not fetch.done.is_set():
            fetch.stop(wait=min(2.0, self.group.timeouts.op))

    def _downloaded(self, fetch: Fetch) -> tuple[bytes | None, str | None]:
        """The result of this joiner's finished download, its statistics noted."""
        dl = fetch.download
        if dl is not None:
            self.stats.download_bytes, self.stats.download_s = dl.received, dl.seconds
            self.stats.download_held_s, self.stats.seeded_bytes = dl.held_s, dl.seeded
            self.stats.by_source, self.stats.failed_sources = dict(dl.by_source), sorted(dl.failed)
        return fetch.result

    def finish(self) -> None:
        """At ``leave()``: a joiner still downloading waits for it and catches up its model and optimizer
        (so that what it saves is the run's state); a source waits until its joiners have fetched what
        it serves. Both bounded by ``Timeouts.quorum``."""
        g = self.group
        deadline = time.monotonic() + g.timeouts.quorum
        self._unpace()   # nobody commits steps any more: the rest of the download goes flat out
        self._stop_early()   # begun for a quorum this worker never entered
        if self.pre is not None:
            self._drop_pre("it left before its admission", self.trained())
        fetch = self.fetch
        if self.hid >= 0 and not self.loaded:
            done = fetch is not None and fetch.done.wait(g.timeouts.quorum)
            blob, error = self._downloaded(fetch) if fetch is not None and done else (None, "it did not finish")
            if blob is not None and error is None:
                self._replay(blob)
                self.loaded = True
            else:
                log.error("left before catching up (%s): this worker's model and optimizer are NOT the run's "
                          "state (group.catchup.caught_up is False)", error)
        while self.server is not None and time.monotonic() < deadline:
            # Joiners of this quorum only: one offered a snapshot early for a quorum never adopted may never
            # say it is done (its download was dropped). Their 'done' also ends an offer (owed() shrinks).
            owed = [(h, m) for h, m in self.server.owed() if m in self.pending]
            try:
                if all(g.client.store.check([self._key(h, f"fetched/{m}")]) for h, m in owed):
                    return
            except Exception as e:  # noqa: BLE001 - the coordinator is unreachable: wait on the joiners' word
                if g.client.down.is_set():
                    log.warning("leaving without knowing whether joiners %s fetched their snapshots (the "
                                "coordinator does not answer: %s)", sorted({m for _, m in owed}), e)
                    return
            time.sleep(0.01)

    @property
    def caught_up(self) -> bool:
        """False while this worker holds no copy of the run's state yet (fresh, or admitted in the background
        and still downloading)."""
        return not self.group._fresh and (self.hid < 0 or self.loaded)

    def _replay(self, blob: bytes, count: bool = True, leave: Callable[[], None] | None = None) -> None:
        """Load the snapshot's model and optimizer (what the replay covers) and replay the recorded steps."""
        g = self.group
        states = g.hooks.states
        # Only what the replay brings up to date; the rest (a sampler's cursor, the discard streak) is the
        # joiner's own until the top-up (it counts zero meanwhile, so its own is harmless there).
        covered = self._covered()
        for r in self.replayers:   # (DiLoCo: its parameters, for caught_up to keep a fragment still current)
            if hasattr(r, "before_load"):
                r.before_load(final=count)
        try:
            load_blob({k: states[k] for k in covered}, torch.frombuffer(bytearray(blob), dtype=torch.uint8), -1,
                      "(background heal)", g._depart if leave is None else leave)
            for rec in self.records:
                for r, update in zip(self.replayers, rec):
                    r.replay(update)
            kept = [bool(r.caught_up()) for r in self.replayers]   # True: it kept progress from before (DiLoCo)
        except BaseException:
            self._forget_base()   # (what before_load held goes; a model half loaded keeps nothing from before)
            raise
        if any(kept):
            self.stats.kept_fragments = sum(getattr(r, "kept_fragments", 0) for r in self.replayers)
            g.trace("progress-kept", fragments=self.stats.kept_fragments)
        elif self.seed is not None and restore_own(self.seed, self.replayers, g.client.key(OWN_TAG)):
            self.stats.own_restored += 1   # its inner optimizer resumes its last life's, not empty
            g.trace("own-restored")
        self.stats.replayed, self.records = len(self.records), []
        with self._seed_lock:   # the host's copy is stale now: the end of the next inner step writes it
            self._seed_due = True
            if count:   # (before its admission the copy stays: the early download may still be reading it)
                self._seed_blob = None
        self._covered_keys = covered
        if count:   # (loaded before its admission: counted once that admission kept it, _enter_admitted)
            g.stats.heals_received += 1
            g.stats.heal_bytes = len(blob)

    def _seeding(self) -> Callable[[], bytes | None] | None:
        """What a joiner's download calls (on its own thread) for its seed, or None: no SHOAL_STATE_CACHE, or a
        strategy that is not an averaging one (whose state a later life may still find unchanged)."""
        held = self.seed is not None or self._seed_blob is not None   # (a copy loaded before its admission)
        return self._seed if held and self._after_commit() else None

    def _seed(self) -> bytes | None:
        """What this worker slot's last life wrote on this host (read once, kept until this life has loaded), or
        None (no file)."""
        seed = self.seed
        with self._seed_lock:
            if not self._seed_read and seed is not None:
                self._seed_read, self._seed_blob = True, seed.read()
                if self._seed_blob is not None:
                    log.info("this host holds %d bytes of an earlier copy of the run's state (%s): the heal keeps "
                             "the ranges that still match", len(self._seed_blob), seed.path)
            return self._seed_blob

    def save_seed(self) -> bool:
        """A member of an averaging strategy between two rounds: after a round committed (and once at the
        start), write what a joiner's download covers to this worker slot's file on this host (seed.py), and
        beside it what is its own (the inner optimizer's state), from a background thread; only the clones run
        here. True if it asked for a write."""
        g = self.group
        if (self.seed is None or not self.enabled or g._in_step or not self.caught_up or g.quorum is None
                or not self._after_commit()):
            return False
        if not self._seed_due:   # an inner step since the copy: every SHOAL_STATE_CACHE_EVERY, the progress too
            self._since_copy += 1
            self._save_progress()
            return False
        self._seed_due = False
        if self.seed.broken is not None:   # switched off for this life: no clone, no host copy
            return False
        own = keep_own(self.replayers, g.client.key(OWN_TAG)) if self.seed.own_broken is None else None
        self._copy_gen, self._since_copy = self._copy_gen + 1, 0
        self.seed.save(self._snapshot(), own, gen=self._copy_gen)
        return True

    def state_replaced(self) -> None:
        """A blocking heal loaded the run's state over this member's: its host's copy is stale, and no progress
        is written until the next copy is (a progress must go on from the copy beside it); nothing from before
        it is kept by a later load."""
        self._seed_due = True
        for r in self.replayers:
            if hasattr(r, "replaced"):
                r.replaced()

    def _forget_base(self) -> None:
        for r in self.replayers:
            if hasattr(r, "forget_base"):
                r.forget_base()

    def _save_progress(self) -> None:
        """Every ``seed.every`` inner steps since the copy: this member's model and own optimizer, for its next
        life on this host to go on from (seed.resume_progress), written once that copy is."""
        seed = self.seed
        if (seed is None or seed.every < 1 or self._since_copy % seed.every or seed.broken is not None
                or seed.progress_broken is not None):
            return
        part = keep_progress(self.replayers, self.group.client.key(OWN_TAG), self._since_copy)
        if part is not None:
            seed.save_progress(self._copy_gen, part)

    def _record(self) -> None:
        self._seed_due = True   # the state a joiner would download may have changed: written again (save_seed)
        if not self._held_told and self.enabled:
            self._held_told = True   # the run holds state: a worker joining later may train before its admission
            try:
                self.group.client.store.set(held_mark(self.group.client), "1")
            except Exception as e:  # noqa: BLE001 - a blip: a later joiner then waits at its barrier, as before
                log.debug("could not mark that the run holds state (%s)", e)
        if self.pending:   # after the vote every joiner's "ready" record is in: every member answers
            self._read_ready()   # contribution() alike until the next begin_step (e.g. a background reduction);
            # unread (the coordinator did not answer): the next begin_step reads again, or fails its step
        if self.hid >= 0 and not self.loaded:
            self.records.append([r.record() for r in self.replayers])
            if self.pace is not None:   # the next slot: a share of the step, striped over the live sources;
                # none while the next step forms a new quorum (another joiner's admission: its gloo connect
                # and its step keep the link to themselves)
                self.pace.committed(time.monotonic(), open_slot=not self.group.quorum_pending)
                self.stats.slots = self.pace.slots

    def _write_ready(self, t: int, wait: float) -> tuple[str, ...] | None:
        """This joiner's signed "ready" record for step ``t`` (it contributes from ``t + 1``, and names the state
        keys the top-up brings: neither replayed nor its own): those keys, or None if the coordinator did not
        take it within ``wait`` s."""
        g = self.group
        own: set[str] = set().union(*(r.own(g.hooks.states) for r in self.replayers))
        keys = tuple(sorted(set(g.hooks.states) - self._covered() - own))
        key, body = self._key(self.hid, f"ready/{g.client.member_id}"), {"from": t + 1, "keys": list(keys)}
        ok, _ = self._stored("this joiner's ready record", lambda: g.client.store.set(key, g.client.book.seal(body)),
                             wait)
        return keys if ok else None

    def _ready_not_taken(self) -> None:
        g = self.group
        g._record(CommTimeoutError(f"the coordinator at {g.client.address} did not take this joiner's ready record "
                                   f"(heal {self.hid}): this step fails on every member"))

    def _catch_up(self, p: Pending, t: int, fetch: Fetch, in_step: bool = True) -> None:
        """Load the finished download and replay; first its signed "ready" record (the keys to top up) goes to
        the store. A record the coordinator does not take leaves everything as it was, to try again: at a
        step's begin (``in_step``) that step fails on every member, between two rounds the next inner step
        tries again (an outage is not waited for)."""
        g = self.group
        blob, error = self._downloaded(fetch)
        if blob is None or error is not None:
            self.fetch, self.pace = None, None   # it ended: nothing to stop
            log.warning("background heal %d failed (%s); asking for a new quorum to heal again", self.hid, error)
            g._record(PeerLostError(f"this joiner's download of the run's state failed: {error}"))
            self.hid, g._fresh = -1, True   # still counted out in this (lost) step; needy in the next quorum
            return
        if len(self.records) != t - self.stats.admitted_step:
            raise ShoalError(f"background heal: {len(self.records)} updates recorded for steps "
                             f"{self.stats.admitted_step}..{t - 1}; a committed step was not recorded")
        keys = self._write_ready(t, 0.0 if not in_step else g.timeouts.heartbeat_timeout)
        if keys is None:
            if in_step:
                self._ready_not_taken()
            return
        self.fetch, self.pace = None, None   # it ended: nothing to stop
        self._replay(blob)
        p.ready = p.full_at = t + 1   # between rounds: the exchange at each begin_step decides instead
        p.keys, p.read = keys, True
        self.stats.caught_up_step, self.loaded = t, True
        log.info("caught up at step %d (%d steps replayed); contributing from step %d", t,
                 self.stats.replayed, p.ready)

    def _top_up(self, p: Pending, t: int) -> None:
        """Load the states the replay does not cover, written by a source at this step (Timeouts.quorum)."""
        g = self.group
        st, k = g.client.store, self._key(self.hid, f"top/{g.client.member_id}/{t}")
        deadline = time.monotonic() + g.timeouts.quorum
        while True:
            try:
                if st.check([k]):
                    break
                missing = "did not arrive (Timeouts.quorum)"
            except Exception as e:  # noqa: BLE001 - the coordinator is unreachable: a blip, or an outage
                missing = f"could not be read: the coordinator at {g.client.address} did not answer ({e})"
                if g.client.down.is_set():
                    deadline = 0.0
            if g.link.failures.aborted or time.monotonic() > deadline:
                g._record(CommTimeoutError(f"the top-up of heal {self.hid} {missing}"))
                return
            time.sleep(0.002)
        # Opening it may read its writer's key from the store too (not read before): both under the guard.
        ok, rec = self._stored("this joiner's top-up", lambda: g.client.book.open(st.get(k), kind="heal top-up"),
                               g.timeouts.heartbeat_timeout)
        if not ok:
            g._record(CommTimeoutError(f"the top-up of heal {self.hid} could not be read: the coordinator at "
                                       f"{g.client.address} did not answer"))
            return
        states = g.hooks.states
        got: Any = None
        if rec is not None:
            got = from_bytes(torch.frombuffer(bytearray(base64.b64decode(str(rec["b"]))), dtype=torch.uint8))
        why = "it does not verify" if not isinstance(got, dict) or set(got) != set(p.keys) else \
            check_received(got, {key: states[key].get() for key in p.keys})
        if why is not None:
            log.error("refusing the top-up of heal %d: %s; this worker leaves the run", self.hid, why)
            g._depart()
            raise ShoalError(f"refused the top-up of the background heal: {why}; nothing of it was loaded")
        for key in p.keys:
            (states[key].heal_load or states[key].load)(got[key])
        self.hid = -1
        if self.stats.contributes_at < self.stats.admitted_at:   # between rounds: set at its first round
            self.stats.contributes_at = time.time()
