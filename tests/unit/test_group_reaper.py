"""A quorum's group let go of after a failure is destroyed at once, off the training thread.

Kept alive (as it was, for ``Timeouts.op``), a gloo group whose peer reset a
connection can spin its loop thread on that socket: on the emulated cluster
~0.8 of a core, taken from the worker's own CPU share, its inner steps 1.5-3x
slower for up to a minute after each kill (shoal.comm.lifetime); a waited
handle that kept its gloo work, or a failed wait's error kept in a reference
cycle with its frame (and so the work), kept the group's connections, and the
spin, as long as they lived. Destroyed
in the training thread, a group with an operation stuck on a silent peer
would hold that thread until the group's timeout. The checks: the group is
gone (a weak reference dies) within the reaper's grace, whatever
``Timeouts.op`` is; and while its destructor waits for a stuck allreduce,
the thread that let go of it keeps running Python.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shoal.comm import lifetime
from shoal.comm.meter import Meter
from shoal.membership.coordinator import Timeouts
from shoal.membership.transport import Link, _ElasticHandle
from shoal.testing import free_port

ROOT = Path(__file__).resolve().parents[2]

# The peer: joins a 2-member gloo group and takes part in nothing, until its stdin closes.
PEER = textwrap.dedent("""
    import datetime, sys, torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=float(sys.argv[2])))
    print("joined", flush=True)
    sys.stdin.read()
""")


def _pair(op_timeout: float) -> tuple[object, subprocess.Popen[str]]:
    """A gloo group of this process (rank 0) and a peer process that never joins an operation."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port), str(op_timeout)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                                    "PATH": "/usr/bin:/bin"})
    pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=op_timeout))
    assert peer.stdout is not None and peer.stdout.readline().strip() == "joined"
    return pg, peer


def _link(op: float) -> Link:
    return Link(client=None, timeouts=Timeouts(op=op), factory=lambda spec: None,  # type: ignore[arg-type]
                failures=None, step=lambda: 0)  # type: ignore[arg-type]


def _gone_within(ref: weakref.ref[object], limit: float) -> float | None:
    """Seconds until ``ref`` died, or None if it lived ``limit`` s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if ref() is None:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


@pytest.mark.timeout(60)
def test_a_retired_group_is_destroyed_within_the_grace_not_after_the_op_timeout() -> None:
    pg, peer = _pair(op_timeout=30.0)
    try:
        ref, link = weakref.ref(pg), _link(op=30.0)   # the link lives on, as a worker's does
        link.retire(pg)
        del pg
        took = _gone_within(ref, 10.0)
        assert took is not None, "a retired group was still alive 10 s later (Timeouts.op is 30 s)"
        assert took <= lifetime.REAPER.grace + 2.0, took
        del link
    finally:
        peer.communicate("", timeout=30)


@pytest.mark.timeout(60)
def test_a_retired_group_with_a_stuck_allreduce_does_not_hold_the_thread_that_let_go_of_it() -> None:
    pg, peer = _pair(op_timeout=4.0)
    try:
        work = pg.allreduce([torch.ones(4)])   # the peer never joins: stuck until gloo's 4 s timeout
        ref, link = weakref.ref(pg), _link(op=4.0)
        t0 = time.monotonic()
        link.retire(pg)
        del pg
        assert time.monotonic() - t0 < 0.5, "retire blocked"
        gap, t1 = 0.0, time.monotonic()
        last = t1
        while ref() is not None and last - t1 < 20.0:   # this thread runs Python while the destructor waits
            time.sleep(0.01)
            now = time.monotonic()
            gap, last = max(gap, now - last), now
        gone = last - t1
        assert ref() is None, f"the group was still alive {gone:.1f} s after it was retired"
        assert gap < 1.0, f"this thread stood still for {gap:.1f} s while the group was destroyed"
        t2 = time.monotonic()
        with pytest.raises(RuntimeError):
            work.wait()                          # the stuck operation fails, by the destruction or its timeout
        assert time.monotonic() - t2 < 6.0
        del link
    finally:
        peer.communicate("", timeout=30)


class _Group:
    """A stand-in for a process group: something the reaper holds the last reference to, or not."""


def _settle(reaper: lifetime.Reaper, limit: float = 5.0) -> None:
    """Wait (up to ``limit`` s) until ``reaper`` has let go of every group handed to it."""
    t0 = time.monotonic()
    while reaper.pending() and time.monotonic() - t0 < limit:
        time.sleep(0.02)


def test_drain_waits_for_the_groups_handed_over() -> None:
    reaper = lifetime.Reaper(grace=0.3)
    g = _Group()
    ref = weakref.ref(g)
    reaper.take(g, limit=1.0)
    del g
    assert reaper.pending() == 1
    reaper.drain()
    assert reaper.pending() == 0 and ref() is None and reaper.destroyed == 1


def _loop_threads() -> int:
    """Gloo's device loop threads of this process (one per live group's device)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except FileNotFoundError:
            pass
    return n


class _Failures:
    """The step's failures, without a coordinator to raise an abort flag at."""

    error: BaseException | None = None
    aborted = False

    def record(self, err: BaseException) -> None:
        self.error = self.error or err


@pytest.mark.timeout(60)
def test_a_failed_collectives_handle_does_not_keep_its_retired_groups_connections() -> None:
    before = _loop_threads()
    pg, peer = _pair(op_timeout=10.0)
    link = Link(client=None, timeouts=Timeouts(op=10.0), factory=lambda spec: None,  # type: ignore[arg-type]
                failures=_Failures(), step=lambda: 0)  # type: ignore[arg-type]
    assert _loop_threads() > before
    peer.kill()
    peer.wait(timeout=30)
    handle = _ElasticHandle(link, pg.allreduce([torch.ones(4)]), None, Meter(), "t", 10.0, None)
    handle.wait()
    assert link.failures.error is not None, "the allreduce with a dead peer did not fail"
    link.retire(pg)
    del pg
    t0 = time.monotonic()      # the handle lives on, as a strategy's last one does until its next round
    while _loop_threads() > before and time.monotonic() - t0 < 10.0:
        time.sleep(0.05)
    assert _loop_threads() == before, ("the failed group's loop thread outlived it (its connections held by the "
                                       "handle's work, or by a cycle through the failed wait's error)")
    del handle


@pytest.mark.timeout(90)
def test_a_destructor_waiting_for_a_stuck_operation_does_not_hold_up_the_next_group() -> None:
    stuck, peer_a = _pair(op_timeout=6.0)
    idle, peer_b = _pair(op_timeout=6.0)
    try:
        work = stuck.allreduce([torch.ones(4)])     # its peer never joins: the destructor waits up to 6 s
        ref, link = weakref.ref(idle), _link(op=6.0)
        link.retire(stuck)
        link.retire(idle)
        del stuck, idle
        took = _gone_within(ref, 10.0)
        assert took is not None and took <= lifetime.REAPER.grace + 2.0, \
            f"the group retired second went after {took} s: it waited for the stuck one's destructor"
        with pytest.raises(RuntimeError):
            work.wait()
        del link
    finally:
        peer_a.communicate("", timeout=30)
        peer_b.communicate("", timeout=30)


def test_a_group_still_held_elsewhere_is_waited_for_then_let_go_of_and_not_counted() -> None:
    reaper = lifetime.Reaper(grace=0.1)
    kept = _Group()
    reaper.take(kept, limit=0.5)              # the caller keeps its reference past the grace and the limit
    _settle(reaper)
    assert reaper.pending() == 0 and reaper.destroyed == 0, "a group held elsewhere was counted as destroyed"

    late = _Group()
    ref = weakref.ref(late)
    reaper.take(late, limit=5.0)
    time.sleep(0.4)                           # past the grace: the reaper waits for this reference to go
    assert ref() is not None and reaper.pending() == 1
    del late
    _settle(reaper)
    assert ref() is None and reaper.destroyed == 1
