"""The background heal's step pace (shoal.membership.pace): slots opened by commits, sized by the step,
the sources and the joiners; made-up times only (no wall clock decides anything here)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_stateserve import RUN, TOKEN, _serve, _tree

from shoal.comm.objects import from_bytes
from shoal.errors import ConfigError
from shoal.membership.pace import StepPace, heal_pace, parse_pace
from shoal.membership.stateserve import Download, Source


def test_no_slot_before_the_first_commit_then_a_share_of_the_step_measured_from_the_admission() -> None:
    pace = StepPace(0.2)
    pace.admitted(now=100.0)
    assert pace.slot_left(100.0) == 0.0 and pace.slot_left(105.0) == 0.0   # the admission step: no download
    assert pace.committed(now=110.0) == pytest.approx(2.0)   # 0.2 x the 10 s step
    assert pace.slot_left(110.0) == pytest.approx(2.0) and pace.slot_left(111.5) == pytest.approx(0.5)
    assert pace.slot_left(112.0) == 0.0 and pace.slot_left(119.0) == 0.0   # closed until the next commit
    assert pace.slots == 1


def test_the_step_is_the_median_of_the_recent_commit_intervals() -> None:
    pace = StepPace(0.5)
    pace.admitted(now=0.0)
    for t in (10.0, 20.0, 50.0):   # intervals 10, 10, 30: one slow step (a kill's re-run) does not set the pace
        slot = pace.committed(now=t)
    assert pace.step() == 10.0 and slot == pytest.approx(5.0)
    for t in (52.0, 54.0, 56.0, 58.0):   # the window keeps the last 5 intervals: 30, 2, 2, 2, 2
        slot = pace.committed(now=t)
    assert pace.step() == 2.0 and slot == pytest.approx(1.0)


def test_a_commit_without_an_admission_time_opens_no_slot_until_a_step_is_measured() -> None:
    pace = StepPace(0.5)
    assert pace.committed(now=5.0) == 0.0 and pace.slot_left(5.0) == 0.0
    assert pace.committed(now=9.0) == pytest.approx(2.0)


def test_every_joiner_s_slot_opens_at_the_same_commit_and_lasts_the_same_whoever_shares_the_sources() -> None:
    # Time slots, not byte budgets: j joiners of one source download in the same slot and share its upload,
    # so the source sends for one slot a step whatever j is; no count of sources or joiners enters.
    paces = [StepPace(0.2) for _ in range(3)]
    for p in paces:
        p.admitted(now=0.0)
    assert [p.committed(now=10.0) for p in paces] == [pytest.approx(2.0)] * 3
    assert [p.slot_left(11.0) for p in paces] == [pytest.approx(1.0)] * 3


def test_release_lifts_the_pace_for_good() -> None:
    pace = StepPace(0.2)
    pace.admitted(now=0.0)
    assert pace.slot_left(3.0) == 0.0
    pace.release()
    assert pace.slot_left(3.0) == float("inf") and pace.wait(timeout=0.0)


def test_wait_blocks_until_a_commit_opens_a_slot() -> None:
    now = [0.0]
    pace = StepPace(0.5, clock=lambda: now[0])   # the pace's own clock: made up too
    pace.admitted(now=0.0)
    assert pace.wait(timeout=0.0) is False        # no slot yet: a download thread would block here
    passed = threading.Event()

    def downloader() -> None:
        if pace.wait():
            passed.set()

    t = threading.Thread(target=downloader, daemon=True)
    t.start()
    assert not passed.wait(0.05)                  # still blocked: nothing committed
    pace.committed(now=4.0)   # a 2 s slot from 4.0; the clock reads 0.0 < 6.0: open
    assert passed.wait(5.0)
    t.join(5.0)
    now[0] = 6.5                                  # past the slot's end
    assert pace.wait(timeout=0.0) is False


def test_the_pace_is_read_from_the_environment_and_a_bad_one_says_what_is_wrong(monkeypatch: Any) -> None:
    monkeypatch.delenv("SHOAL_HEAL_PACE", raising=False)
    assert heal_pace() is None
    monkeypatch.setenv("SHOAL_HEAL_PACE", "0.25")
    assert heal_pace() == 0.25
    assert parse_pace("off") is None and parse_pace(" 1 ") == 1.0
    for bad in ("0", "1.5", "-0.1", "fast", "nan"):
        with pytest.raises(ConfigError, match="SHOAL_HEAL_PACE must be a fraction of a step in"):
            parse_pace(bad)
    with pytest.raises(ConfigError, match="a heal pace is a fraction of a step"):
        StepPace(0.0)


class _Paced:
    """Two sources on loopback serving one state, and a download of it paced on a made-up clock (``now[0]``)."""

    def __init__(self, chunk: int | None = None) -> None:
        self.tree = _tree()
        (self.a, self.sa), (self.b, self.sb) = _serve(self.tree), _serve(self.tree)
        sources = [Source(1, self.sa.address, self.sa.size, self.sa.sha),
                   Source(2, self.sb.address, self.sb.size, self.sb.sha)]
        self.now = [0.0]
        self.pace = StepPace(0.5, clock=lambda: self.now[0])
        self.pace.admitted(now=0.0)
        self.dl = Download(3, sources, TOKEN, RUN, member=9, chunk=chunk or (self.sa.size + 1) // 2)
        self.dl.pace = self.pace

    def close(self) -> None:
        self.a.close(), self.b.close()


@pytest.mark.timeout(60)
def test_a_paced_striped_download_asks_nothing_between_slots_and_each_source_sends_its_share() -> None:
    # Two sources on loopback, a pace on a made-up clock: chunks are asked for only inside a slot; once the
    # clock passes the slot's end, at most one request per source (already past its wait) is still asked.
    run = _Paced(chunk=512)
    tree, sa, now, pace, dl = run.tree, run.sa, run.now, run.pace, run.dl
    asked: list[tuple[int, int]] = []   # (slot, source) per request
    both = threading.Barrier(2, timeout=10)

    def before_chunk(source: int, received: int) -> None:
        asked.append((pace.slots, source))
        if len(asked) <= 2:
            both.wait()            # both sources ask their first range in the first slot (striped)
        if len(asked) == 6:
            now[0] = 100.0         # the first slot ends (the slot runs to 10 + 0.5 x 10 = 15)

    dl.before_chunk = before_chunk
    dl.start()
    assert not dl.is_alive() or dl.received == 0          # nothing before the first commit
    pace.committed(now=10.0)      # slot 1: 5 s of a 10 s step, the clock reads 0.0
    deadline = threading.Event()
    while len(asked) < 6 and not deadline.wait(0.01):
        pass
    deadline.wait(0.3)                                   # let any request that was past its wait through
    in_first = [s for s in asked if s[0] == 1]
    assert 6 <= len(in_first) <= 6 + 2 and dl.is_alive() and dl.received < sa.size
    pace.committed(now=100.0)     # slot 2: from 100 to 105; the clock reads 100.0
    dl.join(30)
    assert dl.error is None and dl.blob is not None and dl.received == sa.size
    assert all(slot in (1, 2) for slot, _ in asked) and {src for _, src in asked} == {1, 2}
    assert dl.by_source[1] > 0 and dl.by_source[2] > 0 and sum(dl.by_source.values()) == sa.size
    got = from_bytes(torch.frombuffer(bytearray(dl.blob), dtype=torch.uint8))
    assert torch.equal(got["model"]["w"], tree["model"]["w"])
    run.close()


@pytest.mark.timeout(60)
def test_a_source_waiting_for_a_slot_stops_once_the_others_fetched_the_last_range() -> None:
    # Two ranges: the second is asked for in the slot, which then closes; the other source, done with the first
    # range and waiting for a slot, must not hold the download until the next commit (there may be none).
    run = _Paced()     # two ranges
    sa, now, pace, dl = run.sa, run.now, run.pace, run.dl
    calls = []

    def before_chunk(source: int, received: int) -> None:
        calls.append(source)
        if len(calls) == 2:        # the last range: close the slot, let the first range's source reach its wait
            now[0] = 100.0
            while dl.received == 0:
                threading.Event().wait(0.01)
            threading.Event().wait(0.2)

    dl.before_chunk = before_chunk
    pace.committed(now=10.0)      # one slot, from 10 to 15 (the clock reads 0.0)
    dl.start()
    dl.join(20)
    assert not dl.is_alive() and dl.error is None and dl.received == sa.size and pace.slots == 1
    run.close()


@pytest.mark.timeout(60)
def test_a_stopped_download_asks_for_no_range_after_the_stop_and_ends_without_a_blob() -> None:
    # Stopped inside a slot, with both sources about to ask for a range (parked in before_chunk): neither
    # range goes out, the threads end although the slot is still open, and nothing counts as downloaded.
    run = _Paced(chunk=512)
    dl, pace = run.dl, run.pace
    parked, release = threading.Barrier(3, timeout=10), threading.Event()

    def before_chunk(source: int, received: int) -> None:
        if received == 0 and len(parked_at) < 2:
            parked_at.append(source)
            parked.wait()
            release.wait(10)

    parked_at: list[int] = []
    dl.before_chunk = before_chunk
    pace.committed(now=10.0)      # a slot from 10 to 15; the clock reads 0.0: open until stopped
    dl.start()
    parked.wait()                 # both sources hold a range, about to ask for it
    dl.stop()
    release.set()
    dl.join(10)
    assert not dl.is_alive() and dl.blob is None and dl.error is not None and "stopped" in dl.error
    assert dl.received == 0 and run.a.served + run.b.served == 0 and dl.failed == {}
    run.close()


def test_a_commit_after_which_a_new_quorum_forms_is_measured_but_opens_no_slot() -> None:
    # Another joiner's admission (a new quorum) follows this commit: its gloo connect and its step get
    # the link to themselves; the step is still measured, and the next commit opens a slot again.
    pace = StepPace(0.2)
    pace.admitted(now=0.0)
    assert pace.committed(now=10.0) == pytest.approx(2.0) and pace.slots == 1
    assert pace.committed(now=20.0, open_slot=False) == 0.0
    assert pace.slot_left(20.0) == 0.0 and pace.slots == 1
    assert pace.committed(now=35.0) == pytest.approx(2.0)   # the median of 10, 10, 15: 10 s
    assert pace.slots == 2
    assert pace.committed(now=36.0, open_slot=False) == 0.0   # a quick commit while the slot is still open:
    assert pace.slot_left(36.0) == 0.0                        # that slot closes there


@pytest.mark.timeout(60)
def test_the_commit_hooks_see_the_quorum_that_the_next_step_adopts() -> None:
    # The paced heal decides at each commit (an on_commit hook) whether to open a slot: it must already
    # see quorum_pending when the verdict names a newer quorum.
    import time

    from shoal.elastic import Coordinator, Timeouts
    from shoal.membership.elastic import ElasticGroup

    token = "pending-hook-token"
    coord = Coordinator(port=0, initial_workers=1, token=token).start()
    group = ElasticGroup("pending", coordinator=coord.address, min_workers=1, token=token, host_id="h0",
                         timeouts=Timeouts(op=5.0, quorum=10.0, join=20.0))
    seen: list[bool] = []
    group.on_commit(lambda: seen.append(group.quorum_pending))
    try:
        group.begin_step()
        assert group.commit() and seen == [False]
        group.begin_step()
        q = group.quorum
        assert q is not None
        group.client.request_quorum(q.qid)    # the coordinator publishes the next quorum during the step
        deadline = time.monotonic() + 20
        while group.client.latest() <= q.qid and time.monotonic() < deadline:
            time.sleep(0.02)
        assert group.client.latest() > q.qid
        assert group.commit() and seen == [False, True]
    finally:
        group.leave()
        coord.stop()
