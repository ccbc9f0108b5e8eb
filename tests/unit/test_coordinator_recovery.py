"""A restarted coordinator (an empty store) and members that re-announce themselves late, or are refused.

The CI failure (tests/faults/test_coordinator_restart.py, a loaded host): member 2 re-announced itself, the
joiner the test starts at that moment took id 3 (``next_id`` only covered the ids claimed so far), and the
live member 3, whose re-announcement came later, was told ``taken``. It was to join anew, but its training
thread still talked to the dead coordinator's store (a TCPStore client never reconnects), so it waited
``Timeouts.quorum`` and died saying the coordinator was unreachable; the others, one short of the size the
test waits for, trained on until their step limit (the "hang").

Here the coordinator is real and in-process. Its restart is a stop, its store server dropped, and a new
``Coordinator`` on the same port. The late member is held back where its heartbeat thread waits for the
address to answer (``client._reachable``). The claims in the first test are written by hand against a
coordinator ticked with a fake clock, as in ``test_a_restarted_coordinator_admits_only_claims_that_verify``.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
import uuid
from typing import Any, Callable

import pytest

import shoal.membership.client as client_mod
from shoal.errors import ShoalError
from shoal.membership import auth
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Coordinator, Timeouts, connect
from shoal.membership.records import RecordBook
from shoal.membership.recovery import quorum_text

TOKEN = "coordinator-recovery-token"
TIMEOUTS = Timeouts(op=2.0, heartbeat_interval=0.05, probe=0.2, heartbeat_timeout=1.0, quorum=5.0, join=10.0)


def _until(cond: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_claims_after_the_recovery_window_are_published_and_newcomers_never_take_a_claimed_quorums_ids() -> None:
    # Quorum 1 was [1, 2, 3], min_workers 2. Member 2 re-announces itself first: the ids of quorum 1 are
    # reserved at once (a newcomer takes 4, never 3). Alone below min_workers when the window ends, it gets
    # no quorum; member 1, late, is then published with it, and member 3, later still, joins them.
    coord = Coordinator(port=0, token=TOKEN, join_grace=0.0)
    run, clock = "late-claims", [100.0]
    st = connect(coord.address, 10.0)
    patience = TIMEOUTS.heartbeat_timeout

    def tick(seconds: float = 0.05) -> None:
        """The coordinator's clock moves on by ``seconds``; the members it admitted beat meanwhile."""
        end = clock[0] + seconds
        while clock[0] < end:
            clock[0] += 0.05
            for m in (1, 2, 3):
                st.add(f"{run}/hb/{m}", 1)
            coord.tick(clock[0])

    def claim(member: int) -> None:
        """What shoal.membership.reclaim does, with quorum 1 = [1, 2, 3] as the old coordinator signed it."""
        st.set(f"{run}/claims/{st.add(f'{run}/claims/n', 1)}", str(member))
        tick()
        nonce = st.get(f"{run}/claim/{member}/nonce").decode()
        st.set(f"{run}/claim/{member}/proof", auth.answer(TOKEN, f"{run}/{member}/claim", nonce))
        tick()
        assert st.get(f"{run}/claim/{member}/verdict") == b"ok"
        book = RecordBook(st, run, member, TOKEN)
        st.set(f"{run}/join/{member}", book.seal({"timeouts": vars(TIMEOUTS), "min_workers": 2}))
        prefix = f"{run}/q1/"
        mac = auth.sign(TOKEN, quorum_text(1, [1, 2, 3], prefix))
        st.set(f"{run}/claimrec/{member}",
               book.seal({"quorum": {"qid": 1, "members": [1, 2, 3], "prefix": prefix, "mac": mac}}))
        tick()

    def published() -> list[list[int]]:
        return [json.loads(st.get(f"{run}/q/{k}"))["members"] for k in range(2, int(st.add(f"{run}/q/latest", 0)) + 1)]

    try:
        st.set(f"runs/{st.add('runs/n', 1)}", run)
        st.add(f"{run}/next_id", 2)            # what member 2's reclaim does before it claims
        claim(2)
        assert st.add(f"{run}/next_id", 0) == 3   # a joiner now takes 4: id 3 waits for its member
        tick(patience + 0.2)
        assert coord._runs[run].recovery.done and published() == []   # one claimer < min_workers: nothing
        claim(1)
        tick()
        assert published() == [[1, 2]]
        claim(3)                                # left out by the recovery, alive, and back: taken in
        tick()
        assert published() == [[1, 2], [1, 2, 3]]
    finally:
        coord.stop()


def _in_a_quorum(timeouts: Timeouts) -> tuple[Coordinator, str, list[MemberClient], Any]:
    """A coordinator and two members of a new run, both in its first quorum: (coordinator, run, members, q1)."""
    first = Coordinator(port=0, token=TOKEN, join_grace=0.0, initial_workers=2).start()
    run = uuid.uuid4().hex[:8]
    members = [MemberClient(first.address, run, timeouts, min_workers=2, token=TOKEN) for _ in range(2)]
    ids = [c.join() for c in members]
    q1 = members[0].wait_quorum(0, timeout=10)
    assert members[1].wait_quorum(0, timeout=10) == q1 and list(q1.members) == ids == [1, 2]
    return first, run, members, q1


def _end(clients: list[MemberClient], coord: Coordinator | None) -> None:
    for c in clients:
        c.leave()
    if coord is not None:
        coord.stop()


def _kill(coord: Coordinator) -> None:
    """The coordinator dies: its loop stops and its store server goes (the members' connections end)."""
    coord.stop()
    coord._server = coord._store = None   # type: ignore[assignment]
    gc.collect()


@pytest.mark.timeout(60)
def test_a_member_whose_id_a_newcomer_took_joins_anew_at_the_restarted_coordinator(
        monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    # A newcomer joins the restarted coordinator before member 1 re-announces itself and takes id 1
    # (nothing reserves it yet). Member 1 is told "taken" and joins anew: at the new coordinator, under a
    # new id, and lands in a quorum with the newcomer and member 2. It used to keep the dead coordinator's
    # connection, fail every store call and stop after Timeouts.quorum ("the coordinator ... is unreachable").
    back = threading.Event()
    real = client_mod._reachable
    monkeypatch.setattr(client_mod, "_reachable", lambda address: back.is_set() and real(address))
    first, run, members, q1 = _in_a_quorum(TIMEOUTS)
    port, clients = first.port, list(members)
    second: Coordinator | None = None
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.elastic"):
            _kill(first)
            _until(lambda: all(c.down.is_set() for c in members), 20, "the members never took it for an outage")
            second = Coordinator(port=port, token=TOKEN, join_grace=0.0).start()
            newcomer = MemberClient(second.address, run, TIMEOUTS, min_workers=2, token=TOKEN)
            clients.append(newcomer)
            assert newcomer.join() == 1
            back.set()
            q = members[0].wait_quorum(q1.qid, timeout=TIMEOUTS.join)
        assert "did not take member 1 back (taken)" in caplog.text, caplog.text
        assert members[0].member_id not in (1, 2) and q.members == (1, 2, members[0].member_id), q
        assert newcomer.member_id == 1 and not newcomer.store.check([newcomer.key("dropped/1")])   # id 1 left alone
    finally:
        _end(clients, second)


@pytest.mark.timeout(60)
def test_a_member_still_waiting_for_its_first_quorum_joins_the_restarted_coordinator_anew(caplog: Any) -> None:
    # Nothing to re-announce ("no quorum"): the member joins anew at the new coordinator, registering the run
    # there (nobody else may), and is in the first quorum once its peer joins too.
    first = Coordinator(port=0, token=TOKEN, join_grace=0.0, initial_workers=2).start()
    port, run = first.port, uuid.uuid4().hex[:8]
    early = MemberClient(first.address, run, TIMEOUTS, min_workers=2, token=TOKEN)
    clients = [early]
    second: Coordinator | None = None
    try:
        assert early.join() == 1
        with caplog.at_level(logging.WARNING, logger="shoal.elastic"):
            _kill(first)
            _until(early.down.is_set, 20, "the member never took it for an outage")
            second = Coordinator(port=port, token=TOKEN, join_grace=0.0, initial_workers=2).start()
            _until(lambda: early._rejoin and not early.down.is_set(), 20, "the member was never told")
            with pytest.raises(ShoalError, match="no quorum including this worker"):
                early.wait_quorum(0, timeout=1.0)     # alone there: joined anew (a new id), no quorum yet
            assert not early._rejoin
            late = MemberClient(second.address, run, TIMEOUTS, min_workers=2, token=TOKEN)
            clients.append(late)
            late.join()
            q = early.wait_quorum(0, timeout=TIMEOUTS.join)
        assert "did not take member 1 back (no quorum)" in caplog.text, caplog.text
        assert sorted(q.members) == sorted([early.member_id, late.member_id]), q
    finally:
        _end(clients, second)


@pytest.mark.timeout(60)
def test_a_coordinator_restarted_within_a_blip_still_has_its_members_re_announce_themselves() -> None:
    # Restarted at once, before the members' heartbeats took its absence for an outage (a few failed beats and
    # heartbeat_timeout): a heartbeat thread that reconnects finds another incarnation and re-announces its
    # member, as after an outage. It used to beat on into the new, empty store: the run unknown there, the
    # next membership change waited for a quorum that never came.
    # An outage takes heartbeat_timeout (here 30 s) without a beat: only the incarnation check can re-announce
    # them within the 20 s the test waits.
    slow = Timeouts(op=2.0, heartbeat_interval=0.05, probe=0.2, heartbeat_timeout=30.0, quorum=40.0, join=60.0)
    first, run, members, q1 = _in_a_quorum(slow)
    port, ids = first.port, list(q1.members)
    second: Coordinator | None = None
    try:
        _kill(first)
        second = Coordinator(port=port, token=TOKEN, join_grace=0.0).start()
        _until(lambda: run in second._runs and second._runs[run].recovery.admitted == set(ids), 20,
               "the members never re-announced themselves to the coordinator restarted within a blip")
        assert all(c.incarnation == second.incarnation for c in members)
        members[0].request_quorum(q1.qid)     # a membership change now gets a quorum of both, as before
        q = members[0].wait_quorum(q1.qid, timeout=20)
        assert sorted(q.members) == sorted(ids), q
    finally:
        _end(members, second)
