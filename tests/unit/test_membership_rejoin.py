"""A live member that the coordinator dropped (it missed a probe while busy) joins again, even when
too few members are left for the coordinator to publish a quorum that would tell it so."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Coordinator, Timeouts

TOKEN = "rejoin-test-token"
_T = Timeouts(op=1.0, heartbeat_interval=0.05, probe=0.3, heartbeat_timeout=1.0, quorum=5.0, join=10.0)


@pytest.mark.timeout(60)
def test_a_member_dropped_below_min_workers_joins_again_and_the_pair_re_forms() -> None:
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    a = MemberClient(coord.address, "rejoin", _T, min_workers=2, token=TOKEN)
    b = MemberClient(coord.address, "rejoin", _T, min_workers=2, token=TOKEN)
    try:
        a.join()
        b.join()
        q1 = a.wait_quorum(after=0, timeout=10)
        assert set(q1.members) == {a.member_id, b.member_id}
        old_b = b.member_id
        # b's heartbeat thread starves (a busy worker) just when a asks for a new quorum: the probe
        # drops b, and a alone is below min_workers, so nothing is published.
        b._stop.set()
        assert b._hb is not None
        b._hb.join()
        a.request_quorum(q1.qid)
        got: dict[str, Any] = {}
        t = threading.Thread(target=lambda: got.update(q=a.wait_quorum(after=q1.qid, timeout=15)))
        t.start()
        q2 = b.wait_quorum(after=q1.qid, timeout=15)     # b must find out and join again
        t.join()
        assert b.member_id != old_b and set(q2.members) == {a.member_id, b.member_id}
        assert got["q"] == q2
    finally:
        a.leave()
        b.leave()
        coord.stop()
