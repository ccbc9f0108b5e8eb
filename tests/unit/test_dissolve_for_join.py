"""A source between two rounds dissolves its quorum for a join with no loss (CatchUp.offer_early).

A quorum that lost no member would run its next round without a worker the coordinator has since
published with it (only that round's vote told the survivors), and the newcomer would download only
after it: a period later in DiLoCo. The first survivor to see a published quorum that holds all of its
quorum's members and more raises its quorum's abort flag, between two rounds and not within JOIN_MARGIN
inner steps of the next one, and offers the newcomers its snapshot. One source's CatchUp over a
stand-in group and a HashStore; the offer itself is recorded, not served (test_heal_early serves it).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from shoal.membership.catchup import JOIN_MARGIN, CatchUp
from shoal.membership.client import AbortWatch
from shoal.membership.coordinator import Quorum, Timeouts

ME = 1
Q = Quorum(3, (1, 2, 3), "run/q3/")


class _FlakyStore:
    """A HashStore whose ``set`` fails while ``failing`` is set (a blip of the coordinator)."""

    def __init__(self) -> None:
        self.raw, self.failing = dist.HashStore(), False

    def set(self, key: str, value: str) -> None:
        if self.failing:
            raise RuntimeError("connection reset by peer")
        self.raw.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.raw.check(keys)


class _Client:
    member_id, token, run_id, address = ME, None, "run", "127.0.0.1:29999"

    def __init__(self, quorums: dict[int, Quorum]) -> None:
        self.store, self.down, self.abort, self.quorums = _FlakyStore(), threading.Event(), AbortWatch(), quorums
        self.abort.watch(Q.prefix)
        self.peek_latest = threading.Event()
        self.latest_seen = max(quorums)   # what the heartbeat thread read (MemberClient.peek_latest)
        self.reads = 0

    def quorum(self, qid: int) -> Quorum:
        self.reads += 1
        return self.quorums[qid]


class _Group:
    timeouts = Timeouts()

    def __init__(self, quorums: dict[int, Quorum]) -> None:
        self.client, self.quorum, self.step = _Client(quorums), Q, 12
        self._in_step, self._fresh, self._after = False, False, 0
        self.traced: list[tuple[str, dict[str, Any]]] = []

    def trace(self, ev: str, **kw: Any) -> None:
        self.traced.append((ev, kw))

    def on_commit(self, fn: Any) -> None:
        pass


class _Outer:
    after_commit = True           # an averaging strategy (DiLoCo)
    enters_between_rounds = True  # without overlapped reductions


class _Server:
    def drop(self, hid: int) -> None:
        pass


def _source(*later: Quorum) -> tuple[CatchUp, _Group, list[tuple[int, set[int]]]]:
    group = _Group({Q.qid: Q, **{q.qid: q for q in later}})
    c = CatchUp(group)
    c.enabled = True
    c.replayers.append(_Outer())   # type: ignore[arg-type]
    c.server = _Server()           # type: ignore[assignment]
    offered: list[tuple[int, set[int]]] = []
    c._offer = lambda hid, joiners: offered.append((hid, set(joiners)))   # type: ignore[method-assign]
    return c, group, offered


def _flag(group: _Group) -> bool:
    return group.client.store.check([Q.prefix + "abort"])


def test_a_join_with_no_loss_dissolves_the_quorum_and_offers_the_newcomer() -> None:
    c, group, offered = _source(Quorum(4, (1, 2, 3, 9), "run/q4/"))
    assert c.offer_early(steps_left=JOIN_MARGIN)
    assert group.client.peek_latest.is_set()   # the heartbeat thread reads the newest quorum id from now on
    assert _flag(group) and group.client.abort.raised(Q.prefix)   # the next round leaves this quorum
    assert offered == [(4, {9})] and c.stats.dissolved_for_join == 1 and c.stats.offered_early == 1
    assert [ev for ev, _ in group.traced] == ["dissolve-for-join"]
    c._peeked = 0.0
    assert not c.offer_early(steps_left=JOIN_MARGIN)   # offered once per published quorum
    assert c.stats.dissolved_for_join == 1 and len(offered) == 1


def test_near_the_next_round_a_join_waits_for_that_rounds_vote() -> None:
    # A faster member may already be in that round: the flag would make it discard it.
    c, group, offered = _source(Quorum(4, (1, 2, 3, 9), "run/q4/"))
    assert not c.offer_early(steps_left=JOIN_MARGIN - 1)
    assert not _flag(group) and offered == [] and group.client.reads == 0   # nor read the quorum


def test_a_quorum_that_lost_a_member_is_left_to_the_coordinators_flag() -> None:
    # Quorum 4 has the newcomer but not member 3: the coordinator raises the flag itself when a member is lost.
    c, group, offered = _source(Quorum(4, (1, 2, 9), "run/q4/"))
    assert not c.offer_early(steps_left=JOIN_MARGIN + 5)
    assert not _flag(group) and offered == [] and c.stats.dissolved_for_join == 0
    group.client.store.raw.set(Q.prefix + "abort", "member lost")   # the coordinator's flag, seen by the heartbeat
    group.client.abort.saw(Q.prefix)
    c._peeked = 0.0
    assert c.offer_early(steps_left=0)   # a dissolved quorum offers whatever the steps left
    assert offered == [(4, {9})] and c.stats.dissolved_for_join == 0


def test_a_quorum_already_leaving_or_in_a_step_or_a_fresh_member_raises_nothing() -> None:
    for setup in ("after", "in_step", "fresh", "down"):
        c, group, offered = _source(Quorum(4, (1, 2, 3, 9), "run/q4/"))
        if setup == "after":
            group._after = Q.qid   # a commit's vote told of quorum 4: the next begin_step adopts it anyway
        elif setup == "in_step":
            group._in_step = True
        elif setup == "fresh":
            group._fresh = True
        else:
            group.client.down.set()   # the coordinator is unreachable
        assert not c.offer_early(steps_left=JOIN_MARGIN + 5), setup
        assert not _flag(group) and offered == [], setup


def test_a_store_that_does_not_answer_raises_nothing_and_the_next_peek_tries_again() -> None:
    c, group, offered = _source(Quorum(4, (1, 2, 3, 9), "run/q4/"))
    group.client.store.failing = True
    assert not c.offer_early(steps_left=JOIN_MARGIN)
    assert not group.client.abort.raised(Q.prefix) and offered == [] and c.stats.dissolved_for_join == 0
    group.client.store.failing = False
    assert not c.offer_early(steps_left=JOIN_MARGIN)   # within EARLY_PEEK_S of the last peek
    c._peeked = 0.0
    assert c.offer_early(steps_left=JOIN_MARGIN)
    assert _flag(group) and offered == [(4, {9})]


@pytest.mark.parametrize("members", [(1, 2, 3), (2, 3, 9)])
def test_a_newer_quorum_without_newcomers_or_without_this_member_is_not_offered(members: tuple[int, ...]) -> None:
    c, group, offered = _source(Quorum(4, members, "run/q4/"))
    assert not c.offer_early(steps_left=JOIN_MARGIN + 5)
    assert not _flag(group) and offered == []


@pytest.mark.timeout(60)
def test_the_heartbeat_thread_reads_the_newest_quorum_id_only_once_asked() -> None:
    # The training thread peeks between every two inner steps; a store round trip there would cost it the
    # link's latency each time (tens of ms over a WAN), so the heartbeat thread reads the id for it.
    import time
    import uuid

    from shoal.membership.client import MemberClient
    from shoal.membership.coordinator import Coordinator

    timeouts = Timeouts(op=2.0, heartbeat_interval=0.05, probe=0.2, heartbeat_timeout=1.0, quorum=5.0, join=10.0)
    coord = Coordinator(port=0, initial_workers=2, token="dissolve-token").start()
    run = uuid.uuid4().hex[:8]
    clients = [MemberClient(coord.address, run, timeouts, min_workers=2, token="dissolve-token") for _ in range(2)]
    try:
        for c in clients:
            c.join()
        deadline = time.monotonic() + 20
        while clients[0].latest_or(0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        latest = clients[0].latest_or(0)
        assert latest >= 1
        time.sleep(0.3)
        assert clients[0].latest_seen == -1   # not asked: no extra store call per beat
        clients[0].peek_latest.set()
        while clients[0].latest_seen != latest and time.monotonic() < deadline:
            time.sleep(0.02)
        assert clients[0].latest_seen == latest
    finally:
        for c in clients:
            c.leave()
        coord.stop()


@pytest.mark.timeout(60)
def test_an_outage_forgets_the_newest_quorum_id_read_from_the_lost_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    # A restarted coordinator numbers its quorums anew from what the members claim: an id read from the old
    # one may never be published by the new one, and offer_early would then wait on that record.
    import uuid

    import shoal.membership.client as client_mod
    from shoal.membership.client import MemberClient
    from shoal.membership.coordinator import Coordinator

    coord = Coordinator(port=0, initial_workers=1, token="dissolve-token").start()
    c = MemberClient(coord.address, uuid.uuid4().hex[:8], Timeouts(), token="dissolve-token")
    try:
        c.latest_seen = 7
        stop = threading.Event()
        # The address does not answer, and the member leaves at _outage's first look at it: _outage returns
        # after its bookkeeping (a thread stopped before it came in changes nothing: test_stale_heartbeat).
        monkeypatch.setattr(client_mod, "_reachable", lambda address: stop.set() or False)
        c._outage(c.member_id, stop, RuntimeError("connection reset by peer"))
        assert c.down.is_set() and c.latest_seen == -1
    finally:
        coord.stop()
