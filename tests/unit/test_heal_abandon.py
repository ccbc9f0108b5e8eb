"""A joiner's background download that it gives up on is stopped, not released to full speed.

A paced download (SHOAL_HEAL_PACE) waits for the run's commits to open its slots. When the joiner
gives it up (the next quorum heals it blocking, or admits it again for a new snapshot), nobody will use
what it fetches: lifting its pace instead of stopping it would send the whole snapshot flat out through
the survivors' links, the very stall the pace is there to avoid. One joiner's CatchUp over a stand-in
group; two real snapshot servers on loopback; the sources' records in a HashStore."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from test_stateserve import RUN, TOKEN, _serve, _tree

from shoal.membership.catchup import CatchUp
from shoal.membership.coordinator import Quorum, Timeouts
from shoal.membership.heal import HealPlan
from shoal.membership.records import RecordBook

ME, HID, RANK = 9, 3, 2


class _Store:
    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def clone(self) -> _Store:
        return self


class _Client:
    address, token, run_id, member_id = "127.0.0.1:29999", TOKEN, RUN, ME

    def __init__(self, store: _Store) -> None:
        self.store, self.down = store, threading.Event()
        self.book = RecordBook(store, RUN, ME, None)

    def key(self, k: str) -> str:
        return f"{RUN}/{k}"


class _Group:
    timeouts = Timeouts(heartbeat_interval=0.05, probe=0.1, heartbeat_timeout=0.5, op=3.0, quorum=4.0, join=6.0)
    heal_chunk = 1 << 20

    def __init__(self, store: _Store) -> None:
        self.client, self.rank, self.size, self.step = _Client(store), RANK, 3, 5
        self._healed_since_commit = False
        self.newcomers: tuple[int, ...] = ()

    def on_commit(self, fn: Any) -> None:
        pass


class _Replayer:
    after_commit = False   # step-synchronous (DDP): the download is paced while the others train


def _two_sources(raw: Any) -> list[Any]:
    """Members 1 and 2 serve heal ``HID`` (the state at step 5's begin) to this joiner; their records in ``raw``."""
    tree = _tree()
    servers = []
    for m in (1, 2):
        server, src = _serve(tree, hid=HID, joiners=frozenset({ME}))
        raw.set(f"{RUN}/heal/{HID}/src/{m}", RecordBook(raw, RUN, m, None).seal(
            {"addr": src.address, "size": src.size, "sha": src.sha, "step": 5}))
        servers.append(server)
    return servers


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shoal-heal-fetch" and t.is_alive()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["the quorum heals blocking", "admitted again"])
def test_a_paced_download_given_up_on_asks_for_nothing_more_and_its_thread_ends(how: str) -> None:
    before = set(_fetch_threads())
    raw = dist.HashStore()
    servers = _two_sources(raw)
    group = _Group(_Store(raw))
    c = CatchUp(group)
    c.pace_fraction = 0.5                  # SHOAL_HEAL_PACE=0.5
    c.replayers.append(_Replayer())        # type: ignore[arg-type]
    asked: list[int] = []
    c.before_chunk = lambda source, received: asked.append(source)
    c._admit(HID, [1, 2], top=5)
    time.sleep(0.3)   # it found its sources and waits for a slot: no step committed since its admission
    assert asked == [] and c.pace is not None
    old = getattr(c, "fetch", None)
    if how == "admitted again":
        c._admit(HID + 1, [1, 2], top=6)   # a new snapshot (nobody serves it here: it waits for its sources)
    else:
        c.adopt(Quorum(7, (1, 2, ME), "run/q7/"), HealPlan(top=6, src=0, needy=(RANK,), background=False))
        assert c.hid == -1 and c.pace is None
    time.sleep(0.5)   # a download released to full speed fetches this snapshot over loopback in milliseconds
    assert asked == [], f"the download given up on asked for {len(asked)} ranges after it was given up"
    assert sum(s.served for s in servers) == 0
    fetches = set(_fetch_threads()) - before
    assert len(fetches) == (1 if how == "admitted again" else 0), fetches   # the old one was joined
    assert old is not None and old.done.is_set() and old.result[0] is None and "given up" in str(old.result[1])
    assert old.download is None or (old.download.stopped.is_set() and old.download.received == 0)   # None:
    # stopped before it found its sources (a loaded machine: the 0.3 s above did not suffice)
    if how == "admitted again":
        assert c.fetch is not None and c.fetch.hid == HID + 1 and not c.fetch.done.is_set()
        c._abandon()
    for s in servers:
        s.close()
