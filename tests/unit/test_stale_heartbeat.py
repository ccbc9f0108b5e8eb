"""A heartbeat thread that outlives ``leave()`` must not change the client afterwards.

``leave()`` waits for the heartbeat thread ``2 * heartbeat_interval + 1`` s, but a re-announcement to a
(restarted) coordinator (:func:`shoal.membership.reclaim.reclaim`) can block up to ``2 * Timeouts.quorum``.
The thread, stopped but still running, used to swap the client's store and record book (or mark it to
join anew) once that re-announcement returned: after the member had left, or joined anew under another
id, whose membership it then clobbered. Here the stale thread is held inside the re-announcement (the
coordinator's challenge, ``reclaim._challenge``) by an Event, so every step happens in a fixed order.

The coordinators are real and in-process (the helpers of test_coordinator_recovery).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

import shoal.membership.reclaim as reclaim_mod
from shoal.errors import ShoalError
from shoal.membership.coordinator import Coordinator

sys.path.insert(0, os.path.dirname(__file__))
from test_coordinator_recovery import TIMEOUTS, TOKEN, _end, _in_a_quorum, _kill  # noqa: E402


def _hold_reclaim(monkeypatch: pytest.MonkeyPatch, thread: threading.Thread) -> tuple[threading.Event, threading.Event]:
    """Hold ``thread`` inside its re-announcement, at the coordinator's challenge: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = reclaim_mod._challenge

    def challenge(client: Any, st: Any, base: str, member_id: int) -> str:
        if threading.current_thread() is thread:
            entered.set()
            assert release.wait(30), "the test never released the heartbeat thread"
        return real(client, st, base, member_id)

    monkeypatch.setattr(reclaim_mod, "_challenge", challenge)
    return entered, release


@pytest.mark.timeout(60)
def test_a_heartbeat_thread_that_outlives_leave_changes_nothing_when_its_re_announcement_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The coordinator stays up, so the member's own store keeps working and it can join anew at once. Its
    # heartbeat thread is made to re-announce it all the same: the member takes the coordinator for another
    # incarnation than the one it joined, and one beat fails (a reconnect checks the incarnation). The
    # coordinator tells it "taken" (id 1 is a live member there): without the fix the thread then swapped
    # in its own connection and marked the client to join anew, after leave().
    first, run, members, q1 = _in_a_quorum(TIMEOUTS)
    a, b = members
    clients = list(members)
    try:
        stale = a._hb
        assert stale is not None
        store, book, record = a.store, a.book, a._record
        entered, release = _hold_reclaim(monkeypatch, stale)
        a.incarnation = "an-earlier-incarnation"
        failed = threading.Event()
        real_poll = a.abort.poll

        def poll_failing_once(st: Any) -> None:
            if threading.current_thread() is stale and not failed.is_set():
                failed.set()
                raise ConnectionError("one failed beat")
            real_poll(st)

        monkeypatch.setattr(a.abort, "poll", poll_failing_once)
        assert entered.wait(20), "the heartbeat thread never re-announced the member"
        a.leave()                               # its wait for the heartbeat thread ends first
        assert stale.is_alive()
        release.set()
        stale.join(20)
        assert not stale.is_alive()
        # What the client was when it left: the late verdict changed nothing of it.
        assert (a.store, a.book, a._record, a.member_id) == (store, book, record, 1)
        assert not a._rejoin and a.dropped_prefix is None

        new = a.join()
        assert new not in (1, 2) and a.member_id == new and a.book.member_id == new
        assert a._record is not record and a.store is not store   # joined on a fresh connection (down was set)
        assert not a.down.is_set() and a.incarnation == first.incarnation
        q = a.wait_quorum(q1.qid, timeout=TIMEOUTS.join)
        assert q.members == (2, new), q
        assert not a._rejoin and a.member_id == new   # nothing of the old thread came back meanwhile
    finally:
        _end(clients, first)


@pytest.mark.timeout(60)
def test_join_is_refused_while_a_heartbeat_thread_that_left_still_re_announces_the_member(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The coordinator is restarted; member 1's heartbeat thread is held in its re-announcement and leave()
    # gives up waiting for it. A join now would race that thread for the client's store: it is refused,
    # saying why. Once the thread ends (its re-announcement, verified by the new coordinator, is dropped and
    # the id it claimed ended there), a join goes through, on a fresh connection (the client's store was the
    # dead coordinator's), and the member lands in a quorum with member 2.
    first, run, members, q1 = _in_a_quorum(TIMEOUTS)
    a, b = members
    clients, second = list(members), None
    try:
        stale = a._hb
        assert stale is not None
        store = a.store
        entered, release = _hold_reclaim(monkeypatch, stale)
        _kill(first)
        second = Coordinator(port=first.port, token=TOKEN, join_grace=0.0).start()
        assert entered.wait(20), "the heartbeat thread never re-announced the member"
        a.leave()
        assert stale.is_alive() and a.down.is_set()
        with pytest.raises(ShoalError, match="still re-announcing member 1"):
            a.join()
        release.set()
        stale.join(20)
        assert not stale.is_alive()
        assert a.store is store and a.member_id == 1 and not a._rejoin   # its late verdict was dropped

        new = a.join()
        assert new not in (1, 2) and a.store is not store and a.incarnation == second.incarnation
        q = a.wait_quorum(0, timeout=TIMEOUTS.join)
        assert new in q.members and 2 in q.members and 1 not in q.members, q
    finally:
        _end(clients, second)
