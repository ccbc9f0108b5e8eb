"""The quorum barrier (shoal.membership.rendezvous): what a member that stops waiting leaves behind.

A member's arrival at the barrier is counted the moment it arrives. If it
then stops waiting without dissolving the quorum, the others can still
complete the count, pass, and wait in the gloo constructor for a member that
is not coming. These tests drive :class:`Rendezvous.meet` against an
in-memory store and client: no processes, no sockets.
"""

from __future__ import annotations

import time
from typing import Any

from shoal.membership.coordinator import Quorum
from shoal.membership.rendezvous import SUPERSEDED, Rendezvous


class _Store:
    """The store calls the barrier makes; every member's heartbeat counter moves at each read (all alive)."""

    def __init__(self) -> None:
        self.kv: dict[str, Any] = {}

    def add(self, key: str, n: int) -> int:
        if "/hb/" in key:
            n = 1
        self.kv[key] = int(self.kv.get(key, 0)) + n
        return self.kv[key]

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value


class _Abort:
    def __init__(self) -> None:
        self.seen: set[str] = set()

    def raised(self, prefix: str | None) -> bool:
        return prefix in self.seen

    def saw(self, prefix: str) -> None:
        self.seen.add(prefix)


class _Client:
    def __init__(self, member_id: int) -> None:
        self.member_id, self.store, self.abort = member_id, _Store(), _Abort()
        self.newest = 1

    def key(self, k: str) -> str:
        return f"run/{k}"

    def latest(self) -> int:
        return self.newest


Q = Quorum(qid=1, members=(1, 2), prefix="run/q1/")


def test_a_member_whose_deadline_passes_at_the_barrier_dissolves_the_quorum() -> None:
    # Member 2 heartbeats but has not arrived. Member 1 gives up at its deadline: its arrival stays counted,
    # so it must raise the quorum's abort flag (and ask for the next quorum), or member 2 would pass the
    # barrier on arriving and wait in the gloo constructor for member 1 until Timeouts.op.
    client = _Client(1)
    why = Rendezvous(client, None, Q, time.monotonic() + 0.05, window=0.01).meet()  # type: ignore[arg-type]
    assert why is not None and "deadline" in why, why
    assert client.store.kv[Q.prefix + "arrive"] == 1                 # counted
    assert str(client.store.kv.get(Q.prefix + "abort", "")).startswith("rendezvous:"), client.store.kv
    assert client.abort.raised(Q.prefix) and client.store.kv.get("run/req/1") == "1"   # the next quorum asked for


def test_a_newer_quorum_needs_no_dissolving() -> None:
    # Superseded: every member moves to the newer quorum by itself; this one's flag stays down.
    client = _Client(1)
    client.newest = 2
    why = Rendezvous(client, None, Q, time.monotonic() + 5.0, window=0.01).meet()  # type: ignore[arg-type]
    assert why == SUPERSEDED
    assert Q.prefix + "abort" not in client.store.kv and "run/req/1" not in client.store.kv


def test_every_member_arrived_passes() -> None:
    client = _Client(1)
    client.store.kv[Q.prefix + "arrive"] = 1   # member 2 is already there
    assert Rendezvous(client, None, Q, time.monotonic() + 5.0, window=0.01).meet() is None  # type: ignore[arg-type]
    assert "run/req/1" not in client.store.kv


def test_the_stillness_rule_forgives_one_still_window_and_judges_two_or_a_departure() -> None:
    # One rule for the peer watch and the rendezvous (shoal.membership.watch.Stillness).
    from shoal.membership.watch import Stillness

    judge = Stillness(windows=2)
    assert judge.update({2: 5, 3: 9, 4: 1}) == []          # first read: nothing to compare with
    assert judge.update({2: 6, 3: 9, 4: 1}) == []          # 3 and 4 still for one window: starved, not dead
    assert judge.update({2: 7, 3: 9, 4: 2}) == [3]          # 3 still for two windows in a row; 4 moved again
    assert judge.update({2: -1, 3: 10, 4: 3}) == [2]        # 2 left (-1): at once; 3 moved: forgiven
    judge.reset()
    assert judge.update({2: -1, 3: 10, 4: 3}) == []         # a new quorum is judged from scratch
