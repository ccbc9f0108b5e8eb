"""Membership of elastic runs: a coordinator, heartbeats, and one quorum per round.

Everything travels through a ``torch.distributed`` TCPStore. A TCPStore is
passive (it stores keys, it runs no logic), so someone has to decide who is
alive. shoal runs that logic in one place, a :class:`Coordinator` thread that
owns the store server (embedded in ``shoal run --elastic``, or standalone with
``shoal coordinator --port P``). Why not let workers agree deterministically
through the store instead? Deciding that a member is *dead* needs one clock
watching its heartbeats; with every worker judging by its own clock, two
survivors can disagree on who is gone, and a partitioned worker could declare
the others dead. A single coordinator makes the verdict one write, and the
workers only read it. The coordinator is cheap (one thread, a store poll every
``_TICK_S``) and carries no training data. If it dies, the quorum trains on
(votes go peer to peer) until a membership change needs it; restarted at the
same address it learns the run back from the members
(:mod:`shoal.membership.recovery`; docs/elastic.md, "When the coordinator fails").

Protocol (keys under ``<run_id>/``; ``runs/n`` and ``runs/<k>`` list the runs):

- ``join``: ``id = add("next_id", 1)``, then ``set("join/<id>", json)`` with
  the worker's timeouts and ``min_workers``. A restarted worker joins again and
  gets a new id, so a stale incarnation can never be mistaken for it.
- heartbeat: a background thread does ``add("hb/<id>", 1)`` every
  ``heartbeat_interval``; ``leave`` sets it to ``-1``.
- quorum: the coordinator writes ``q/<qid>`` (members, prefix), then bumps
  ``q/latest`` to ``qid``. Members are ordered by id, so survivors keep their
  relative order and newcomers come last. Every quorum has a fresh store
  prefix, hence a fresh gloo group; a failed group is never reused.
- re-quorum: after a failed step a member sets ``req/<qid>``. The
  coordinator then probes: members whose heartbeat advances within
  ``probe`` seconds form the next quorum (a SIGKILLed worker cannot).
- a member silent for ``heartbeat_timeout`` is dropped without any request,
  and ``<prefix>abort`` of the current quorum is set, so that members blocked
  in one of its collectives give up at once.
- every dropped member is marked ``dropped/<id>``: one that was only slow
  sees it while it waits for a quorum and joins again under a new id.
- ``coordinator/incarnation``: a random id the coordinator writes at its
  start. A worker that could not reach the store for a while and then reaches
  the same incarnation knows that the coordinator was only stalled or cut off
  (its verdicts, e.g. ``dropped/<id>``, stand); only a new incarnation is a
  restart, whose empty store must learn the run back (``claims/...``).
- authentication (a coordinator started with a ``token``; it sets
  ``auth/required``): after taking its id the joiner waits for
  ``auth/<id>/nonce``, answers ``auth/<id>/proof = HMAC(token, run/id, nonce)``
  and reads ``auth/<id>/verdict``. The coordinator admits only ids whose
  proof it verified, and signs each quorum record (``mac``) so members can
  reject records it did not write. A member then signs its ``join/<id>``
  record with its session key (:mod:`shoal.membership.records`): the coordinator
  (timeouts, ``min_workers``) and the members (host identities, launch slots)
  use a join record only if it verifies, so a stranger who reaches the store
  cannot change them. The token never travels. Elastic groups always
  authenticate (:class:`shoal.membership.elastic.ElasticGroup` requires a token);
  collaborative runs may go without one.

Example::

    coord = Coordinator(port=0).start()        # in the launcher
    client = MemberClient(f"127.0.0.1:{coord.port}", "run1", Timeouts())  # shoal.membership.client
    client.join()
    q = client.wait_quorum(after=0, timeout=60)
    print(q.members, q.rank_of(client.member_id), q.prefix)
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from shoal.membership import auth
from shoal.membership.liveness import STORE_KEY as LIVENESS_KEY, LivenessServer, port_record
from shoal.membership.records import RecordBook
from shoal.membership.recovery import Recovery, quorum_text
from shoal.errors import AuthError, ConfigError, ShoalError

_TICK_S = 0.02  # coordinator poll period: membership changes are seen within it
# A gap between two ticks longer than this is the coordinator's own stall (a loaded host, a GC pause, SIGSTOP):
# the silence it judges heartbeats by does not count it (see Coordinator.tick). Shorter gaps (a busy host's
# scheduling jitter) count as usual, so that a dead member is still dropped in time on a loaded host.
_STALL_S = 0.5
INCARNATION_KEY = "coordinator/incarnation"   # random per coordinator start (see the protocol above)
log = logging.getLogger("shoal.elastic")


@dataclass(frozen=True)
class Timeouts:
    """Every timeout of an elastic run, in seconds, in one validated hierarchy.

    ``heartbeat_interval < probe <= heartbeat_timeout < quorum`` and
    ``op < quorum < join``: a collective gives up before a quorum round does,
    which gives up before a newcomer stops waiting to be admitted, so an
    inner wait can never outlast the one that contains it.

    Attributes:
        op: one collective (all-reduce of a bucket, a broadcast). Past it the
            step fails with CommTimeoutError and is discarded on every member.
            Raise it when the network is slow: a 100 MB bucket at 20 Mbit/s
            needs ~80 s.
        heartbeat_interval: how often each worker tells the coordinator it lives.
        probe: after a failed step, members whose heartbeat does not advance
            within this window are left out of the next quorum.
        heartbeat_timeout: a member silent this long is dropped even if no
            step failed (a worker hung outside collectives).
        quorum: longest wait for a step's commit vote, a new quorum, or the
            new group's connections.
        join: longest a newcomer waits to be admitted and healed.
        max_consecutive_discards: a count, not seconds: after this many
            steps in a row are discarded (a failure that repeats at every
            step: a deterministic error, a NaN reported every step), every
            member raises PeerLostError with the reasons instead of
            retrying forever. Any commit resets the count.

    Example::

        Timeouts(op=60, quorum=120, join=600)   # a slow WAN
        Timeouts(op=40, quorum=30)              # ConfigError naming op and quorum
        Timeouts(max_consecutive_discards=5)    # give up sooner on a failure that repeats
    """

    op: float = 20.0            # loopback/LAN collectives finish in well under a second
    heartbeat_interval: float = 0.1  # 10 tiny store writes per second per worker
    probe: float = 0.5          # 5 heartbeats: a live but busy worker still answers
    heartbeat_timeout: float = 5.0   # generous: a GC pause must not evict a worker
    quorum: float = 60.0        # > op: a vote waits at most for one slow collective
    join: float = 300.0         # > quorum: a newcomer may arrive mid-round and heal
    max_consecutive_discards: int = 20  # a lost peer costs one discard; 20 in a row is no bad luck

    def __post_init__(self) -> None:
        n = self.max_consecutive_discards
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"Timeouts.max_consecutive_discards must be an integer >= 1 (steps discarded in a "
                              f"row before every member gives up), got {n!r}")
        for name in ("op", "heartbeat_interval", "probe", "heartbeat_timeout", "quorum", "join"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"Timeouts.{name} must be a number of seconds > 0, got {v!r}")
        chain = [("heartbeat_interval", "probe", False), ("probe", "heartbeat_timeout", True),
                 ("heartbeat_timeout", "quorum", False), ("op", "quorum", False), ("quorum", "join", False)]
        for a, b, equal_ok in chain:
            va, vb = getattr(self, a), getattr(self, b)
            if va > vb or (va == vb and not equal_ok):
                rel = "<=" if equal_ok else "<"
                raise ConfigError(
                    f"Timeouts.{a} ({va} s) must be {rel} Timeouts.{b} ({vb} s): the hierarchy is "
                    "heartbeat_interval < probe <= heartbeat_timeout < quorum and op < quorum < join, "
                    "so that no inner wait outlasts the one containing it"
                )


@dataclass(frozen=True)
class Quorum:
    """The members of one round, as published by the coordinator.

    Attributes:
        qid: round id, increasing; each round has its own store prefix and gloo group.
        members: member ids, ordered; a member's group rank is its index.
        prefix: the store prefix under which this round's group rendezvous.
        max_step: highest committed step among the members (set by the
            members once they have exchanged their steps; -1 before).
    """

    qid: int
    members: tuple[int, ...]
    prefix: str
    max_step: int = -1

    def rank_of(self, member_id: int) -> int:
        return self.members.index(member_id)


class Trace:
    """Timestamped events of one worker's elastic life, for finding where recovery time goes.

    Off unless ``$SHOAL_ELASTIC_TRACE`` names a folder: then each process appends
    ``{"ev": ..., "t": time.time(), ...}`` lines to ``<folder>/<pid>.jsonl``
    (``python -m shoal.bench.chaos --trace`` reads them; the
    coordinator writes its own).
    """

    def __init__(self) -> None:
        folder = os.environ.get("SHOAL_ELASTIC_TRACE")
        self._f = open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a", buffering=1) if folder else None

    def __call__(self, ev: str, **info: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"ev": ev, "t": time.time(), **info}) + "\n")


def connect(address: str, timeout: float, is_master: bool = False) -> dist.TCPStore:
    """A TCPStore client (or server, ``is_master``) for ``"host:port"``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"coordinator address must be HOST:PORT, got {address!r}")
    try:
        return dist.TCPStore(host, int(port), is_master=is_master, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:  # torch raises DistNetworkError/RuntimeError with the socket's reason
        raise ShoalError(f"cannot reach the coordinator at {address} within {timeout} s: {e}") from e


def incarnation_of(store: Any) -> str | None:
    """The incarnation id of the coordinator behind ``store`` (None if it has not written one yet)."""
    if not store.check([INCARNATION_KEY]):
        return None
    return _s(store.get(INCARNATION_KEY))


def _s(v: bytes) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class _Member:
    beats: int = 0
    seen: float = 0.0           # coordinator's clock when its heartbeat last advanced
    info: dict[str, Any] = field(default_factory=dict)


class _Run:
    """The coordinator's view of one run: members, heartbeats, quorums."""

    def __init__(self, run_id: str, book: RecordBook) -> None:
        self.run_id = run_id
        self.book = book                        # opens (verifies) the members' join records
        self.next_seen = 0                      # highest member id registered so far
        self.members: dict[int, _Member] = {}
        self.pending_join: set[int] = set()     # ids whose join record is not yet written
        self.qid = 0
        self.current: tuple[int, ...] = ()
        self.probe_since: float | None = None
        self.probe_base: dict[int, int] = {}
        self.probe_by_link = False              # the probe was started by a link's end, not by a request
        self.link_probed: dict[int, int] = {}   # member -> the end of its link that already started a probe
        self.probe_suspects: set[int] = set()   # members the current probe judges by their link's end
        self.last_join = 0.0
        self.nonces: dict[int, str] = {}        # challenges sent, by member id
        self.authed: set[int] = set()           # ids whose proof was verified
        self.recovery = Recovery()              # members re-announcing themselves after a restart

    def key(self, k: str) -> str:
        return f"{self.run_id}/{k}"

    def timeouts(self) -> Timeouts:
        for m in self.members.values():
            if "timeouts" in m.info:
                return Timeouts(**m.info["timeouts"])
        return Timeouts()

    def min_workers(self) -> int:
        return max([int(m.info.get("min_workers", 1)) for m in self.members.values()] or [1])


class Coordinator:
    """Owns the TCPStore server and computes quorums for every run that joins it.

    Args:
        port: TCP port to listen on (0: any free one; read ``.port``).
        host: address to bind and advertise.
        join_grace: after a newcomer registers, wait this long for more before
            publishing a quorum, so that workers starting together land in one round.
        initial_workers: a run's first quorum waits for this many workers (the
            launcher passes the number it starts); later quorums need only
            the workers' ``min_workers``.
        token: the run token; when given, only workers that prove they hold
            it (an HMAC challenge, see the module docstring) are admitted, and
            quorum records are signed with it.
        claim_grace: seconds after its start before it publishes a run's first
            quorum, so that the members of a run that outlived a previous
            coordinator at this address re-announce themselves first
            (:mod:`shoal.membership.recovery`). ``shoal coordinator`` uses 1 s;
            an embedded coordinator, which dies with its launcher, needs none.
        liveness_port: TCP port of the members' liveness links (0: any free one, published in the
            store; read ``.liveness_port``). A member whose link ends (its process died) is left out
            of the next quorum without waiting out the probe window (:mod:`shoal.membership.liveness`).

    Timeouts and ``min_workers`` come from the workers' join records, so the
    coordinator needs no configuration of its own.

    Example::

        coord = Coordinator(port=29400).start()
        ...                                   # workers join with address "host:29400"
        coord.stop()
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", join_grace: float = 0.25,
                 initial_workers: int = 1, token: str | None = None, claim_grace: float = 0.0,
                 liveness_port: int = 0) -> None:
        self.token = auth.check_token(token)
        for name, value in (("port", port), ("liveness_port", liveness_port)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
                raise ConfigError(f"{name} must be in [0, 65535], got {value!r}")
        if isinstance(initial_workers, bool) or not isinstance(initial_workers, int) or initial_workers < 1:
            raise ConfigError(f"initial_workers must be an integer >= 1, got {initial_workers!r}")
        self.initial_workers = initial_workers
        if join_grace < 0:
            raise ConfigError(f"join_grace must be >= 0 seconds, got {join_grace}")
        if claim_grace < 0:
            raise ConfigError(f"claim_grace must be >= 0 seconds, got {claim_grace}")
        self.host = host
        self.join_grace = join_grace
        self._server = connect(f"{host}:{port}", timeout=30.0, is_master=True)
        self.port = int(self._server.port)
        self._store = connect(f"{host}:{self.port}", timeout=30.0)
        # First of all: a worker that reaches this store must be able to tell it from a previous coordinator's.
        self.incarnation = secrets.token_hex(8)
        self._store.set(INCARNATION_KEY, self.incarnation)
        if self.token is not None:
            self._store.set("auth/required", "1")
        self.trace = Trace()
        self._runs: dict[str, _Run] = {}
        self._runs_seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._born, self.claim_grace = time.monotonic(), claim_grace   # a first wait for survivors
        self._last_tick: float | None = None
        try:
            self._live = LivenessServer(host, self.token, port=liveness_port).start()
        except OSError as e:
            raise ShoalError(f"cannot listen for the workers' liveness links on {host}:{liveness_port}: {e} "
                             "(pass another liveness_port, or 0 for any free one)") from e
        self.liveness_port = self._live.port
        self._store.set(LIVENESS_KEY, port_record(self.liveness_port, self.token, self.incarnation))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "Coordinator":
        self._thread = threading.Thread(target=self._loop, name="shoal-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._live.stop()

    def serve_forever(self) -> None:
        """Run in the calling thread until interrupted (the standalone CLI)."""
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.tick(time.monotonic())
                self._stop.wait(_TICK_S)
        except BaseException as e:  # noqa: BLE001 - kept for the owner to report
            self.error = e
            raise

    def tick(self, now: float) -> None:
        """One pass: discover runs and members, read heartbeats, publish quorums.

        A member is judged silent over the time this coordinator was running: after a stall of its own
        (its thread not scheduled on a loaded host, a GC pause, SIGSTOP) the members' heartbeats could
        not be read, or not be written (a stalled store), and dropping them all at the first tick after
        it would evict a healthy run. So the stall is added to every member's last sighting."""
        gap = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        if gap > _STALL_S:
            self._forgive(gap - _TICK_S)
        n = self._store.add("runs/n", 0)
        while self._runs_seen < n:
            self._runs_seen += 1
            name = _s(self._store.get(f"runs/{self._runs_seen}"))
            if name not in self._runs:
                self._runs[name] = _Run(name, RecordBook(self._store, name, 0, self.token, log))
        for run in self._runs.values():
            self._tick_run(run, now)

    def _forgive(self, stalled: float) -> None:
        """Shift every member's last sighting (and an open probe window) by this coordinator's own stall."""
        for run in self._runs.values():
            for m in run.members.values():
                m.seen += stalled
            if run.probe_since is not None:
                run.probe_since += stalled

    def _tick_run(self, run: _Run, now: float) -> None:
        st = self._store
        top = st.add(run.key("next_id"), 0)
        for i in range(run.next_seen + 1, top + 1):
            run.pending_join.add(i)
        run.next_seen = top
        run.recovery.tick(st, run, self.token, now, lambda i, info: self._admit(run, i, info, now))
        for i in sorted(run.pending_join):
            if i in run.recovery.claiming:
                # A live member re-announces this id (a restarted coordinator): a joiner that took it
                # meanwhile is told so and takes another one.
                st.set(run.key(f"auth/{i}/verdict"), "taken")
                run.pending_join.discard(i)
                run.nonces.pop(i, None)
                continue
            if self.token is not None and i not in run.authed and not self._challenge(run, i):
                continue
            if st.check([run.key(f"join/{i}")]):
                # A record that does not verify (written by someone without the token, or not JSON)
                # is ignored: the member stays pending until its own, signed record is there.
                info = run.book.open(st.get(run.key(f"join/{i}")), writer=i, kind="join")
                if info is None:
                    continue
                run.pending_join.discard(i)
                run.members[i] = _Member(seen=now, info=info)
                run.last_join = now
        if not run.members:
            return
        t = run.timeouts()
        ids = sorted(run.members)
        beats = st.multi_get([run.key(f"hb/{i}") for i in ids]) if ids else []
        gone: list[int] = []
        for i, raw in zip(ids, beats):
            b = int(_s(raw) or 0)
            m = run.members[i]
            if b >= 0 and b != m.beats:   # advanced since the last look: alive, however long that look took
                m.beats, m.seen = b, now
            if b < 0 or now - m.seen > t.heartbeat_timeout:
                gone.append(i)
        for i in gone:
            self._drop(run, i)
        if gone and set(gone) & set(run.current):
            self._abort_current(run)
        # A member whose liveness link ended is likely gone (its process died): a probe starts now, once per
        # end, in which it counts as silent once its heartbeat missed two beats (_end_link_probe). Only
        # members of the published quorum: a joiner not yet published is judged as before (the probe would
        # publish it at once, without join_grace, and a collaborative swarm's list would change early).
        ended = self._live.ended(run.run_id)
        fresh = sorted(i for i in run.current if i in ended and i in run.members and run.link_probed.get(i) != ended[i])
        if fresh:
            self.trace("link-probe", run=run.run_id, qid=run.qid, members=fresh)
            run.link_probed.update({i: ended[i] for i in fresh})
            if run.probe_since is None:
                self._start_probe(run, now, by_link=True)
            else:   # joins the probe under way: it must beat after its link's end to count as alive
                run.probe_base.update({i: run.members[i].beats for i in fresh})
            run.probe_suspects.update(fresh)
        self._maybe_publish(run, now, t, bool(gone))

    def _start_probe(self, run: _Run, now: float, by_link: bool) -> None:
        """Members whose heartbeat advances from now on are alive (``_maybe_publish`` judges them)."""
        run.probe_since, run.probe_by_link = now, by_link
        run.probe_base = {i: m.beats for i, m in run.members.items()}

    def _abort_current(self, run: _Run) -> None:
        """Members blocked in a collective of the current quorum give up at once (a member of it is gone)."""
        self._store.set(f"{run.key(f'q{run.qid}')}/abort", "member lost")

    def _admit(self, run: _Run, i: int, info: dict[str, Any], now: float) -> None:
        run.members[i] = _Member(seen=now, info=info)
        run.last_join = now

    def _challenge(self, run: _Run, i: int) -> bool:
        """Advance member ``i``'s HMAC challenge; True once its proof is verified."""
        if self.token is None:
            return True
        st, base = self._store, run.key(f"auth/{i}/")
        nonce = run.nonces.get(i)
        if nonce is None:
            run.nonces[i] = auth.new_nonce()
            st.set(base + "nonce", run.nonces[i])
            return False
        if not st.check([base + "proof"]):
            return False
        ok = auth.verify(self.token, f"{run.run_id}/{i}", nonce, _s(st.get(base + "proof")))
        st.set(base + "verdict", "ok" if ok else "denied")
        if ok:
            run.authed.add(i)
        else:
            run.pending_join.discard(i)   # never admitted, never asked again
        return ok

    def _maybe_publish(self, run: _Run, now: float, t: Timeouts, lost: bool) -> None:
        st = self._store
        if run.recovery.holding(run, now, t.heartbeat_timeout, self._born + self.claim_grace):
            return
        # Requests name the quorum they abandon: those about an older one were served already. A request
        # during a probe a link's end started makes it a request's probe (it publishes whatever it finds).
        if (run.probe_since is None or run.probe_by_link) and run.current and st.check([run.key(f"req/{run.qid}")]):
            self.trace("request", run=run.run_id, qid=run.qid)
            if run.probe_since is None:
                self._start_probe(run, now, by_link=False)
            run.probe_by_link = False
        alive = tuple(sorted(run.members))
        since = run.probe_since
        if since is not None:
            answered = tuple(i for i in alive if run.members[i].beats > run.probe_base.get(i, -1))
            # Silent for a whole probe window already (e.g. a member that died before voting, judged
            # so by the voters): no need to wait another window for it.
            # A member whose liveness link ended counts once its heartbeat missed two beats: at once for a
            # dead process, while a live one whose link only broke still answers (and its link reopens).
            silent = [i for i in alive if i not in answered and (now - run.members[i].seen >= t.probe or (
                i in run.probe_suspects and now - run.members[i].seen >= 2 * t.heartbeat_interval + _TICK_S))]
            if run.probe_by_link:
                self._end_link_probe(run, now - since < t.probe, alive, answered, silent)
                return
            if len(answered) + len(silent) < len(alive) and now - since < t.probe:
                return
            run.probe_since = None
            run.probe_suspects.clear()
            lost_now = [i for i in alive if i not in answered]
            # Members that missed the probe are dropped now, not at heartbeat_timeout: kept, they
            # would be published again at the next tick (alive != current), and the survivors would
            # wait for them at the new group's barrier until heartbeat_timeout. One that was only
            # slow finds itself outside the next quorum and joins again under a new id.
            for i in lost_now:
                self._drop(run, i)
            self._publish(run, answered)
            return
        changed = alive != run.current
        if not changed or (not lost and now - run.last_join < self.join_grace):
            return
        self._publish(run, alive)

    def _end_link_probe(self, run: _Run, in_window: bool, alive: tuple[int, ...],
                        answered: tuple[int, ...], silent: list[int]) -> None:
        """A probe a link's end started judges only the members whose link ended: the silent ones are dropped,
        the quorum's abort flag raised (no step may have failed yet) and the others' quorum published; a
        member that answered lives (only its link broke) and nothing changes. Others that are slow to beat
        are not judged here (heartbeat_timeout, or a request's probe, does that). ``in_window``: the probe
        window has not run out yet."""
        suspects = [i for i in alive if i in run.probe_suspects]
        if any(i not in answered and i not in silent for i in suspects) and in_window:
            return
        run.probe_since, run.probe_by_link = None, False
        run.probe_suspects.clear()
        lost_now = [i for i in suspects if i not in answered]
        if not lost_now:
            return
        if set(lost_now) & set(run.current):
            self._abort_current(run)
        for i in lost_now:
            self._drop(run, i)
        keep = tuple(i for i in alive if i not in lost_now)
        if keep != run.current:
            self._publish(run, keep)

    def _drop(self, run: _Run, i: int) -> None:
        """Forget member ``i`` and tell it (``dropped/<id>``): a live one that was only slow joins again.

        Without the mark a member dropped while too few others remain for a quorum would never
        learn it (no newer quorum is published to leave it out of) and the run would stall.
        """
        del run.members[i]
        run.link_probed.pop(i, None)
        self._live.forget(run.run_id, i)
        self._store.set(run.key(f"dropped/{i}"), "1")

    def _publish(self, run: _Run, members: tuple[int, ...]) -> None:
        need = run.min_workers() if run.qid else max(run.min_workers(), self.initial_workers)
        if len(members) < need:
            run.current = ()   # nothing published: members wait for newcomers (or time out)
            return
        run.qid += 1
        run.current = members
        record: dict[str, Any] = {"members": list(members), "prefix": f"{run.key(f'q{run.qid}')}/"}
        if self.token is not None:
            record["mac"] = auth.sign(self.token, _quorum_text(run.qid, members, record["prefix"]))
        self._store.set(run.key(f"q/{run.qid}"), json.dumps(record))
        # Only the coordinator writes it: it equals qid (a restarted coordinator starts above 0).
        self._store.add(run.key("q/latest"), run.qid - int(self._store.add(run.key("q/latest"), 0)))
        self.trace("publish", run=run.run_id, qid=run.qid, members=list(members))


_quorum_text = quorum_text
