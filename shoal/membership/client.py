"""The worker's side of membership: join, heartbeat thread, quorums, leave, and the abort watch.

The protocol (keys in the coordinator's store) is described in
:mod:`shoal.membership.coordinator`, which runs in the launcher process; this
module runs in every worker process and only talks to the store.

Example::

    client = MemberClient("127.0.0.1:29400", "run1", Timeouts(), token="s3cret-token")
    client.join()
    q = client.wait_quorum(after=0, timeout=client.timeouts.join)
    print(q.members, q.rank_of(client.member_id), q.prefix)
    client.leave()
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from dataclasses import asdict
from typing import Any

from shoal.errors import AuthError, ConfigError, ShoalError
from shoal.membership import auth
from shoal.membership.coordinator import _TICK_S, Quorum, Timeouts, _quorum_text, _s, connect, incarnation_of, log
from shoal.membership.liveness import STORE_KEY as LIVENESS_KEY, LivenessLink, read_port
from shoal.membership.liveness import enabled as liveness_enabled
from shoal.membership.records import RecordBook

# Heartbeats that must fail in a row (and over at least ``heartbeat_timeout``) before this worker takes the
# coordinator for gone: one slow connect or store call on a loaded host is no outage.
_OUTAGE_FAILS = 3
LATEST_EVERY_S = 0.5   # the heartbeat thread reads the newest quorum id at most this often (peek_latest)


class AbortWatch:
    """Which quorum's abort flag (``<prefix>abort``) a member watches, and whether it saw it raised.

    Keyed by the quorum's store prefix, so that a flag of an old quorum can
    never abort a step of a newer one: the heartbeat thread may read the old
    prefix, the training thread then move the watch to the new quorum, and
    the heartbeat thread only afterwards find the old flag set. That sighting
    is dropped (:meth:`saw` records it only for the prefix still watched),
    and :meth:`raised` answers for one quorum, never "any quorum".

    Example::

        watch = AbortWatch()
        watch.watch(q.prefix)          # the training thread, on entering quorum q
        watch.poll(store)              # the heartbeat thread, every beat
        if watch.raised(q.prefix): ...  # give up q's step at once
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prefix: str | None = None
        self._raised: str | None = None   # the prefix whose flag was seen raised (at most the watched one)

    @property
    def prefix(self) -> str | None:
        """The prefix of the quorum being watched (None before the first quorum)."""
        return self._prefix

    def watch(self, prefix: str | None) -> None:
        """Watch the quorum under ``prefix`` from now on; a sighting for any other quorum is forgotten."""
        with self._lock:
            self._prefix = prefix
            if self._raised != prefix:
                self._raised = None

    def saw(self, prefix: str) -> None:
        """Record that ``prefix``'s abort flag is raised; ignored unless ``prefix`` is still watched."""
        with self._lock:
            if prefix == self._prefix:
                self._raised = prefix

    def raised(self, prefix: str | None) -> bool:
        """Whether the abort flag of the quorum under ``prefix`` was seen raised."""
        return prefix is not None and self._raised == prefix

    def poll(self, store: Any) -> None:
        """One look at the watched quorum's flag through ``store`` (the heartbeat thread's own client)."""
        prefix = self._prefix
        if prefix is not None and store.check([prefix + "abort"]):
            self.saw(prefix)


class MemberClient:
    """A worker's side of the protocol: join, heartbeat thread, quorums, leave.

    Example::

        c = MemberClient("127.0.0.1:29400", "run1", Timeouts(), min_workers=2)
        c.join()
        q = c.wait_quorum(after=0, timeout=c.timeouts.join)
        c.leave()
    """

    def __init__(self, address: str, run_id: str, timeouts: Timeouts, min_workers: int = 1,
                 info: dict[str, Any] | None = None, token: str | None = None) -> None:
        if not run_id or "/" in run_id:
            raise ConfigError(f"run_id must be a non-empty string without '/', got {run_id!r}")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ConfigError(f"min_workers must be an integer >= 1, got {min_workers!r}")
        self.address = address
        self.run_id = run_id
        self.timeouts = timeouts
        self.min_workers = min_workers
        self.info = dict(info or {})
        self.token = auth.check_token(token)
        self.store = connect(address, timeouts.quorum)
        self.member_id = 0
        self.abort = AbortWatch()   # the heartbeat thread watches the current quorum's <prefix>abort
        # Once ``peek_latest`` is set (an averaging strategy's background heal), the heartbeat thread also reads
        # the newest quorum id, at most every LATEST_EVERY_S, into ``latest_seen``: the training thread then
        # learns of a newcomer between rounds without a store round trip of its own.
        self.peek_latest = threading.Event()
        self.latest_seen = -1
        self._latest_at = 0.0
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None
        self._stale: threading.Thread | None = None   # a heartbeat thread that outlived leave()'s wait for it
        self._link: LivenessLink | None = None   # closed by this process's death: the coordinator sees it at once
        # The training thread (join, leave) and the heartbeat's (reclaim, _outage, _resume). leave() sets the
        # heartbeat thread's stop event under it, and that thread changes this client (store, book, down,
        # _rejoin, ...) only under it after checking that event: each change is made before leave() or never.
        self._link_lock = threading.Lock()
        self.book = RecordBook(self.store, run_id, 0, self.token, log)
        self._infos: dict[int, dict[str, Any]] = {}   # verified join records, by member id
        # Coordinator outages (docs/elastic.md, "When the coordinator fails"): set while it is unreachable;
        # ``lost_prefix`` is the quorum this member was in when it was lost (its votes then go peer to peer
        # until the next quorum); ``_record``/``_last_q`` are what a re-announcement to a restarted one proves.
        self.down = threading.Event()
        self.lost_prefix: str | None = None
        # The quorum this member was in when a coordinator that came back did not take it back: dropped
        # (e.g. cut off by a partition), so no vote of that quorum may commit any more (see vote.Ballot).
        self.dropped_prefix: str | None = None
        self._lost_at = 0.0
        self._rejoin = False            # a restarted coordinator did not take this id back: join anew
        self.incarnation: str | None = None   # of the coordinator this member joined (or re-announced itself to)
        self._record: dict[str, Any] = {}
        self._last_q: dict[str, Any] | None = None

    def key(self, k: str) -> str:
        return f"{self.run_id}/{k}"

    def join(self) -> int:
        """Register (a new id every call) and start heartbeating; returns the id.

        ShoalError while the heartbeat thread of the membership this call ends is still re-announcing it to
        a coordinator it lost (see below); :meth:`wait_quorum` tries again at its next tick."""
        self.leave()
        stale = self._stale
        if stale is not None and stale.is_alive() and self.down.is_set():
            # Refused, not waited for: a re-announcement can block 2 x Timeouts.quorum, past the caller's own
            # deadline, and wait_quorum already retries at every tick until its own. That thread no longer
            # changes this client (it was stopped), but ``down`` is its verdict: a join now would start the
            # new membership with the coordinator taken for gone, on a store client that may be dead.
            raise ShoalError(
                f"cannot join anew yet: the heartbeat thread of this worker's previous membership is still "
                f"re-announcing member {self.member_id} to the coordinator at {self.address}, which it lost (a "
                f"re-announcement takes up to 2 x Timeouts.quorum = {2 * self.timeouts.quorum:.0f} s; it ends "
                "without changing this client): join again once it has ended")
        fresh = self.down.is_set()
        if fresh:
            # The coordinator was lost and the heartbeat thread that saw it go ended before it came back: this
            # client's store may be the dead coordinator's (a TCPStore client never reconnects), and no thread
            # of a membership is left to clear ``down``. Join on a fresh connection, registering the run (a
            # restarted coordinator does not know it); the new heartbeat thread watches from here.
            if not _reachable(self.address):   # else connect() would block Timeouts.quorum at every retry
                raise ShoalError(f"cannot join anew: the coordinator at {self.address} does not answer (this "
                                 "worker's heartbeat thread lost it and ended before it came back); restart it at "
                                 "the same address with the same token")
            self.store = connect(self.address, self.timeouts.quorum)
            self.book = RecordBook(self.store, self.run_id, 0, self.token, log)
        st = self.store
        if (self.member_id == 0 or self._rejoin or fresh) and st.add(f"runs/known/{self.run_id}", 1) == 1:
            st.set(f"runs/{st.add('runs/n', 1)}", self.run_id)
        self._last_q = None
        self.incarnation = incarnation_of(st)
        while True:
            self.member_id = st.add(self.key("next_id"), 1)
            if self._authenticate(self.member_id):
                break    # else: a restarted coordinator gave this id back to a member that held it: take another
        self._rejoin = False   # once a new id is held: a join anew that failed before is tried again (wait_quorum)
        self.down.clear()      # the store answered: the coordinator is there (set by an ended thread, see above)
        st.add(self.key(f"hb/{self.member_id}"), 1)
        record = {"timeouts": asdict(self.timeouts), "min_workers": self.min_workers, **self.info}
        self._record = record
        self.book.member_id = self.member_id    # signs with this join's session key
        st.set(self.key(f"join/{self.member_id}"), self.book.seal(record))
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, args=(self.member_id, self._stop),
                                    name="shoal-heartbeat", daemon=True)
        self._hb.start()
        self._relink(st, self.member_id, self.incarnation)
        return self.member_id

    def _relink(self, st: Any, member_id: int, incarnation: str | None) -> None:
        """Open this member's liveness link to the coordinator behind ``st`` (none if it publishes no port, or
        with ``SHOAL_LIVENESS=off``); a link already open to the same port for the same id is kept (the
        coordinator must not see this member end for nothing). A call for an id this member no longer
        holds (a heartbeat thread's late reclaim) changes nothing."""
        new: LivenessLink | None = None
        if liveness_enabled() and st.check([LIVENESS_KEY]):
            port = read_port(st.get(LIVENESS_KEY), self.token, incarnation)
            if port is None:
                log.warning("the coordinator at %s publishes a liveness port not signed with the run token for its "
                            "incarnation: no liveness link (a death of this worker is found by the heartbeat probe "
                            "only)", self.address)
            else:
                host = self.address.rpartition(":")[0]
                with self._link_lock:
                    old = self._link
                    if old is not None and old.address == (host.strip("[]"), port) and old.member_id == member_id \
                            and not old.refused:
                        return
                new = LivenessLink(host, port, self.run_id, member_id, self.token).start()
        with self._link_lock:
            if member_id != self.member_id or self._hb is None:   # a stale heartbeat thread's reclaim
                old, new = new, None
            else:
                old, self._link = self._link, new
        if old is not None:
            old.stop()

    def _authenticate(self, member_id: int) -> bool:
        """Answer the coordinator's challenge; AuthError if refused or if the two sides disagree on auth.

        False: the id is taken (a restarted coordinator gave it back to the member that held it before)."""
        st, base = self.store, self.key(f"auth/{member_id}/")
        required = st.check(["auth/required"])
        if self.token is None:
            if required:
                raise AuthError(f"the coordinator at {self.address} requires a run token and this worker "
                                "has none: pass the run's token (ElasticGroup(token=...) or $SHOAL_TOKEN; "
                                "CollaborativeConfig(token=...))")
            return True
        if not required:
            raise AuthError(f"this worker has a run token but the coordinator at {self.address} does not "
                            "authenticate workers: start it with the same token (Coordinator(token=...), "
                            "`shoal coordinator --token` or $SHOAL_TOKEN)")
        wait = datetime.timedelta(seconds=self.timeouts.quorum)
        deadline = time.monotonic() + self.timeouts.quorum
        while not st.check([base + "nonce"]) and not st.check([base + "verdict"]):
            if time.monotonic() > deadline:
                raise ShoalError(f"the coordinator at {self.address} did not send the join challenge within "
                                 f"{self.timeouts.quorum} s")
            time.sleep(_TICK_S / 2)
        if st.check([base + "verdict"]) and _s(st.get(base + "verdict")) == "taken":
            return False
        try:
            nonce = _s(st.get(base + "nonce"))
            st.set(base + "proof", auth.answer(self.token, f"{self.run_id}/{member_id}", nonce))
            st.wait([base + "verdict"], wait)
        except RuntimeError as e:   # the store's wait timed out
            raise ShoalError(f"the coordinator at {self.address} did not complete the join challenge "
                             f"within {self.timeouts.quorum} s: {e}") from e
        if _s(st.get(base + "verdict")) == "taken":
            return False
        if _s(st.get(base + "verdict")) != "ok":
            raise AuthError(f"the coordinator at {self.address} refused this worker: its proof of the run "
                            f"token for run {self.run_id!r} was wrong (a different token?)")
        return True

    def _beat(self, member_id: int, stop: threading.Event) -> None:
        # Its own store client: the training thread may be inside a store call. A failed beat drops the
        # connection (a late reply must not answer the next call) and the next one reconnects; only
        # _OUTAGE_FAILS failures in a row, heartbeat_timeout after the last beat that went through, are
        # taken for an outage (_outage).
        st: Any = None
        wait = max(self.timeouts.heartbeat_timeout / 2, self.timeouts.heartbeat_interval)
        last_ok, fails = time.monotonic(), 0
        while not stop.wait(self.timeouts.heartbeat_interval):
            try:
                if st is None:
                    st = connect(self.address, wait)
                    if self.incarnation is not None and incarnation_of(st) != self.incarnation:
                        # Restarted within a blip (back before an outage was declared): its store is empty, so
                        # beating on into it would leave this member unknown there. Re-announce, as after an
                        # outage (or, still starting, wait for it there).
                        st = None
                        if stop.is_set() or not self._outage(member_id, stop, ShoalError(
                                f"the coordinator at {self.address} was restarted")):
                            return
                        last_ok, fails = time.monotonic(), 0
                        continue
                st.add(self.key(f"hb/{member_id}"), 1)
                self.abort.poll(st)
                if self.peek_latest.is_set() and time.monotonic() - self._latest_at >= LATEST_EVERY_S:
                    self.latest_seen, self._latest_at = int(st.add(self.key("q/latest"), 0)), time.monotonic()
                last_ok, fails = time.monotonic(), 0
            except Exception as e:  # noqa: BLE001 - a blip, or the coordinator is gone (see _outage)
                st, fails = None, fails + 1
                if fails < _OUTAGE_FAILS or time.monotonic() - last_ok < self.timeouts.heartbeat_timeout:
                    log.debug("heartbeat %d to the coordinator at %s failed (%s): trying again", fails,
                              self.address, e)
                    continue
                if stop.is_set() or not self._outage(member_id, stop, e):
                    return
                last_ok, fails = time.monotonic(), 0

    def _outage(self, member_id: int, stop: threading.Event, err: BaseException) -> bool:
        """The coordinator is unreachable: say so once, wait for it, carry on or re-announce; False: stop beating.

        Back at the same incarnation (it was stalled or cut off, not restarted) the member carries on
        (:meth:`_resume`); a new incarnation (a restart: an empty store) learns the run back from
        the members (:mod:`shoal.membership.reclaim`). One that does not take this member back (its id
        taken, or no quorum to claim) gets it as a newcomer: the client's store is then the new one, and
        the next quorum wait joins anew there.

        Once ``stop`` is set (:meth:`leave`, which may give up waiting for this thread long before a
        re-announcement returns) it changes nothing of the client any more: the member left, and may have
        joined anew under another id, whose store, record and ``down`` are not this thread's."""
        from shoal.membership.reclaim import LEFT, reclaim   # the re-announcement protocol (its own module)

        with self._link_lock:
            if stop.is_set():
                return False
            self.lost_prefix, self._lost_at = self.abort.prefix, time.monotonic()
            # A restarted coordinator numbers its quorums anew from what the members claim: an id read from the
            # old one may never be published by it (offer_early would wait on that record), so read it afresh.
            self.latest_seen, self._latest_at = -1, 0.0
            self.down.set()
        log.warning("lost the coordinator at %s (%s): training goes on with the current quorum; a membership "
                    "change (a lost peer, a joiner) waits for it to come back (restart it at the same address "
                    "with the same token)", self.address, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
        while not stop.wait(self.timeouts.heartbeat_interval):
            if not _reachable(self.address):
                continue
            try:
                st = connect(self.address, self.timeouts.heartbeat_timeout)
                now = incarnation_of(st)
                if now is None and self.incarnation is not None:
                    continue       # a coordinator still starting: it writes its incarnation first
                if now is not None and now == self.incarnation:
                    return self._resume(st, member_id, stop)
                verdict = reclaim(self, member_id, stop)
                if verdict == LEFT:
                    return False                     # the member left meanwhile: reclaim changed nothing
                if verdict != "ok":
                    # Joining anew, at the new coordinator: the training thread's store client went with the
                    # old one (a TCPStore client never reconnects; every call on it would fail until
                    # Timeouts.quorum, and the member stop, saying the coordinator is unreachable).
                    st = connect(self.address, self.timeouts.quorum)
            except Exception as e:  # noqa: BLE001 - it went away again, or is still starting: try again
                log.debug("re-announcing to the coordinator failed: %s", e)
                continue
            if verdict == "ok":
                with self._link_lock:
                    if stop.is_set():
                        # Left after reclaim swapped the store in (before leave(), so join() found it): ``down``
                        # is then for join() to clear, never for this thread (it may be the new membership's).
                        return False
                    self.incarnation = now
                    self.down.clear()
                self._relink(st, member_id, now)      # the new coordinator listens on its own port
                log.warning("the coordinator at %s is back after %.1f s: member %d re-announced itself",
                            self.address, time.monotonic() - self._lost_at, member_id)
                return True
            with self._link_lock:
                if stop.is_set():
                    return False    # left meanwhile: the connection opened above closes with its last reference
                self.dropped_prefix = self.lost_prefix
                self._rejoin = True                  # first: leave() must not end the refused id (see there)
                self.book, self.store = RecordBook(st, self.run_id, 0, self.token, log), st
                # Only now: until then the training thread must not read the new store under the refused id (a
                # newcomer may hold it there, and a quorum of that newcomer's would pass for this member's).
                self.down.clear()
            log.warning("the coordinator at %s is back but did not take member %d back (%s): joining anew "
                        "(this worker is healed like a newcomer)", self.address, member_id, verdict)
            return False
        return False

    def _resume(self, st: Any, member_id: int, stop: threading.Event) -> bool:
        """The same coordinator answers again: its verdict on this member stands; keep beating (True).

        Not dropped: the member carries on under its id, seat and quorum. Its votes of the quorum it
        was in may have gone peer to peer meanwhile while its peers' go through the store: that quorum's
        abort flag ends it (every member discards the step in flight and moves to a new quorum, whose votes
        all go through the store). Dropped (silent past ``heartbeat_timeout`` while the coordinator ran):
        no vote of that quorum may commit any more, and the member joins anew (at its next quorum wait).

        False, changing nothing, once ``stop`` is set: the member left meanwhile (see :meth:`_outage`)."""
        if stop.is_set():
            return False    # and no beat: it would undo the -1 that leave() wrote for this id
        away = time.monotonic() - self._lost_at
        # A beat first: the quorum ended below is replaced after a probe of the members' heartbeats, and
        # this member must not look silent to it while its heartbeat thread reconnects.
        st.add(self.key(f"hb/{member_id}"), 1)
        dropped = st.check([self.key(f"dropped/{member_id}")])
        lost = self.lost_prefix
        if not dropped and lost is not None:
            st.set(lost + "abort", "the coordinator was unreachable")
        with self._link_lock:
            if stop.is_set():
                return False
            if dropped:
                self.dropped_prefix, self._rejoin = lost, True
            else:
                self.lost_prefix = None
            self.down.clear()
        if dropped:
            log.warning("the coordinator at %s answers again after %.1f s (not restarted) but dropped member %d "
                        "meanwhile: joining anew (this worker is healed like a newcomer)", self.address, away, member_id)
        else:
            log.warning("the coordinator at %s answers again after %.1f s (not restarted: it was stalled or cut "
                        "off): member %d carries on", self.address, away, member_id)
        return True

    def leave(self) -> None:
        """Stop heartbeating and tell the coordinator at once (idempotent)."""
        if self._hb is None:
            return
        with self._link_lock:   # see _link_lock: the heartbeat thread changes this client before this or never
            self._stop.set()
        self._hb.join(timeout=2 * self.timeouts.heartbeat_interval + 1)
        # Still running: blocked in a re-announcement (up to 2 x Timeouts.quorum); join() refuses meanwhile.
        self._stale = self._hb if self._hb.is_alive() else None
        self._hb = None
        try:
            if not self._rejoin:   # an id the coordinator did not take back is not this member's to end: at a
                self.store.set(self.key(f"hb/{self.member_id}"), "-1")   # restarted one a newcomer may hold it
        except Exception:  # noqa: BLE001 - coordinator gone: it will not miss us
            pass
        with self._link_lock:
            link, self._link = self._link, None
        if link is not None:
            link.stop()

    def latest(self) -> int:
        return int(self.store.add(self.key("q/latest"), 0))

    def latest_or(self, default: int) -> int:
        """:meth:`latest`, or ``default`` while the coordinator is unreachable."""
        try:
            return self.latest()
        except Exception:  # noqa: BLE001 - the coordinator is down: no newer quorum can exist
            return default

    def quorum(self, qid: int) -> Quorum:
        rec = json.loads(_s(self.store.get(self.key(f"q/{qid}"))))
        members, prefix = tuple(int(m) for m in rec["members"]), str(rec["prefix"])
        if self.token is not None and not auth.verify(self.token, "record", _quorum_text(qid, members, prefix),
                                                      str(rec.get("mac", ""))):
            raise AuthError(f"quorum record {qid} of run {self.run_id!r} is not signed with the run token: "
                            "someone other than the coordinator wrote it")
        if self.member_id in members:
            self._last_q = {"qid": qid, "members": list(members), "prefix": prefix, "mac": rec.get("mac", "")}
        return Quorum(qid, members, prefix)

    def join_infos(self, members: tuple[int, ...] | list[int]) -> list[dict[str, Any] | None]:
        """The join records of ``members`` (one store read for those not seen yet); None where one
        does not verify (see the module docstring). Cached: a member writes its record once, before
        the coordinator admits it, so a later overwrite cannot change what this worker uses."""
        todo = [m for m in members if m not in self._infos]
        if todo:
            for m, raw in zip(todo, self.store.multi_get([self.key(f"join/{m}") for m in todo])):
                info = self.book.open(raw, writer=m, kind="join")
                if info is not None:
                    self._infos[m] = info
        return [self._infos.get(m) for m in members]

    def request_quorum(self, failed_qid: int) -> None:
        """Ask for a quorum to replace ``failed_qid``; the coordinator probes liveness first.

        While the coordinator is down the request is dropped: a restarted one publishes a new quorum of
        the members that re-announce themselves anyway."""
        try:
            self.store.set(self.key(f"req/{failed_qid}"), str(self.member_id))
        except Exception:  # noqa: BLE001 - the coordinator is down (see above)
            pass

    def wait_quorum(self, after: int, timeout: float) -> Quorum:
        """The first quorum newer than ``after`` that includes this member.

        A newer quorum without this member, or its ``dropped/<id>`` mark,
        means the coordinator dropped it (e.g. it missed a probe while busy):
        it joins again under a new id and goes on waiting, and will be healed
        as a newcomer.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._rejoin:
                    self.join()
                if not self.down.is_set():
                    latest = self.latest()
                    if latest > after:
                        q = self.quorum(latest)
                        if self.member_id in q.members:
                            return q
                        after = latest
                        self.join()
                    elif self.store.check([self.key(f"dropped/{self.member_id}")]):
                        self.join()
                failing = False
            except (AuthError, ConfigError):
                raise
            except Exception:  # noqa: BLE001 - a store call failed: the coordinator is down (the
                failing = True  # heartbeat thread waits for it and re-announces this member)
            if time.monotonic() > deadline and (failing or self.down.is_set()):
                raise ShoalError(
                    f"the coordinator at {self.address} is unreachable and this worker (member {self.member_id} "
                    f"of run {self.run_id!r}) needs a new quorum, which only it can form (a peer was lost or "
                    f"a worker joins): waited {timeout:.0f} s. Restart the coordinator at the same address with "
                    "the same token (`shoal coordinator --port P`): the workers re-announce themselves to it")
            if time.monotonic() > deadline:
                raise ShoalError(
                    f"no quorum including this worker (member {self.member_id} of run {self.run_id!r}) "
                    f"within {timeout} s: fewer than min_workers={self.min_workers} workers alive, or the "
                    "coordinator is unreachable; start more workers or lower min_workers"
                )
            time.sleep(_TICK_S / 2)


def _reachable(address: str) -> bool:
    """Whether something listens at ``address`` (a plain connect: no log noise while it is down)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False
