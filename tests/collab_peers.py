"""CollaborativeOptimizer peers as threads of one process around an in-process coordinator.

Shared by tests/dist/test_device_guard.py (CPU, device guard on) and tests/cuda
(the model on the GPU): each test says how one peer builds and trains, this
module runs the peers, keeps them together at the start and at the end, and
hands back what each peer returned (or the exception it raised).

Example::

    def peer(k: int, run: PeerRun) -> dict:
        opt = shoal.CollaborativeOptimizer(..., config=run.config(batch_size_per_step=8, target_batch_size=16))
        run.train(opt, lambda: one_step(opt), epochs=3)
        return {"epoch": opt.local_epoch}

    results = run_peers(peer, 2)
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import shoal
from shoal.membership.coordinator import Coordinator

TOKEN = "collab-test-token"


@dataclass
class PeerRun:
    """What a peer needs from the harness: the coordinator's address, the run id and the meeting point."""

    address: str
    run_id: str
    together: threading.Barrier
    limit_s: float

    def config(self, mode: str = "plain", **kw: Any) -> shoal.CollaborativeConfig:
        """The run's config; ``mode``: "plain", "offload" or "delayed" (offloaded, delayed optimizer step).

        matchmaking_time 5 s: a round closes as soon as every live peer is ready, so the window
        only costs time when a peer is really late (a thread starved on a loaded machine)."""
        kw.setdefault("matchmaking_time", 5.0)
        kw.setdefault("averaging_timeout", 30)
        return shoal.CollaborativeConfig(run_id=self.run_id, coordinator=self.address, token=TOKEN,
                                         offload_optimizer=mode in ("offload", "delayed"),
                                         delay_optimizer_step=mode == "delayed", **kw)

    def train(self, opt: shoal.CollaborativeOptimizer, step: Callable[[], None], epochs: int) -> None:
        """Meet the other peers (so that nobody counts samples before all are in the swarm), call
        ``step()`` until ``opt`` reaches ``epochs``, then meet again before returning: a peer leaves
        the swarm only once every peer is done, so none is left with a round it cannot finish.
        Past ``limit_s`` a peer stops where it is (the test's checks then say what went wrong)."""
        deadline = time.monotonic() + self.limit_s
        self.together.wait(self.limit_s)
        while opt.local_epoch < epochs and time.monotonic() < deadline:
            step()
        opt.wait_pending()
        try:
            self.together.wait(max(0.0, deadline - time.monotonic()) + 1.0)
        except threading.BrokenBarrierError:
            pass   # another peer failed or ran out of time: its result tells


def run_peers(peer: Callable[[int, PeerRun], Any], n: int = 2, limit_s: float = 60.0) -> list[Any]:
    """Run ``peer(k, run)`` for ``k < n`` on threads around a fresh coordinator (token auth on);
    each one's return value, or the exception it raised, or None if it did not finish in time."""
    coord = Coordinator(port=0, initial_workers=n, token=TOKEN).start()
    run = PeerRun(coord.address, "peers" + uuid.uuid4().hex[:8], threading.Barrier(n), limit_s)
    out: list[Any] = [None] * n

    def body(k: int) -> None:
        try:
            out[k] = peer(k, run)
        except BaseException as e:  # noqa: BLE001 - the test re-raises it
            out[k] = e
            run.together.abort()

    try:
        threads = [threading.Thread(target=body, args=(k,), daemon=True, name=f"peer{k}") for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit_s + 30)
    finally:
        coord.stop()
    return out


def raise_errors(results: list[Any]) -> None:
    """Re-raise a peer's exception, preferring a real error over a barrier another peer broke."""
    errors = [r for r in results if isinstance(r, BaseException)]
    errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]
    for k, r in enumerate(results):
        assert r is not None, f"peer {k} did not finish"
