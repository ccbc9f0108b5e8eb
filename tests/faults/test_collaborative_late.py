"""Peers that arrive late or alone: they must train (or load the swarm's state), not retry a closed round.

Each run has a hard limit below its pytest timeout; peers are threads around a real coordinator
(TCP store, heartbeats), as in test_collaborative.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
import uuid
from typing import Any

import pytest

from collab_peer import Spec, assert_equal_after_each_round, finished, run_threads
from shoal.membership.coordinator import Coordinator, connect

TOKEN = "run-token-late"
TARGET = 64


def _behind(result: dict[str, Any]) -> int:
    return sum(1 for rec in result["log"] if rec["outcome"] == "behind")


@pytest.mark.timeout(90)
def test_a_peer_starting_after_all_others_left_trains_alone_and_finishes(caplog: Any) -> None:
    # Two peers train to epoch 3 and leave. A third peer then starts on the same run: the
    # swarm's rounds 0..2 are closed and nobody is left to average or send state with. It
    # must notice it is alone, move past the closed rounds, and train to its own target.
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    common = {"target": TARGET, "matchmaking": 1.0, "heartbeat": 2.0, "linger": 0.0}
    try:
        first = finished(run_threads([Spec(rank=0, epochs=3, **common), Spec(rank=1, epochs=3, **common)], TOKEN,
                                     hard_limit=50, coordinator=coord, run_id=run_id))
        assert all(r["epoch"] == 3 for r in first)
        with caplog.at_level(logging.WARNING, logger="shoal.collaborative"):
            [alone] = finished(run_threads([Spec(rank=2, start_peers=1, epochs=6, max_seconds=25, **common)], TOKEN,
                                           hard_limit=35, coordinator=coord, run_id=run_id))
    finally:
        coord.stop()
    trained = [rec for rec in alone["log"] if rec["outcome"] in ("averaged", "local") and rec["own"] > 0]
    assert alone["epoch"] >= 6, f"the lone peer stopped at epoch {alone['epoch']}: {alone['log'][-3:]}"
    assert len(trained) >= 2 and all(rec["peers"] == 1 for rec in trained)
    assert all(rec["outcome"] == "local" for rec in trained), "a lone peer did not average with anyone"
    assert _behind(alone) <= 1, f"{_behind(alone)} rounds thrown away"
    too_late = [r for r in caplog.records if "too late" in r.getMessage()]
    alone_msgs = [r for r in caplog.records if "alone" in r.getMessage()]
    assert len(too_late) <= 1 and len(alone_msgs) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(120)
def test_a_late_joiner_wastes_at_most_one_round_before_loading_state() -> None:
    # A coordinator expecting two initial workers: the first peer (no start barrier) trains alone (its list is not out
    # yet), the second starts once the first reached epoch 2. The second finds epoch 0's round long
    # closed: within one round it must load the first peer's state, then train with it.
    # The first peer waits after epoch 2 until the second is in the swarm: without that hold, on a loaded
    # machine it could reach epoch 7 and leave before the second's first round (seen in CI), and the
    # second, alone with closed rounds, rightly trains alone (test above) with nothing to load.
    # The matchmaking window closes as soon as both are ready; its length only bounds how long the first
    # waits for a slow second in a round (too short, and the second is behind in two rounds).
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    common = {"target": TARGET, "epochs": 7, "pace": 0.02, "max_seconds": 60, "matchmaking": 5.0, "linger": 3.0}
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            early = pool.submit(run_threads, [Spec(rank=0, role="late", hold_after=2, **common)], TOKEN,
                                hard_limit=100, coordinator=coord, run_id=run_id)
            t_end = time.monotonic() + 60
            while time.monotonic() < t_end and not _reached(coord, run_id, 2) and not early.done():
                time.sleep(0.05)
            assert _reached(coord, run_id, 2), ("the first peer never reached epoch 2 within 60 s"
                                                f"{' (it stopped: ' + repr(early.result()) + ')' if early.done() else ''}")
            [late] = finished(run_threads([Spec(rank=1, role="late", **common)], TOKEN, hard_limit=100,
                                          coordinator=coord, run_id=run_id))
            [first] = finished(early.result())
    finally:
        coord.stop()
    assert _behind(late) <= 1, f"the late peer threw away {_behind(late)} rounds: {late['log'][:3]}"
    seen = [(rec["epoch"], rec["outcome"], rec["peers"]) for rec in late["log"]]
    joined = next((rec for rec in late["log"] if rec["outcome"] != "behind"), None)
    assert joined is not None, (f"the late peer never took part in a round (its rounds: {seen}; it stopped at epoch "
                                f"{late['epoch']}, the first peer at {first['epoch']} with rounds "
                                f"{[(r['epoch'], r['outcome'], r['peers']) for r in first['log']]})")
    assert joined["outcome"] == "loaded" and joined["epoch"] >= 2, seen
    assert late["epoch"] == 7
    assert_equal_after_each_round([first, late])


def _reached(coord: Coordinator, run_id: str, epoch: int) -> bool:
    """Whether the swarm has counted samples for ``epoch`` (read from the coordinator's store)."""
    return bool(connect(coord.address, 10.0).check([f"{run_id}/samples/{epoch}"]))
