"""A leave after a collective outside a step waits for the slower members (issue #24, the leave race).

``ZeroRedundancyOptimizer.consolidate_state_dict`` gathers outside a step (no
vote); a member that finished the gather and left at once made the
coordinator abort the quorum under a slower member still inside it. Here
rank 1 is parked, deterministically, after issuing such a collective and
before waiting for it, until rank 0 (which finished it) is leaving; then it
waits until either the coordinator aborted the quorum (the race lost) or
rank 0's leave is waiting for it (an orderly departure: rank 0 published its
collective count and waits for rank 1's).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch

from shoal.membership.coordinator import connect
from shoal.elastic import Coordinator, ElasticGroup, Timeouts
from shoal.testing import run_workers

TOKEN = "leave-orderly-token"
_T = Timeouts(op=20.0, heartbeat_interval=0.05, probe=0.3, heartbeat_timeout=5.0, quorum=30.0, join=40.0)


class _CountingStore:
    """The member's store, counting the collective counts it publishes (``.../past/<member>`` sets)."""

    def __init__(self, store: Any) -> None:
        self.store, self.past_sets = store, 0

    def set(self, key: str, value: Any) -> None:
        self.past_sets += "/past/" in key
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _worker(rank: int, world: int, address: str, run_id: str) -> dict[str, Any]:
    g = ElasticGroup(run_id, coordinator=address, timeouts=_T, min_workers=2, token=TOKEN)
    counting = g.client.store = _CountingStore(g.client.store)  # type: ignore[assignment]
    for _ in range(3):   # committed steps: their votes say every member is past their collectives
        g.begin_step()
        g.all_reduce(torch.ones(1), tag="step").wait()
        assert g.commit() and g.quorum is not None
    step_sets = counting.past_sets
    st, prefix, flag = connect(address, 10.0), g.quorum.prefix, f"{run_id}/test/leaving"
    out = torch.empty(2 * world)
    handle = g.all_gather_into(out, torch.full((2,), float(rank)), tag="outside-a-step")
    if rank == 0:     # the fast one: past the collective, it leaves at once
        handle.wait()
        st.set(flag, "1")
        g.leave()
        return {"error": repr(g.error), "out": out, "step_sets": step_sets}
    st.wait([flag])   # parked inside the collective until rank 0 is leaving
    # rank 0 has been through 4 collectives (the steps' all-reduces, the gather): once it published that,
    # it is waiting in leave() for this member
    past0 = f"{prefix}past/{next(m for m in g.quorum.members if m != g.client.member_id)}"
    while not (st.check([prefix + "abort"]) or (st.check([past0]) and int(st.get(past0)) >= 4)):
        time.sleep(0.002)
    aborted = bool(st.check([prefix + "abort"]))
    handle.wait()
    error = g.error
    g.leave()
    return {"aborted": aborted, "error": repr(error), "out": out, "commits": g.stats.commits, "step_sets": step_sets}


@pytest.mark.timeout(90)
def test_leaving_after_a_collective_outside_a_step_does_not_abort_a_slower_member() -> None:
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    try:
        fast, slow = run_workers(_worker, 2, coord.address, uuid.uuid4().hex[:8], timeout=80, init_group=False)
    finally:
        coord.stop()
    assert not slow["aborted"], "rank 0's leave aborted the quorum while rank 1 was still inside the gather"
    assert slow["error"] == "None" and fast["error"] == "None", (slow, fast)
    assert torch.equal(slow["out"], fast["out"]), (slow, fast)   # by quorum rank (ordered by member id)
    assert sorted(slow["out"].tolist()) == [0.0, 0.0, 1.0, 1.0], slow
    assert slow["commits"] == 3   # no step was added
    # committed steps publish no collective count (the vote says it): one store write a step saved
    assert slow["step_sets"] == fast["step_sets"] == 0, (slow["step_sets"], fast["step_sets"])
