"""A joiner's download begun before its admission (CatchUp.prefetch) is kept only if it is of the admitted state.

Sources of an averaging strategy offer their snapshot from their inner steps, to the newcomers of a
quorum they have not adopted yet (CatchUp.offer_early): what they hold at the begin of the step they
are at. A step that commits before the admission (the old quorum ran one more round) makes that
offer stale; the sources then offer again under the same heal id, naming the new step. A joiner's
early download takes whichever step its sources offer; its admission names the step, and keeps the
download only if it is (or, still choosing its sources, will be) of that step's state. One joiner's
CatchUp over a stand-in group (test_heal_abandon's); real snapshot servers on loopback."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_heal_abandon import HID, ME, _Group, _Store
from test_stateserve import RUN, _serve, _tree

from shoal.comm.objects import from_bytes
from shoal.membership.catchup import CatchUp
from shoal.membership.coordinator import Quorum
from shoal.membership.records import RecordBook


class _Outer:
    after_commit = True           # an averaging strategy (DiLoCo): downloads in its inner steps
    enters_between_rounds = True  # without overlapped reductions


def _publish(raw: Any, tree: Any, step: int, members: tuple[int, ...] = (1, 2)) -> list[Any]:
    servers = []
    for m in members:
        server, src = _serve(tree, hid=HID, joiners=frozenset({ME}))
        raw.set(f"{RUN}/heal/{HID}/src/{m}", RecordBook(raw, RUN, m, None).seal(
            {"addr": src.address, "size": src.size, "sha": src.sha, "step": step}))
        servers.append(server)
    return servers


def _joiner(raw: Any) -> CatchUp:
    group = _Group(_Store(raw))
    group._fresh, group._in_step, group.step = True, False, 0   # holds nothing yet, waits for its first quorum
    c = CatchUp(group)
    c.enabled = True
    c.replayers.append(_Outer())   # type: ignore[arg-type]
    return c


def _other(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g)}, "cursor": {"cursor": 48}}


@pytest.mark.timeout(60)
def test_an_early_download_of_the_admitted_steps_state_is_kept() -> None:
    raw = dist.HashStore()
    servers = _publish(raw, _tree(), step=5)
    c = _joiner(raw)
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    early = c.early
    assert early is not None and early.done.wait(30) and early.result[1] is None   # before any admission
    c._admit(HID, [1, 2], top=5)
    assert c.fetch is early and c.early is None and c.stats.prefetched_bytes == early.received > 0
    got = from_bytes(torch.frombuffer(bytearray(early.result[0]), dtype=torch.uint8))
    assert torch.equal(got["model"]["w"], _tree()["model"]["w"])
    for s in servers:
        s.close()


@pytest.mark.timeout(60)
def test_an_early_download_of_an_earlier_steps_state_is_dropped_and_the_admitted_one_fetched() -> None:
    raw = dist.HashStore()
    stale = _publish(raw, _other(1), step=4)   # offered before a round that then committed in the old quorum
    c = _joiner(raw)
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    early = c.early
    assert early is not None and early.done.wait(30) and early.step == 4
    fresh = _publish(raw, _tree(), step=5)     # at the admission the sources offer again: step 5's begin
    c._admit(HID, [1, 2], top=5)
    c.group.step = 6   # the admitting round committed: an averaging strategy's download starts now
    assert c.fetch is not early and c.stats.prefetched_bytes == 0
    assert c.fetch is not None and c.fetch.done.wait(30) and c.fetch.result[1] is None and c.fetch.step == 5
    got = from_bytes(torch.frombuffer(bytearray(c.fetch.result[0]), dtype=torch.uint8))
    assert torch.equal(got["model"]["w"], _tree()["model"]["w"])
    for s in stale + fresh:
        s.close()


@pytest.mark.timeout(60)
def test_an_early_download_still_choosing_its_sources_takes_only_the_admitted_steps() -> None:
    raw = dist.HashStore()
    servers = _publish(raw, _other(1), step=4, members=(1,))   # one stale offer; the other source none yet
    c = _joiner(raw)
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    early = c.early
    assert early is not None
    time.sleep(0.3)   # waiting for its second source (all of them, or 2 s after the first)
    c._admit(HID, [1, 2], top=5)   # admitted at step 5 before it chose: it keeps going, for step 5 only
    assert c.fetch is early
    servers += _publish(raw, _tree(), step=5)   # both sources (re-)offer step 5's begin
    assert early.done.wait(30) and early.result[1] is None and early.step == 5
    got = from_bytes(torch.frombuffer(bytearray(early.result[0]), dtype=torch.uint8))
    assert torch.equal(got["model"]["w"], _tree()["model"]["w"])
    for s in servers:
        s.close()


@pytest.mark.timeout(60)
def test_an_early_download_is_stopped_when_the_quorum_heals_blocking_or_another_forms() -> None:
    raw = dist.HashStore()
    c = _joiner(raw)
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))   # nobody offers: it waits for its sources
    first = c.early
    c.prefetch(Quorum(HID + 1, (1, 2, ME), "run/q4/"))   # superseded before its barrier
    assert first is not None and first.done.is_set() and "given up" in str(first.result[1])
    second = c.early
    assert second is not None and second.hid == HID + 1
    c.group._fresh = False
    c.prefetch(Quorum(HID + 2, (1, 2, ME), "run/q5/"))   # holds the state now (healed blocking): nothing to fetch
    assert c.early is None and second.done.is_set() and "given up" in str(second.result[1])


def _fetched(raw: Any, member: int = ME) -> bool:
    return raw.check([f"{RUN}/heal/{HID}/fetched/{member}"])


@pytest.mark.timeout(60)
def test_only_the_download_the_admission_keeps_tells_the_sources_it_is_done() -> None:
    # A source's leave() waits until its joiners said they are done with its snapshot; an early download the
    # admission drops must not say so for the one the joiner then fetches under the same heal id.
    raw = dist.HashStore()
    stale = _publish(raw, _other(1), step=4)
    c = _joiner(raw)
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    assert c.early is not None and c.early.done.wait(30) and not _fetched(raw)   # ended, not kept yet
    fresh = _publish(raw, _tree(), step=5)
    c._admit(HID, [1, 2], top=5)   # dropped: another step's
    assert not _fetched(raw)
    c.group.step = 6
    assert c.fetch is not None and c.fetch.done.wait(30) and _fetched(raw)
    raw2 = dist.HashStore()
    kept = _publish(raw2, _tree(), step=5)
    c2 = _joiner(raw2)
    c2.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    assert c2.early is not None and c2.early.done.wait(30) and not _fetched(raw2)
    c2._admit(HID, [1, 2], top=5)   # kept: its word is said now
    assert _fetched(raw2)
    for s in stale + fresh + kept:
        s.close()


def _offered(server: Any, hid: int, tree: Any, step: int) -> None:
    import threading
    ready = threading.Event()
    server.offer(hid, tree, {ME}, lambda size, sha, digests: ready.set(), step)
    assert ready.wait(30)


@pytest.mark.timeout(60)
def test_a_source_serves_the_admitted_step_once_and_a_late_word_about_a_replaced_snapshot_is_ignored() -> None:
    from shoal.membership.stateserve import SnapshotServer
    from test_stateserve import TOKEN
    server = SnapshotServer(TOKEN, RUN, "127.0.0.1")
    _offered(server, HID, _tree(), step=5)            # offered early, at step 5's begin
    assert server.admit(HID, {ME, 11}, step=5) == set()   # admitted at step 5: served as it is, to both
    assert sorted(server.owed()) == [(HID, ME), (HID, 11)]
    server._done(HID, ME, 5)
    server._done(HID, 11, 5)                            # both fetched it: dropped ...
    assert server.holding() == []
    assert server.admit(HID, {ME, 11}, step=5) == set()   # ... and not offered again (nothing would fetch it)
    assert server.admit(HID, {ME, 12}, step=5) == {12}     # only to a joiner that has not fetched it
    assert server.admit(HID, {ME}, step=6) == {ME}         # a step committed since: it must be offered again
    _offered(server, HID, _other(1), step=6)
    server._done(HID, ME, 5)                            # a late word about the replaced snapshot
    assert server.holding() == [HID] and server.owed() == [(HID, ME)]
    server.close()


class _FailsLate:
    """Pickles only once ``gate`` is set, and then fails (an earlier offer still serialising, then failing)."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def __reduce__(self) -> Any:
        self.gate.wait(10)
        raise RuntimeError("cannot serialise this")


@pytest.mark.timeout(60)
def test_an_earlier_offers_failure_or_late_end_never_touches_the_offer_that_replaced_it() -> None:
    import threading

    from shoal.membership.stateserve import SnapshotServer
    from test_stateserve import TOKEN
    server = SnapshotServer(TOKEN, RUN, "127.0.0.1")
    gate, records = threading.Event(), []
    server.offer(HID, {"x": _FailsLate(gate)}, {ME}, lambda size, sha, digests: records.append(("early", sha)), 4)
    _offered(server, HID, _tree(), step=5)   # offered again (a step committed since): serialised, published
    gate.set()                                # the earlier one fails now: it must not drop the new one
    time.sleep(0.3)
    assert server.holding() == [HID] and server._snaps[HID].step == 5 and records == []
    server.close()


@pytest.mark.timeout(60)
def test_an_early_download_kept_at_its_admission_waits_for_its_sources_a_full_while_from_there() -> None:
    # It may have waited at the quorum's barrier for most of Timeouts.join: kept at the admission, it waits for
    # the sources' records (offered then) a full Timeouts.join again, instead of failing at once.
    raw = dist.HashStore()
    c = _joiner(raw)
    c.group.timeouts = type(c.group.timeouts)(heartbeat_interval=0.05, probe=0.1, heartbeat_timeout=0.5, op=1.0,
                                              quorum=1.2, join=1.5)
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    early = c.early
    time.sleep(1.0)   # nobody offers early (a join with no loss): it waits
    c._admit(HID, [1, 2], top=5)
    assert c.fetch is early
    time.sleep(0.8)   # past the first wait's end
    servers = _publish(raw, _tree(), step=5)   # the sources' offer at the admission
    assert early.done.wait(30) and early.result[1] is None and early.step == 5, early.result
    for s in servers:
        s.close()


@pytest.mark.timeout(60)
def test_an_early_download_asks_for_nothing_once_the_joiner_is_past_its_quorums_barrier() -> None:
    # From the barrier to the step's begin the quorum builds its group, plans the heal and broadcasts the
    # admission: small messages that would queue behind the download's bytes on the joiner's link.
    raw = dist.HashStore()
    servers = _publish(raw, _tree(), step=5)
    c = _joiner(raw)
    asked: list[int] = []
    c.before_chunk = lambda source, received: asked.append(source)
    c.group._entering = True   # past the barrier (set by ElasticGroup._enter), not in the step yet
    c.prefetch(Quorum(HID, (1, 2, ME), "run/q3/"))
    early = c.early
    time.sleep(0.5)
    assert early is not None and asked == [] and not early.done.is_set()
    c.group._entering = False
    assert early.done.wait(30) and early.result[1] is None and asked
    for s in servers:
        s.close()


@pytest.mark.parametrize("survivors_wait, checked, trained, due", [
    (True, False, 0, True),     # they wait at their round's barrier: enter
    (False, True, 3, False),    # 3 of 4 inner steps trained: on
    (False, True, 4, True),     # a whole period from a checked state: to the barrier, whatever keeps them
    (False, False, 9, False),   # its host's copy not checked yet (it may be stale): on, as before
])
def test_a_restart_training_before_its_admission_stops_at_a_whole_period(survivors_wait: bool, checked: bool,
                                                                         trained: int, due: bool) -> None:
    """A straggler among the survivors used to let it train on (55 inner steps against their 32 on the chaos
    bench): its drift, weighted 1 like theirs, outgrew theirs. Once it has trained a period from a state its
    download checked (its resumed steps included), it waits at the barrier with them."""
    from types import SimpleNamespace

    from shoal.strategies.diloco_heal import admission_due

    # (longest: the longest-going fragment's span, a kept fragment's steps included: CatchUp.longest)
    catchup = SimpleNamespace(admission_due=lambda: survivors_wait, pre=SimpleNamespace(from_seed=not checked),
                              longest=lambda: trained)
    strategy = SimpleNamespace(group=SimpleNamespace(catchup=catchup), config=SimpleNamespace(inner_steps=4))
    assert admission_due(strategy) == due
