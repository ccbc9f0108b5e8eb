"""When a restart training before its admission enters its quorum (shoal.membership.preadmit), on a fake store.

The rule under test: it enters once every other member of the quorum waits at the barrier *or trains before its
admission too*. Counting only the barrier, two restarts of one quorum (a lost host's two workers) would each wait
for the other forever, and the survivors at the barrier would give up on the quorum and fail.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from shoal.membership.coordinator import Quorum
from shoal.membership.preadmit import EarlyEntry, held_mark


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, Any] = {}
        self.reads = 0
        self.fail = False

    def add(self, key: str, n: int) -> int:
        if self.fail:
            raise ConnectionError("the coordinator does not answer")
        self.reads += 1
        self.kv[key] = int(self.kv.get(key, 0)) + n
        return int(self.kv[key])

    def check(self, keys: list[str]) -> bool:
        if self.fail:
            raise ConnectionError("the coordinator does not answer")
        return all(k in self.kv for k in keys)

    def set(self, key: str, value: Any) -> None:
        self.kv[key] = value


def _catchup(store: _Store, latest: int = 5) -> Any:
    client = SimpleNamespace(store=store, latest_seen=latest, down=threading.Event(), member_id=9,
                             key=lambda k: f"run/{k}")
    return SimpleNamespace(group=SimpleNamespace(client=client))


Q = Quorum(5, (1, 2, 8, 9), "q5/")   # survivors 1 and 2; restarts 8 and 9


def _entry(counted: bool) -> EarlyEntry:
    return EarlyEntry(Q, fetch=None, deadline=time.monotonic() + 60, counted=counted)   # type: ignore[arg-type]


def test_a_lone_restart_enters_once_every_other_member_waits_at_the_barrier() -> None:
    store = _Store()
    q = Quorum(5, (1, 2, 9), "q5/")
    cu, entry = _catchup(store), EarlyEntry(q, None, time.monotonic() + 60, counted=True)  # type: ignore[arg-type]
    store.add("q5/early", 1)   # itself
    store.add("q5/arrive", 1)
    assert not entry.due(cu)
    store.add("q5/arrive", 1)
    assert entry.due(cu)


def test_two_restarts_training_early_count_each_other_and_neither_waits_for_the_other() -> None:
    store = _Store()
    cu = _catchup(store)
    a, b = _entry(True), _entry(True)
    store.add("q5/early", 2)       # both train before their admission
    store.add("q5/arrive", 1)
    assert not a.due(cu) and not b.due(cu)   # one survivor still in its inner steps
    store.add("q5/arrive", 1)      # both survivors wait at the barrier
    assert a.due(cu) and b.due(cu)


def test_a_restart_still_downloading_gives_up_once_the_others_are_there_or_training() -> None:
    store = _Store()
    cu = _catchup(store)
    downloading = _entry(False)    # not counted yet: its download has not ended
    store.add("q5/early", 1)       # the other restart trains early
    store.add("q5/arrive", 1)
    assert not downloading.due(cu)
    store.add("q5/arrive", 1)
    assert downloading.due(cu)     # it goes to the barrier; its download goes on there


def test_a_dissolved_or_superseded_quorum_a_silent_coordinator_or_the_deadline_end_the_wait() -> None:
    store = _Store()
    entry = _entry(True)
    store.add("q5/early", 1)
    assert not entry.due(_catchup(store))
    assert entry.due(_catchup(store, latest=6))   # a newer quorum is published
    store.set("q5/abort", "member 2 lost")
    assert entry.due(_catchup(store))
    fresh = _Store()
    fresh.fail = True
    assert _entry(True).due(_catchup(fresh))      # no answer: the barrier's own wait decides
    late = EarlyEntry(Q, None, time.monotonic() - 1, counted=True)  # type: ignore[arg-type]
    assert late.due(_catchup(_Store()))


def test_a_new_run_meets_at_its_first_barrier_at_once() -> None:
    # No member has committed a step yet (no mark): no quorum is waited for, no download started.
    store = _Store()
    waited: list[Any] = []
    client = SimpleNamespace(store=store, member_id=3, key=lambda k: f"run/{k}",
                             wait_quorum=lambda after, t: waited.append(after))
    group = SimpleNamespace(client=client, _fresh=True, quorum=None, _after=0, timeouts=SimpleNamespace(join=5.0))
    catchup = SimpleNamespace(group=group, enabled=True, hid=-1, replayers=[object()],
                              _between_rounds=lambda: True, column=lambda: (-1, True))
    assert EarlyEntry.wait(catchup) is None and waited == []
    assert held_mark(client) == "run/held"
