"""A failed step pauses a joiner's paced download until the retried step commits (shoal.membership.pace).

A kill fails the step in flight; the survivors then vote, build the next quorum's group and re-run the
step. A paced download (SHOAL_HEAL_PACE) whose slot stayed open through that would share the link with
the recovery and the retried step, and add to what the kill costs them. Here: the pace on made-up times,
the group's failures reaching their listeners once a step, and one joiner's CatchUp over a stand-in
group and two real snapshot servers on loopback (the stand-ins of test_heal_abandon), parked so that
every check runs every time.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from test_abort_watch import _Interleaving
from test_heal_abandon import HID, _Group, _Replayer, _Store, _two_sources

from shoal.membership.catchup import CatchUp
from shoal.membership.client import AbortWatch
from shoal.membership.pace import StepPace
from shoal.membership.vote import Failures


def test_a_failed_step_closes_the_slot_and_the_retried_commit_opens_the_next() -> None:
    pace = StepPace(0.5)
    pace.admitted(now=0.0)
    assert pace.committed(now=10.0) == pytest.approx(5.0)   # a slot until 15.0
    pace.pause(now=12.0)                                     # the step failed at 12.0
    assert pace.slot_left(12.0) == 0.0 and pace.slot_left(14.0) == 0.0 and pace.pauses == 1
    # The retried step commits at 23.0: measured from the failure (11 s: one recovery and one step), so the
    # 13 s between the last two commits never enters the median as a step; the window is now 10 and 11.
    assert pace.committed(now=23.0) == pytest.approx(0.5 * 10.5)
    assert pace.slot_left(24.0) == pytest.approx(23.0 + 5.25 - 24.0)


def test_one_failure_told_twice_pauses_once() -> None:
    pace = StepPace(0.5)
    pace.admitted(now=0.0)
    pace.committed(now=10.0)
    pace.pause(now=12.0)             # its first recorded failure
    pace.pause(now=12.5)             # ... then its discard verdict
    assert pace.pauses == 1
    assert pace.committed(now=22.0) == pytest.approx(0.5 * 10.0)   # measured from the failure (12.0)
    pace.step_begun()
    pace.pause(now=23.0)             # the next failed step
    assert pace.pauses == 2
    pace.step_begun()                # its retry fails too, before any commit: a pause of its own
    pace.pause(now=26.0)
    assert pace.pauses == 3
    assert pace.committed(now=36.0) == pytest.approx(0.5 * 10.0)   # measured from the last failure (26.0)


def test_a_pause_before_any_commit_keeps_the_admission_closed() -> None:
    pace = StepPace(0.5)
    pace.admitted(now=0.0)
    pace.pause(now=4.0)             # the admitting step itself failed
    assert pace.slot_left(4.0) == 0.0
    assert pace.committed(now=14.0) == pytest.approx(5.0)   # measured from the failure: a 10 s step


def test_a_released_pace_stays_released_through_a_pause() -> None:
    pace = StepPace(0.5)
    pace.admitted(now=0.0)
    pace.release()                  # leave(): the rest of the download goes flat out
    pace.pause(now=1.0)
    assert pace.slot_left(1.0) == float("inf")


def test_failures_call_their_listeners_once_at_each_steps_first_failure() -> None:
    real = dist.HashStore()
    client = SimpleNamespace(store=_Interleaving(real, "-", lambda: None), abort=AbortWatch())
    failures = Failures(client, lambda: "run/q1/", lambda *a, **k: None)  # type: ignore[arg-type]
    calls: list[str] = []
    failures.on_failure.append(lambda: calls.append("paused"))
    failures.record(RuntimeError("a peer closed its socket"))
    failures.record(RuntimeError("the next collective of the same step"))
    assert calls == ["paused"]
    failures.error = None           # the next step (begin_step clears it)
    failures.record(RuntimeError("that one fails too"))
    assert calls == ["paused", "paused"]


def test_the_abort_flag_goes_up_before_the_listeners_and_a_raising_listener_hides_nothing() -> None:
    real = dist.HashStore()
    client = SimpleNamespace(store=_Interleaving(real, "-", lambda: None), abort=AbortWatch())
    failures = Failures(client, lambda: "run/q1/", lambda *a, **k: None)  # type: ignore[arg-type]
    seen: list[bool] = []

    def broken() -> None:
        seen.append(bool(real.check(["run/q1/abort"])))   # the others were told first
        raise RuntimeError("a listener's own bug")
    failures.on_failure.extend([broken, lambda: seen.append(True)])
    failures.record(RuntimeError("a peer closed its socket"))
    assert seen == [True, True] and failures.error is not None and real.check(["run/q1/abort"])


@pytest.mark.timeout(60)
def test_a_failed_step_stops_the_joiners_requests_until_the_retried_step_commits() -> None:
    raw = dist.HashStore()
    servers = _two_sources(raw)
    group = _Group(_Store(raw))
    group.heal_chunk = 1024                # the 8 KB state in 8 ranges: more than the two parked
    c = CatchUp(group)
    c.pace_fraction = 1.0
    c.replayers.append(_Replayer())        # type: ignore[arg-type]
    asked: list[int] = []
    go = threading.Event()

    def before_chunk(source: int, received: int) -> None:   # park every request: the kill strikes there
        asked.append(source)
        go.wait(30.0)
    c.before_chunk = before_chunk
    c._admit(HID, [1, 2], top=5)
    assert c.pace is not None
    now = time.monotonic()
    c.pace.admitted(now - 100.0)
    c.pace.committed(now)                  # a step committed: a 100 s slot opens
    deadline = time.monotonic() + 20.0
    while len(asked) < 2 and time.monotonic() < deadline:   # each source's first request, parked in the hook:
        time.sleep(0.01)                   # no request is between its slot check and the hook now
    assert sorted(asked) == [1, 2], asked
    c.step_failed()                        # a member lost: the step in flight fails
    assert c.stats.pauses == 1
    go.set()                               # those two were asked for before: they come
    time.sleep(0.5)   # unpaused, the rest of this snapshot would come over loopback in milliseconds
    assert len(asked) == 2, f"{len(asked) - 2} ranges asked for after the step failed, before any commit"
    n = len(asked)
    assert c.fetch is not None and not c.fetch.done.is_set()
    c.pace.committed(time.monotonic())     # the retried step commits: the next slot opens
    assert c.fetch.done.wait(20.0)
    assert len(asked) > n and c.fetch.result[1] is None
    c._abandon()
    for s in servers:
        s.close()
