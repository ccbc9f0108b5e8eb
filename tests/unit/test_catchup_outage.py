"""The background heal's "ready" records are read from the coordinator's store at each commit and each
step's begin: a coordinator that does not answer (a blip, an outage) must not crash the step, nor let
this member guess who contributes (a joiner counted in by its peers and out here would make every mean
of the step wrong). A blip is read again; an outage fails the step (every member then discards it).

One member's CatchUp over a small stand-in group; the store is torch's HashStore behind a wrapper whose
calls fail while ``blip`` is set (as the coordinator's TCPStore does when it is unreachable)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

from shoal.errors import CommTimeoutError
from shoal.membership.catchup import CatchUp, Pending
from shoal.membership.coordinator import Timeouts
from shoal.membership.records import RecordBook

RUN, ME, JOINER, HID, STEP = "run", 1, 3, 5, 8


class _Flaky:
    def __init__(self, store: Any) -> None:
        self._store, self.blip, self.calls = store, threading.Event(), 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            if self.blip.is_set():
                raise RuntimeError("Connection reset by peer (the coordinator's store)")
            return fn(*args)
        return call


class _Client:
    address = "127.0.0.1:29999"

    def __init__(self, store: _Flaky) -> None:
        self.store, self.member_id, self.down = store, ME, threading.Event()
        self.book = RecordBook(store, RUN, ME, None)

    def key(self, k: str) -> str:
        return f"{RUN}/{k}"


class _Quorum:
    members = (2, ME, JOINER)    # ranks 0, 1, 2: this member is no top-up writer (rank 0 is)

    def rank_of(self, m: int) -> int:
        return self.members.index(m)


class _Group:
    timeouts = Timeouts(heartbeat_interval=0.05, probe=0.1, heartbeat_timeout=0.5, op=1.0, quorum=2.0, join=4.0)

    def __init__(self, store: _Flaky) -> None:
        self.client, self.quorum, self.rank, self.size, self.step = _Client(store), _Quorum(), 1, 3, STEP
        self.newcomers: tuple[int, ...] = ()
        self.errors: list[BaseException] = []
        self.commit_hooks: list[Any] = []

    def on_commit(self, fn: Any) -> None:
        self.commit_hooks.append(fn)

    def _record(self, err: BaseException) -> None:
        self.errors.append(err)


def _setup() -> tuple[_Group, _Flaky, CatchUp]:
    raw = dist.HashStore()
    # The joiner caught up at step STEP - 1 and contributes from STEP: its signed record, written before its vote.
    raw.set(f"{RUN}/heal/{HID}/ready/{JOINER}", RecordBook(raw, RUN, JOINER, None).seal({"from": STEP, "keys": []}))
    store = _Flaky(raw)
    group = _Group(store)
    catchup = CatchUp(group)
    catchup.pending = {JOINER: Pending(HID)}
    return group, store, catchup


def test_a_blip_at_the_commit_is_read_again_at_the_next_begin() -> None:
    group, store, catchup = _setup()
    store.blip.set()
    for fn in group.commit_hooks:      # the vote committed; the store does not answer the read after it
        fn()
    assert catchup.pending[JOINER].ready is None
    store.blip.clear()
    catchup.at_begin()
    assert catchup.pending[JOINER].ready == STEP
    assert group.errors == [] and group.newcomers == ()      # the joiner contributes, as on its peers
    assert catchup.contribution() == (True, 3)


def test_a_blip_at_the_begin_is_tried_again_until_the_store_answers() -> None:
    group, store, catchup = _setup()
    store.blip.set()
    threading.Timer(0.1, store.blip.clear).start()
    catchup.at_begin()
    assert store.calls > 1
    assert catchup.pending[JOINER].ready == STEP
    assert group.errors == [] and group.newcomers == ()


def test_an_outage_fails_the_step_instead_of_guessing_who_contributes() -> None:
    group, store, catchup = _setup()
    store.blip.set()
    group.client.down.set()            # the heartbeat thread declared the outage: no waiting
    t0 = time.monotonic()
    catchup.at_begin()
    assert time.monotonic() - t0 < group.timeouts.heartbeat_timeout
    assert len(group.errors) == 1 and isinstance(group.errors[0], CommTimeoutError)
    assert "did not answer" in str(group.errors[0])


def test_a_store_that_stays_silent_fails_the_step_after_heartbeat_timeout() -> None:
    group, store, catchup = _setup()
    store.blip.set()                   # no outage declared (yet): tried again for heartbeat_timeout
    t0 = time.monotonic()
    catchup.at_begin()
    assert time.monotonic() - t0 >= group.timeouts.heartbeat_timeout
    assert len(group.errors) == 1 and isinstance(group.errors[0], CommTimeoutError)
    assert catchup.pending[JOINER].ready is None


class _Link:
    class failures:   # noqa: N801 - a stand-in for the link's failure record
        aborted = False


class _Writer(_Group):
    """The lowest-ranked holder of the state: it writes the top-ups (rank 0 of members (ME, 2, JOINER))."""

    def __init__(self, store: _Flaky) -> None:
        super().__init__(store)
        self.quorum.members = (ME, 2, JOINER)
        self.rank, self.link = 0, _Link()

        class _Hooks:
            states: dict[str, Any] = {}
        self.hooks = _Hooks()


def _writer() -> tuple[_Writer, _Flaky, CatchUp]:
    store = _Flaky(dist.HashStore())
    group = _Writer(store)
    catchup = CatchUp(group)
    catchup.pending = {JOINER: Pending(HID, ready=STEP, read=True, full_at=STEP)}   # weighs 1 from this step
    return group, store, catchup


def test_a_top_up_the_coordinator_does_not_take_fails_the_step_instead_of_the_worker() -> None:
    group, store, catchup = _writer()
    store.blip.set()
    group.client.down.set()
    catchup._write_topups(STEP)        # raised out of begin_step before: the worker died on a coordinator outage
    assert len(group.errors) == 1 and isinstance(group.errors[0], CommTimeoutError), group.errors
    assert "did not take the top-up" in str(group.errors[0])
    group.errors.clear()
    store.blip.clear()
    group.client.down.clear()
    catchup._write_topups(STEP)        # the coordinator is back: written, nothing fails
    assert group.errors == [] and store._store.check([f"{RUN}/heal/{HID}/top/{JOINER}/{STEP}"])


def test_a_joiner_whose_top_up_cannot_be_read_fails_the_step_at_once_in_an_outage() -> None:
    group, store, catchup = _writer()
    catchup.hid = HID
    store.blip.set()
    group.client.down.set()
    t0 = time.monotonic()
    catchup._top_up(Pending(HID, keys=()), STEP)   # raised before; an outage is not waited out (Timeouts.quorum)
    assert time.monotonic() - t0 < group.timeouts.quorum
    assert len(group.errors) == 1 and "could not be read" in str(group.errors[0]), group.errors


class _Done:
    """A finished download (what CatchUp reads of a Fetch)."""
    download, result = None, (b"state", None)


class _Own:
    def own(self, states: Any) -> set[str]:
        return set()

    def covers(self, states: Any) -> set[str]:
        return set()


def test_a_ready_record_the_coordinator_does_not_take_leaves_the_joiner_as_it_was_to_try_again() -> None:
    group, store, catchup = _writer()
    catchup.replayers.append(_Own())   # type: ignore[arg-type]
    catchup.hid, catchup.fetch = HID, _Done()   # type: ignore[assignment]
    catchup.stats.admitted_step = STEP
    mine = Pending(HID)
    store.blip.set()
    group.client.down.set()
    catchup._catch_up(mine, STEP, catchup.fetch, in_step=False)   # between two rounds: tried at the next step
    assert group.errors == [] and not catchup.loaded and catchup.fetch is not None and mine.ready is None
    catchup._catch_up(mine, STEP, catchup.fetch, in_step=True)    # at a step's begin: that step fails
    assert len(group.errors) == 1 and "ready record" in str(group.errors[0]), group.errors
    assert not catchup.loaded and catchup.fetch is not None and mine.ready is None


class _Owed:
    """A snapshot server whose joiners have not said they are done."""

    def __init__(self, owed: list[tuple[int, int]]) -> None:
        self._owed = owed

    def owed(self) -> list[tuple[int, int]]:
        return self._owed


def test_a_source_leaving_in_an_outage_does_not_raise_and_skips_joiners_of_quorums_never_adopted() -> None:
    group, store, catchup = _writer()
    catchup.server = _Owed([(HID, JOINER)])   # type: ignore[assignment]
    store.blip.set()
    group.client.down.set()
    t0 = time.monotonic()
    catchup.finish()                  # raised out of leave() before: the launcher saw a crash
    assert time.monotonic() - t0 < group.timeouts.quorum
    store.blip.clear()
    group.client.down.clear()
    catchup.server = _Owed([(HID + 1, 99)])   # type: ignore[assignment]   # offered early to a quorum never adopted
    t0 = time.monotonic()
    catchup.finish()                  # waited Timeouts.quorum before for a word that never comes
    assert time.monotonic() - t0 < group.timeouts.quorum / 2


class _Between:
    enters_between_rounds = True


def test_a_joiner_between_two_rounds_does_not_call_the_store_during_an_outage() -> None:
    group, store, catchup = _writer()
    group._in_step = False
    catchup.replayers.append(_Between())   # type: ignore[arg-type]
    catchup.pending[ME] = Pending(HID)
    catchup.hid, catchup.fetch = HID, _Done()   # type: ignore[assignment]
    catchup.fetch.done = threading.Event()      # type: ignore[attr-defined]
    catchup.fetch.done.set()                    # type: ignore[attr-defined]
    store.blip.set()
    group.client.down.set()
    calls = store.calls
    assert catchup.enter_between_rounds() is False and store.calls == calls   # each inner step would block
