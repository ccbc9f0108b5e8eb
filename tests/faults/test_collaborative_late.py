"""Collaborative peers that arrive late or alone (issue #25): they train, they never loop on a closed round."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import pytest
import torch

from collab_peer import Spec, finished, run_threads, train
from shoal.comm.membership import Coordinator

TOKEN = "late-token-123"



@pytest.mark.timeout(90)
def test_a_peer_starting_after_every_other_peer_left_trains_and_finishes(caplog: Any) -> None:
    # Two peers train epochs 0..2 and leave. A third then starts at epoch 0: every round it could join
    # is closed and nobody is left to load state from. It must train on alone (from the first epoch
    # the swarm never averaged), say so once, and finish; today it retried epoch 0's round forever.
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    try:
        first = finished(run_threads([Spec(rank=r, epochs=3, linger=0.2, max_seconds=30) for r in (0, 1)], TOKEN,
                                     hard_limit=45, coordinator=coord, run_id=run_id))
        assert all(r["epoch"] == 3 for r in first)
        caplog.set_level(logging.INFO, logger="shoal.collaborative")
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(r=train(Spec(rank=2, epochs=6, max_seconds=25, linger=0),
                                                               run_id, coord.address, TOKEN, life=1)), daemon=True)
        t.start()
        t.join(40)
        assert not t.is_alive(), "the lone late peer never finished"
    finally:
        coord.stop()
    late = box["r"]
    assert late["epoch"] == 6, late["log"]
    trained = [rec for rec in late["log"] if rec["own"] > 0]
    assert trained and trained[0]["epoch"] >= 3, late["log"]          # it skipped the epochs the swarm did
    assert sum(rec["outcome"] == "behind" for rec in late["log"]) <= 1, late["log"]
    assert caplog.text.count("training on alone") == 1, caplog.text
    assert caplog.text.count("too late") <= 1, caplog.text



@pytest.mark.timeout(60)
def test_the_start_barrier_waits_for_peers_and_says_how_many_came() -> None:
    import shoal
    from shoal.collaborative import CollaborativeOptimizer
    from shoal.errors import ConfigError, ShoalError

    with pytest.raises(ConfigError, match="min_peers must be an integer >= 1"):
        shoal.CollaborativeConfig(run_id="r", target_batch_size=8, min_peers=0)
    coord = Coordinator(port=0, initial_workers=1, token=TOKEN).start()
    try:
        cfg = dict(run_id=uuid.uuid4().hex[:8], target_batch_size=8, batch_size_per_step=4, coordinator=coord.address,
                   token=TOKEN)
        net = torch.nn.Linear(2, 1)
        with pytest.raises(ShoalError, match="only 1 of 2 peers joined run .* within 1 s"):
            CollaborativeOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), config=shoal.CollaborativeConfig(
                **cfg, min_peers=2, start_timeout=1.0))
        first = CollaborativeOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       config=shoal.CollaborativeConfig(**cfg))
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(n=first.wait_for_peers(2, timeout=30)), daemon=True)
        t.start()
        second = CollaborativeOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1),
                                        config=shoal.CollaborativeConfig(**cfg, min_peers=2, start_timeout=30))
        t.join(30)
        assert box.get("n") == 2
        second.shutdown()
        first.shutdown()
    finally:
        coord.stop()
