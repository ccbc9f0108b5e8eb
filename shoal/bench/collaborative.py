"""Collaborative training throughput and recovery: N peers on loopback, optionally one killed.

The task is an MLP (64-128-10) on scikit-learn's 8x8 digits when scikit-learn
is importable (the hivemind comparison uses the same), else on a synthetic
10-class problem of the same shape. Every peer uses batch 32 and the swarm a
target batch of 512; each runs for ``--seconds``. Reported per run: samples/s
of the swarm (samples committed in epochs / wall time after the first epoch),
seconds to reach ``--loss`` (mean training loss of an epoch, peer 0), bytes
sent per peer per epoch, and with ``--kill-at`` the longest gap between two
epochs of a survivor after the kill (the degraded time).

    python -m shoal.bench.collaborative --peers 2 --seconds 40
    python -m shoal.bench.collaborative --peers 2 --seconds 40 --kill-at 15
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TOKEN = "bench-token-123"


def dataset() -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-not-found]
        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        return x, torch.tensor(d.target), "digits"
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(1797, 64, generator=g)
        y = (x @ torch.randn(64, 10, generator=g)).argmax(dim=1)
        return x, y, "synthetic"


def peer(rank: int, address: str, run_id: str, seconds: float, out: str, peers: int) -> None:
    import shoal
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y, _ = dataset()
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    cfg = shoal.CollaborativeConfig(run_id=run_id, target_batch_size=512, batch_size_per_step=32,
                                    coordinator=address, token=TOKEN)
    opt = shoal.CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=1e-3), net.named_parameters(), config=cfg)
    opt.wait_for_peers(peers, timeout=60)       # start together, as the hivemind run does
    g = torch.Generator().manual_seed(rank)
    t_end, losses, log = time.monotonic() + seconds, [], []
    while time.monotonic() < t_end:
        idx = torch.randint(0, len(x), (32,), generator=g)
        loss = F.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        losses.append(loss.item())
        rep = opt.step()
        opt.zero_grad()
        if rep is not None:
            log.append({"t": time.time(), "epoch": rep.epoch, "outcome": rep.outcome, "samples": rep.samples,
                        "peers": rep.peers, "loss": sum(losses) / len(losses), "round_s": rep.seconds,
                        "bytes": opt.group.meter.counters().bytes_sent})
            losses = []
            path = os.path.join(out, f"{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(log, f)
            os.replace(path + ".tmp", path)
    opt.shutdown()


def summarize(logs: dict[int, list[dict[str, Any]]], target_loss: float, killed_at: float | None,
              survivor: int = 0) -> dict[str, Any]:
    main = logs[survivor]
    committed = [r for r in main if r["outcome"] in ("averaged", "local")]
    t0 = committed[0]["t"]
    span = committed[-1]["t"] - t0
    samples = sum(r["samples"] for r in committed[1:])
    hit = next((r["t"] - t0 for r in committed if r["loss"] <= target_loss), None)
    gaps = [b["t"] - a["t"] for a, b in zip(committed, committed[1:]) if killed_at is None or b["t"] >= killed_at]
    nbytes = (committed[-1]["bytes"] - committed[0]["bytes"]) / max(len(committed) - 1, 1)
    return {"epochs": len(committed), "samples_per_s": samples / span if span > 0 else 0.0,
            "seconds_to_loss": hit, "bytes_per_epoch_per_peer": nbytes,
            "max_gap_after_kill_s": max(gaps) if killed_at is not None and gaps else None,
            "median_gap_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
            "local_steps": sum(1 for r in main if r["outcome"] == "local"), "final_loss": committed[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--kill-at", type=float, default=None, help="SIGKILL peer 1 this many seconds after start")
    ap.add_argument("--loss", type=float, default=0.3, help="target training loss for time-to-loss")
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer is not None:
        peer(a.peer, a.address, a.run_id, a.seconds, a.out, a.peers)
        return
    from shoal.membership.coordinator import Coordinator
    coord = Coordinator(port=0, token=TOKEN, initial_workers=a.peers).start()
    out = tempfile.mkdtemp(prefix="shoal-collab-bench-")
    run_id = uuid.uuid4().hex[:8]
    procs = [subprocess.Popen([sys.executable, "-m", "shoal.bench.collaborative", "--peer", str(r), "--address",
                               coord.address, "--run-id", run_id, "--out", out, "--seconds", str(a.seconds), "--peers", str(a.peers)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
             for r in range(a.peers)]
    killed_at = None
    try:
        if a.kill_at is not None:
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(out, "0.json")) and time.time() < deadline:
                time.sleep(0.1)        # count from the first epoch, not from the imports
            time.sleep(a.kill_at)
            os.killpg(procs[1].pid, signal.SIGKILL)
            killed_at = time.time()
        for p in procs:
            p.wait(timeout=a.seconds + 180)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()
    logs = {}
    for r in range(a.peers):
        path = os.path.join(out, f"{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                logs[r] = json.load(f)
    print(json.dumps({"task": dataset()[2], "peers": a.peers, "kill_at": a.kill_at,
                      **summarize(logs, a.loss, killed_at)}, indent=1))


if __name__ == "__main__":
    main()
