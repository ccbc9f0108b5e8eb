"""Matchmaking expects peers the coordinator has admitted but not listed yet (one process, threads)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

import shoal
from shoal.collaborative.rounds import RoundGroup
from shoal.membership.coordinator import Coordinator

TOKEN = "matchmaking-token"


@pytest.mark.timeout(60)
def test_first_round_waits_for_peers_admitted_before_the_coordinators_first_list() -> None:
    """Two peers join; the coordinator publishes no member list yet (its join grace outlasts the test,
    as a loaded machine's tick can outlast a first epoch). The first peer ready must wait for the other
    (within matchmaking_time) instead of closing the round alone: a peer left out of its first round
    has no state to load and waits out its load timeout (what made the device-guard tests take 20 s)."""
    coord = Coordinator(port=0, join_grace=120.0, initial_workers=2, token=TOKEN).start()
    cfg = shoal.CollaborativeConfig(run_id="mm" + uuid.uuid4().hex[:8], target_batch_size=2, batch_size_per_step=1,
                                    coordinator=coord.address, token=TOKEN, matchmaking_time=20.0)
    groups: list[RoundGroup] = []
    try:
        groups = [RoundGroup(cfg.run_id, cfg.coordinator, cfg.timeouts(), TOKEN, cfg.matchmaking_time,
                             {"pid": k}) for k in range(2)]
        assert groups[0].client.latest() == 0, "the coordinator published a list: the test needs none"
        got: dict[int, Any] = {}

        def ready(k: int, delay: float) -> None:
            time.sleep(delay)
            try:
                got[k] = groups[k].matchmake(0, 0, True, set(), time.monotonic() + 30)
            except BaseException as e:  # noqa: BLE001 - reported below
                got[k] = e

        threads = [threading.Thread(target=ready, args=(k, 0.5 * k), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(45)
        ids = sorted(g.client.member_id for g in groups)
        for k in range(2):
            q = got.get(k)
            if isinstance(q, BaseException):
                raise q
            assert q is not None, f"peer {k} was left out of the first round: {got}"
            assert sorted(q.members) == ids, (k, q.members, ids)
    finally:
        for g in groups:
            g.client.leave()
        coord.stop()
