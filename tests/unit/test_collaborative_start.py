"""The public start barrier (CollaborativeOptimizer.wait_for_peers) and the rate limit on repeated warnings."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest
import torch
from torch import nn

import shoal
from shoal.collaborative.loading import Throttle
from shoal.membership.coordinator import Coordinator
from shoal.errors import ConfigError, ShoalError

TOKEN = "unit-token-start"


def _peer(coord: Coordinator, run_id: str) -> shoal.CollaborativeOptimizer:
    net = nn.Linear(3, 2)
    cfg = shoal.CollaborativeConfig(run_id=run_id, target_batch_size=8, batch_size_per_step=4,
                                    coordinator=coord.address, token=TOKEN, matchmaking_time=0.5, averaging_timeout=5)
    return shoal.CollaborativeOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.1), net.named_parameters(), config=cfg)


@pytest.mark.timeout(60)
def test_wait_for_peers_returns_once_enough_peers_joined_and_fails_clearly_when_not() -> None:
    torch.set_num_threads(1)
    coord = Coordinator(port=0, token=TOKEN).start()
    run_id = "s" + uuid.uuid4().hex[:8]
    opts: list[shoal.CollaborativeOptimizer] = []
    try:
        opts.append(_peer(coord, run_id))
        with pytest.raises(ShoalError, match="only 1 of 2 peers"):
            opts[0].wait_for_peers(2, timeout=0.5)
        for bad in (0, -1, True, 1.5):
            with pytest.raises(ConfigError, match="wait_for_peers"):
                opts[0].wait_for_peers(bad)  # type: ignore[arg-type]
        got: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: got.update(n=opts[0].wait_for_peers(2, timeout=30)))
        waiter.start()
        opts.append(_peer(coord, run_id))
        waiter.join(35)
        assert got.get("n") == 2
        assert opts[1].wait_for_peers(2, timeout=30) == 2
        assert opts[0].wait_for_peers(1, timeout=0) >= 1
    finally:
        for o in opts:
            o.shutdown()
        coord.stop()


def test_throttle_lets_one_line_through_per_period_and_counts_the_rest(caplog: Any) -> None:
    t = Throttle(every=10.0)
    assert [t.ready("k", now=x) for x in (0.0, 1.0, 2.0, 9.9, 10.0, 10.5)] == \
        [(True, 0), (False, 1), (False, 2), (False, 3), (True, 3), (False, 1)]
    assert t.ready("other", now=1.0) == (True, 0)        # keys are limited separately
    loud = Throttle(every=3600.0)
    with caplog.at_level(logging.WARNING, logger="shoal.collaborative"):
        for _ in range(1000):
            loud.warning("late", "epoch %d: too late", 3)
    assert [r.getMessage() for r in caplog.records] == ["epoch 3: too late"]
