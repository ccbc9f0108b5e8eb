"""The pieces that let an averaging strategy's survivors leave out a lost member before the next outer round (issue #20).

- :class:`~shoal.membership.watch.PeerWatch`: a member whose heartbeat counter
  stops is suspected; the watch raises the quorum's abort flag and asks the
  coordinator for a new quorum (a real TCPStore on loopback).
- :meth:`PeerWatcher.due` (what the group's ``renew_if_dissolved`` leaves): a
  quorum whose abort flag is raised, only outside a step and once per quorum.
- :class:`~shoal.membership.catchup.CatchUp`: a joiner of an averaging
  strategy (a replayer with ``after_commit``) starts its download only once
  the step that admitted it committed.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.membership.client import AbortWatch
from shoal.membership.coordinator import Quorum, connect
from shoal.membership.watch import PeerWatch, PeerWatcher


@pytest.mark.timeout(30)
def test_a_member_whose_heartbeat_stops_dissolves_the_quorum_and_asks_for_a_new_one() -> None:
    master = connect("127.0.0.1:0", 10.0, is_master=True)
    address = f"127.0.0.1:{master.port}"
    q = Quorum(3, (1, 2, 3), "run/q3/")
    client = SimpleNamespace(address=address, member_id=1, down=threading.Event(), abort=AbortWatch(),
                             key=lambda k: f"run/{k}")
    client.abort.watch(q.prefix)
    for m in (1, 2, 3):
        master.set(f"run/hb/{m}", "1")
    stop = threading.Event()

    def beat() -> None:   # members 1 and 2 live; member 3 was SIGKILLed: its counter stays
        n = 1
        while not stop.wait(0.01):
            n += 1
            master.set("run/hb/1", str(n))
            master.set("run/hb/2", str(n))
    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    watch = PeerWatch(client, lambda: q, window=0.2).start()   # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 20
        while not client.abort.raised(q.prefix) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watch.stop()
        stop.set()
        beater.join()
    assert client.abort.raised(q.prefix) and watch.suspected == 1
    assert master.check([q.prefix + "abort"]) and "[3]" in master.get(q.prefix + "abort").decode()
    assert master.get("run/req/3").decode() == "1"   # the coordinator probes and publishes the next quorum


@pytest.mark.timeout(30)
def test_a_member_slower_than_one_window_but_alive_is_not_suspected() -> None:
    """Member 3's heartbeat advances every 1.5 windows (a starved heartbeat thread): a third of the windows see its
    counter unchanged, never two in a row. The watch must not dissolve the quorum (it did when one
    window sufficed); a real death (the test above) still does."""
    master = connect("127.0.0.1:0", 10.0, is_master=True)
    q = Quorum(5, (1, 2, 3), "run/q5/")
    client = SimpleNamespace(address=f"127.0.0.1:{master.port}", member_id=1, down=threading.Event(),
                             abort=AbortWatch(), key=lambda k: f"run/{k}")
    client.abort.watch(q.prefix)
    stop, window = threading.Event(), 1.0

    def beat() -> None:
        n, t0 = 1, time.monotonic()
        while not stop.wait(0.01):
            n += 1
            master.set("run/hb/1", str(n))
            master.set("run/hb/2", str(n))
            master.set("run/hb/3", str(int((time.monotonic() - t0) / (1.5 * window))))
    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    time.sleep(0.1)
    watch = PeerWatch(client, lambda: q, window=window).start()   # type: ignore[arg-type]
    try:
        time.sleep(8 * window)
    finally:
        watch.stop()
        stop.set()
        beater.join()
    assert not client.abort.raised(q.prefix) and watch.suspected == 0


def _watcher(raised: bool) -> PeerWatcher:
    q = Quorum(4, (1, 2), "run/q4/")
    client = SimpleNamespace(abort=AbortWatch())
    client.abort.watch(q.prefix)
    if raised:
        client.abort.saw(q.prefix)
    return PeerWatcher(client, lambda: q, window=1.0)   # type: ignore[arg-type]


def test_a_dissolved_quorum_is_due_to_be_left_once_and_only_outside_a_step() -> None:
    w = _watcher(raised=True)
    assert w.due(in_step=True, after=0) is None            # inside a step: its vote discards it
    q = w.due(in_step=False, after=0)
    assert q is not None and q.qid == 4
    assert w.due(in_step=False, after=4) is None            # already leaving it (the group set _after)
    assert _watcher(raised=False).due(in_step=False, after=0) is None   # intact: nothing to leave
    assert w.suspected == 0 and w.thread is None            # the thread starts only with watch_peers()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("after_commit", [True, False])
def test_an_averaging_joiner_downloads_only_after_its_admitting_step_committed(after_commit: bool) -> None:
    from shoal.membership.fetch import Fetch

    group = SimpleNamespace(step=5, timeouts=SimpleNamespace(join=30.0, op=5.0),
                            client=SimpleNamespace(key=lambda k: f"run/{k}", member_id=3,
                                                   store=SimpleNamespace(clone=lambda: store)))
    store = SimpleNamespace(set=lambda k, v: None)
    fetch = Fetch(group, 4, [1, 2], top=5, after_commit=after_commit, pace=None)   # unpaced
    asked: list[int] = []

    def sources() -> list[Any]:
        asked.append(group.step)
        raise RuntimeError("no source in this test")
    fetch._sources = sources   # type: ignore[method-assign]
    fetch.start()
    if after_commit:
        time.sleep(0.3)
        assert asked == []          # the admitting step (5) has not committed: no byte asked for yet
        group.step = 6              # it commits
    fetch.thread.join(timeout=20)
    assert asked == ([6] if after_commit else [5]) and fetch.done.is_set()
    assert fetch.result[1] is not None and "no source in this test" in fetch.result[1], fetch.result   # it ran to the end
