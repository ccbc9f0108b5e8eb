"""Matchmaking expects peers the coordinator has admitted but not listed yet, and bounds the attempts a banned
peer closes alone (one process, threads)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch

import shoal
from shoal.collaborative.optimizer import CollaborativeOptimizer
from shoal.collaborative.rounds import MAX_SKIPPED, RoundGroup, RoundReport
from shoal.membership.coordinator import Coordinator, Quorum

TOKEN = "matchmaking-token"


@pytest.mark.timeout(60)
def test_first_round_waits_for_peers_admitted_before_the_coordinators_first_list() -> None:
    """Two peers join; the coordinator publishes no member list yet (its join grace outlasts the test,
    as a loaded machine's tick can outlast a first epoch). The first peer ready must wait for the other
    (within matchmaking_time) instead of closing the round alone: a peer left out of its first round
    has no state to load and waits out its load timeout (what made the device-guard tests take 20 s)."""
    coord = Coordinator(port=0, join_grace=120.0, initial_workers=2, token=TOKEN).start()
    cfg = shoal.CollaborativeConfig(run_id="mm" + uuid.uuid4().hex[:8], target_batch_size=2, batch_size_per_step=1,
                                    coordinator=coord.address, token=TOKEN, matchmaking_time=20.0)
    groups: list[RoundGroup] = []
    try:
        groups = [RoundGroup(cfg.run_id, cfg.coordinator, cfg.timeouts(), TOKEN, cfg.matchmaking_time,
                             {"pid": k}) for k in range(2)]
        assert groups[0].client.latest() == 0, "the coordinator published a list: the test needs none"
        got: dict[int, Any] = {}

        def ready(k: int, delay: float) -> None:
            time.sleep(delay)
            try:
                got[k] = groups[k].matchmake(0, 0, True, set(), time.monotonic() + 30)
            except BaseException as e:  # noqa: BLE001 - reported below
                got[k] = e

        threads = [threading.Thread(target=ready, args=(k, 0.5 * k), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(45)
        ids = sorted(g.client.member_id for g in groups)
        for k in range(2):
            q = got.get(k)
            if isinstance(q, BaseException):
                raise q
            assert q is not None, f"peer {k} was left out of the first round: {got}"
            assert sorted(q.members) == ids, (k, q.members, ids)
    finally:
        for g in groups:
            g.client.leave()
        coord.stop()


def _two_groups(matchmaking_time: float) -> tuple[Coordinator, list[RoundGroup]]:
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    cfg = shoal.CollaborativeConfig(run_id="mm" + uuid.uuid4().hex[:8], target_batch_size=2, batch_size_per_step=1,
                                    coordinator=coord.address, token=TOKEN, matchmaking_time=matchmaking_time)
    return coord, [RoundGroup(cfg.run_id, cfg.coordinator, cfg.timeouts(), TOKEN, cfg.matchmaking_time, {"pid": k})
                   for k in range(2)]


def _matchmake_both(groups: list[RoundGroup], epoch: int, attempt: int) -> list[Any]:
    got: list[Any] = [None, None]

    def ready(k: int) -> None:
        try:
            got[k] = groups[k].matchmake(epoch, attempt, True, set(), time.monotonic() + 30)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            got[k] = e
    threads = [threading.Thread(target=ready, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    for q in got:
        if isinstance(q, BaseException) or q is None:
            raise AssertionError(f"matchmaking of {epoch}/{attempt} failed: {got}")
    return got


@pytest.mark.timeout(90)
def test_only_a_first_attempt_names_the_last_committed_group() -> None:
    """An attempt after the first follows one whose group its members entered and dropped, while the record
    of the last committed group may still name the group they held before (its clearing, by the dropped
    group's rank 0, can land after the next list is closed). Naming that group would make them rendezvous
    a second time under one prefix, which hangs until averaging_timeout; so only a first attempt reuses."""
    coord, groups = _two_groups(matchmaking_time=20.0)
    try:
        ids = sorted(g.client.member_id for g in groups)
        stale = "an/old/committed/group/"
        last = groups[0].key("mm/last")
        groups[0].mm_store.set(last, groups[0].book.seal({"members": ids, "prefix": stale}))
        later = _matchmake_both(groups, 7, 1)
        assert {q.prefix for q in later} == {groups[0].key("mm/7/1/g/")}, [q.prefix for q in later]
        first = _matchmake_both(groups, 8, 0)       # the steady case keeps its reuse (no reconnection)
        assert {q.prefix for q in first} == {stale}, [q.prefix for q in first]
    finally:
        for g in groups:
            g.client.leave()
        coord.stop()


@pytest.mark.timeout(90)
def test_a_round_closed_by_banned_or_no_members_does_not_leave_a_peer_behind() -> None:
    """A banned peer (it broke the header rules) that runs ahead closes an epoch's first attempt alone, or
    a peer that gave up closes it with nobody: that is not the swarm averaging without this peer (which
    would make it stop and load state from nobody); it tries the next attempt. A list with a peer it
    trusts still leaves it behind."""
    coord, (a, b) = _two_groups(matchmaking_time=0.3)
    try:
        def alone(epoch: int, give_up: bool) -> None:
            deadline = time.monotonic() + (0.5 if give_up else 30)
            q = b.matchmake(epoch, 0, not give_up, set(), deadline)   # a never registers: b closes it
            assert (q is None) == give_up and (give_up or q.members == (b.client.member_id,)), q

        alone(3, give_up=False)
        a.ban({b.client.member_id})
        assert a.matchmake(3, 0, True, set(), time.monotonic() + 5) is None and a.skipped, "banned-only list"
        alone(4, give_up=True)
        a.banned.clear()
        assert a.matchmake(4, 0, True, set(), time.monotonic() + 5) is None and a.skipped, "empty list"
        alone(5, give_up=False)
        assert a.matchmake(5, 0, True, set(), time.monotonic() + 5) is None and not a.skipped, \
            "a list of trusted peers without this one: behind, as before"
        a.ban({b.client.member_id, a.client.member_id})
        assert a.banned == {b.client.member_id} and b.client.member_id not in a.live_others()
    finally:
        for g in (a, b):
            g.client.leave()
        coord.stop()


class _Skipping:
    """A RoundGroup whose first ``closed`` attempts of every epoch a banned peer closed alone (``skipped``);
    the next one forms a round with the honest peers. Only matchmaking is stood in for."""

    def __init__(self, closed: int, matchmaking_time: float) -> None:
        self.group = RoundGroup.__new__(RoundGroup)
        self.group.matchmaking_time, self.group.banned = matchmaking_time, {7}
        self.group.matchmake = self.matchmake   # type: ignore[method-assign]
        self.group.enter = lambda q, deadline: True   # type: ignore[method-assign]
        self.closed, self.calls = closed, []   # type: list[float]

    def matchmake(self, epoch: int, attempt: int, contributing: bool, excluded: set[int], deadline: float) -> Any:
        self.calls.append(time.monotonic())
        self.group.gave_up = False
        self.group.skipped = attempt < self.closed
        return None if self.group.skipped else Quorum(1 << 60, (1, 2), "mm/g/")


def _optimizer(group: RoundGroup) -> Any:
    opt = CollaborativeOptimizer.__new__(CollaborativeOptimizer)
    opt.group = group
    opt._attempt = lambda epoch, *a: (RoundReport(epoch, "averaged", 2, 4), None)   # type: ignore[method-assign]
    return opt


@pytest.mark.timeout(60)
def test_attempts_a_banned_peer_closed_ahead_are_skipped_with_growing_waits_then_given_up() -> None:
    """A banned peer can close every attempt of an epoch alone, ahead of the others: tried back to back,
    an honest peer would register in thousands of them (a few store requests each) until averaging_timeout.
    Skips wait longer and longer, and the epoch ends in a local step after MAX_SKIPPED of them."""
    mm = _Skipping(closed=10**9, matchmaking_time=0.2)
    t0 = time.monotonic()
    report, averaged = _optimizer(mm.group)._round(3, 3, torch.zeros(4), 4, True, timeout=8.0)
    assert report.outcome == "local" and averaged is None and report.epoch == 3
    assert len(mm.calls) == MAX_SKIPPED, f"{len(mm.calls)} attempts in {time.monotonic() - t0:.1f} s"
    gaps = [b - a for a, b in zip(mm.calls, mm.calls[1:])]
    assert all(g >= 0.09 for g in gaps[6:]), gaps   # from the 7th skip on: half the 0.2 s window each
    assert time.monotonic() - t0 < 8.0              # not the whole averaging_timeout


@pytest.mark.timeout(60)
def test_a_few_attempts_closed_by_a_banned_peer_still_end_in_the_honest_peers_round() -> None:
    mm = _Skipping(closed=5, matchmaking_time=0.2)
    report, _ = _optimizer(mm.group)._round(3, 3, torch.zeros(4), 4, True, timeout=8.0)
    assert report.outcome == "averaged" and len(mm.calls) == 6
