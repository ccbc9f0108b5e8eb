"""Liveness links: a member whose process dies is left out of the next quorum without the probe window.

The probe window here is 4 s and heartbeat_timeout 20 s: a quorum without the dead member inside
2 s can only come from its link ending (the probe alone would take >= 4 s, which the control case
shows)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from typing import Iterator

import pytest

from shoal.errors import ConfigError
from shoal.membership import auth
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Coordinator, Quorum, Timeouts
from shoal.membership.liveness import LivenessLink, LivenessServer, enabled, port_record, read_port

TOKEN = "liveness-test-token"
_T = Timeouts(op=2.0, heartbeat_interval=0.05, probe=4.0, heartbeat_timeout=20.0, quorum=30.0, join=60.0)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MEMBER = textwrap.dedent("""
    import sys, time
    from shoal.membership.client import MemberClient
    from shoal.membership.coordinator import Timeouts
    hb = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
    t = Timeouts(op=2.0, heartbeat_interval=hb, probe=4.0, heartbeat_timeout=20.0, quorum=30.0, join=60.0)
    c = MemberClient(sys.argv[1], "live", t, min_workers=2, token=sys.argv[2])
    c.join()
    assert c._link is not None and c._link.up.wait(10), "no liveness link"
    print(c.member_id, flush=True)
    time.sleep(600)
""")


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _three(coord: Coordinator, t: Timeouts = _T) -> tuple[MemberClient, MemberClient, subprocess.Popen]:
    a = MemberClient(coord.address, "live", t, min_workers=2, token=TOKEN)
    b = MemberClient(coord.address, "live", t, min_workers=2, token=TOKEN)
    a.join()
    b.join()
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", _MEMBER, coord.address, TOKEN, str(t.heartbeat_interval)],
                         stdout=subprocess.PIPE, text=True, env=env)
    return a, b, p


@pytest.mark.timeout(90)
def test_a_killed_members_link_ends_and_the_next_quorum_is_out_before_the_probe_window() -> None:
    coord = Coordinator(port=0, initial_workers=3, token=TOKEN).start()
    a, b, p = _three(coord)
    try:
        assert p.stdout is not None
        dead = int(p.stdout.readline())
        q1 = a.wait_quorum(after=0, timeout=30)
        assert set(q1.members) == {a.member_id, b.member_id, dead}
        os.kill(p.pid, signal.SIGKILL)     # the kernel closes its sockets: no leave, no hb = -1
        t0 = time.monotonic()
        q2 = a.wait_quorum(after=q1.qid, timeout=30)
        took = time.monotonic() - t0
        assert set(q2.members) == {a.member_id, b.member_id}
        assert took < _T.probe / 2, f"the new quorum took {took:.2f} s: the probe window was waited out"
        assert b.wait_quorum(after=q1.qid, timeout=5) == q2
        assert a.store.check([a.key(f"dropped/{dead}")])
        assert a.store.check([f"{q1.prefix}abort"]), "members blocked in the old quorum's collectives must give up"
    finally:
        p.kill()
        p.wait()
        a.leave()
        b.leave()
        coord.stop()


@contextlib.contextmanager
def _pair(t: Timeouts, min_workers: int, b_env: dict[str, str] | None = None
          ) -> Iterator[tuple[Coordinator, MemberClient, MemberClient, Quorum]]:
    """A coordinator and two joined members a and b (b with ``b_env`` set while it joins), in their first quorum."""
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    a = MemberClient(coord.address, "live", t, min_workers=min_workers, token=TOKEN)
    b = MemberClient(coord.address, "live", t, min_workers=min_workers, token=TOKEN)
    try:
        a.join()
        with pytest.MonkeyPatch.context() as mp:
            for k, v in (b_env or {}).items():
                mp.setenv(k, v)
            b.join()
        yield coord, a, b, a.wait_quorum(after=0, timeout=30)
    finally:
        a.leave()
        b.leave()
        coord.stop()


@pytest.mark.timeout(90)
def test_a_second_member_killed_during_the_probe_leaves_with_the_first() -> None:
    # Two members die apart (two workers of one host): the second's link ends while the probe the first
    # one's started is under way. The second joins that probe and must beat after its link's end to count
    # as alive, so both leave in one quorum (before: it counted as alive from a beat between the probe's
    # start and its death, stayed in the next quorum, and cost a second one).
    # Timed off the beats, every 0.5 s: the first dies right after a beat, so the probe judges it silent
    # about 2 beats (1 s) later; the second dies right after its first beat since that probe began (what
    # the old rule counted as alive), at most a beat later, so its link ends inside the probe with ~0.5 s
    # to spare. With 50 ms beats and a fixed 60 ms gap the spare was a few tens of ms, which a loaded box
    # missed.
    t = replace(_T, heartbeat_interval=0.5)
    coord = Coordinator(port=0, initial_workers=4, token=TOKEN).start()
    a, b, p = _three(coord, t)
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p2 = subprocess.Popen([sys.executable, "-c", _MEMBER, coord.address, TOKEN, str(t.heartbeat_interval)],
                          stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None and p2.stdout is not None
        first, second = int(p.stdout.readline()), int(p2.stdout.readline())
        q1 = a.wait_quorum(after=0, timeout=30)
        assert set(q1.members) == {a.member_id, b.member_id, first, second}
        def kill_after_a_beat(member: int, proc: subprocess.Popen) -> None:
            beats = a.key(f"hb/{member}")
            seen = int(a.store.add(beats, 0))
            assert _wait(lambda: int(a.store.add(beats, 0)) > seen, 5.0), f"member {member} does not beat"
            os.kill(proc.pid, signal.SIGKILL)

        kill_after_a_beat(first, p)
        run = coord._runs["live"]   # the second's beat must come after the probe began (the old rule's case)
        assert _wait(lambda: run.probe_since is not None, 5.0), "the first death started no probe"
        kill_after_a_beat(second, p2)
        q2 = a.wait_quorum(after=q1.qid, timeout=30)
        assert set(q2.members) == {a.member_id, b.member_id}, "the second death cost a quorum of its own"
    finally:
        for proc in (p, p2):
            proc.kill()
            proc.wait()
        a.leave()
        b.leave()
        coord.stop()


@pytest.mark.timeout(90)
def test_without_a_link_the_same_kill_waits_the_probe_window() -> None:
    """The control: b opens no link (SHOAL_LIVENESS=off), so only its heartbeat can tell its death."""
    with _pair(_T, 1, {"SHOAL_LIVENESS": "off"}) as (coord, a, b, q1):
        assert b._link is None
        b._stop.set()
        assert b._hb is not None
        b._hb.join()
        time.sleep(0.2)
        a.request_quorum(q1.qid)                  # a's step failed
        t0 = time.monotonic()
        q2 = a.wait_quorum(after=q1.qid, timeout=30)
        assert set(q2.members) == {a.member_id}
        assert time.monotonic() - t0 >= _T.probe - 0.5


def _nothing_changed(coord: Coordinator, a: MemberClient, b: MemberClient, q1: Quorum) -> None:
    assert coord._runs["live"].probe_since is None
    assert a.latest() == q1.qid, "a live member's broken link made the coordinator publish a new quorum"
    assert not a.store.check([f"{q1.prefix}abort"]), "a live member's broken link aborted its quorum"
    assert not a.store.check([a.key(f"dropped/{b.member_id}")])


@pytest.mark.timeout(60)
def test_a_link_that_breaks_while_its_member_lives_changes_nothing_and_reopens() -> None:
    # Beats every 0.5 s: the ended link counts against b only after two missed beats (1 s), which a
    # heartbeat thread on a loaded test machine still makes.
    t = Timeouts(op=2.0, heartbeat_interval=0.5, probe=4.0, heartbeat_timeout=20.0, quorum=30.0, join=60.0)
    with _pair(t, 2) as (coord, a, b, q1):
        link = b._link
        assert link is not None and link.up.wait(10) and link._sock is not None
        assert coord._live.ended("live") == {}
        link._sock.shutdown(2)                     # a reset on the way, not a death
        # The coordinator probes once (b still beats): no quorum is published, none aborted, b not dropped.
        assert _wait(lambda: not link.up.is_set(), 10)
        assert _wait(lambda: link.up.is_set(), 10)  # and the link reopens
        assert _wait(lambda: coord._runs["live"].probe_since is None, 10)
        time.sleep(3 * t.heartbeat_interval)       # ticks after the probe: it must not start again
        assert coord._live.ended("live") == {}
        assert coord._runs["live"].link_probed.get(b.member_id) == 1, "the link's end started no probe"
        _nothing_changed(coord, a, b, q1)


@pytest.mark.timeout(60)
def test_a_link_that_stays_down_for_a_live_member_costs_one_probe_only() -> None:
    """The server ends b's link while b lives and b cannot reopen it (stopped): one probe, b answers,
    nothing is published, and later ticks do not probe or abort again."""
    t = Timeouts(op=2.0, heartbeat_interval=0.5, probe=4.0, heartbeat_timeout=20.0, quorum=30.0, join=60.0)
    with _pair(t, 2) as (coord, a, b, q1):
        assert b._link is not None and b._link.up.wait(10)
        b._link.stop()                                  # b lives on, without a link
        assert _wait(lambda: b.member_id in coord._live.ended("live"), 10)
        time.sleep(2.0)                                 # four heartbeats, ~100 ticks that see the ended link
        _nothing_changed(coord, a, b, q1)
        assert coord._runs["live"].link_probed == {b.member_id: coord._live.ended("live")[b.member_id]}


@pytest.mark.timeout(30)
def test_a_link_with_the_wrong_token_is_refused_and_not_retried() -> None:
    server = LivenessServer("127.0.0.1", TOKEN).start()
    try:
        link = LivenessLink("127.0.0.1", server.port, "live", 3, "some-other-token", retry=0.05).start()
        assert link._thread is not None
        link._thread.join(10)
        assert not link._thread.is_alive() and not link.up.is_set() and link.refused
        assert server.closed("live") == set() and server._open == {}
        good = LivenessLink("127.0.0.1", server.port, "live", 3, TOKEN).start()
        assert good.up.wait(10)
        good.stop()
        assert _wait(lambda: server.closed("live") == {3}, 5)
        again = LivenessLink("127.0.0.1", server.port, "live", 3, TOKEN).start()   # the same member reopens
        assert again.up.wait(10) and _wait(lambda: server.closed("live") == set(), 5)
        again.stop()
        assert _wait(lambda: server.ended("live").get(3) == 2, 5)                # a new end, a new number
        assert server.closed("other-run") == set()
        server.forget("live", 3)
        assert server.closed("live") == set()
    finally:
        server.stop()


def test_the_published_port_must_be_signed_with_the_token_for_this_coordinator() -> None:
    assert read_port(port_record(4242, TOKEN, "inc1"), TOKEN, "inc1") == 4242
    assert read_port(port_record(4242, None, "inc1"), None, "inc1") == 4242
    assert read_port(port_record(4242, None, "inc1"), TOKEN, "inc1") is None                # unsigned
    assert read_port(port_record(4242, "another-token!", "inc1"), TOKEN, "inc1") is None    # a stranger's
    assert read_port(port_record(4242, TOKEN, "inc0"), TOKEN, "inc1") is None               # an earlier coordinator's
    forged = f"4243 {auth.sign(TOKEN, 'liveness inc1 4242')}"
    assert read_port(forged, TOKEN, "inc1") is None                                         # moved to another port
    for bad in ("", "x", "0", "70000", b"12 34"):
        assert read_port(bad, TOKEN, "inc1") is None


@pytest.mark.timeout(30)
def test_a_stopped_server_accepts_nobody_and_ends_its_links() -> None:
    server = LivenessServer("127.0.0.1", TOKEN).start()
    link = LivenessLink("127.0.0.1", server.port, "live", 5, TOKEN, retry=0.05).start()
    assert link.up.wait(10)
    server.stop()
    assert _wait(lambda: not link.up.is_set(), 10)     # the member sees its link end
    time.sleep(0.3)                                      # and retries against a closed port
    assert not link.up.is_set()
    link.stop()


def test_an_ipv6_coordinator_listens_for_links() -> None:
    try:
        server = LivenessServer("::1", TOKEN).start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    link = LivenessLink("[::1]", server.port, "live", 9, TOKEN).start()
    try:
        assert link.up.wait(10)
    finally:
        link.stop()
        server.stop()


def test_bad_ports_and_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="liveness_port"):
        Coordinator(port=0, liveness_port=-1)
    with pytest.raises(ConfigError, match="port must be"):
        Coordinator(port=70000)
    monkeypatch.setenv("SHOAL_LIVENESS", "maybe")
    with pytest.raises(ConfigError, match="SHOAL_LIVENESS"):
        enabled()
    monkeypatch.setenv("SHOAL_LIVENESS", "off")
    assert not enabled()
    coord = Coordinator(port=0, token=TOKEN).start()
    c = MemberClient(coord.address, "live", _T, token=TOKEN)
    try:
        c.join()
        assert c._link is None       # judged by its heartbeat alone
    finally:
        c.leave()
        coord.stop()
