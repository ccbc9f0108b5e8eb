"""One worker of the elastic NaN/Inf tests: a strategy on an ElasticGroup, no faults, rank 1 goes non-finite.

Started by harness.py. Rank 1 feeds a NaN input at step ``NAN_STEP`` (a
non-finite gradient) and, for the averaging strategies, writes a NaN into a
parameter after step ``PARAM_STEP`` (which reaches the next round). Writes
``<out>/<rank>-0.pt`` with per-step finiteness and parameter digests, the
elastic counters (a non-finite skip must be no discard) and
``nonfinite_skips``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, Timeouts
from harness import save_and_leave
from forked import run_and_end

NAN_STEP = 1
PARAM_STEP = 4
PERIOD = 3


def make_strategy(name: str) -> Any:
    if name == "sync":
        return shoal.strategies.Sync()
    if name == "localsgd":
        return shoal.LocalSGD(period=PERIOD)
    if name == "diloco":
        return shoal.DiLoCo(inner_steps=PERIOD)
    raise SystemExit(f"unknown strategy {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["sync", "localsgd", "diloco"], required=True)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timeouts = Timeouts(op=10.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=5.0, quorum=20.0, join=60.0)
    group = ElasticGroup(timeouts=timeouts, min_workers=2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    strategy = make_strategy(a.strategy)
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy, process_group=group)
    g = torch.Generator().manual_seed(10 + rank)
    log: list[dict[str, Any]] = []
    for step in range(a.steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        if rank == 1 and step == NAN_STEP:
            x[0, 0] = float("nan")
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if rank == 1 and step == PARAM_STEP and a.strategy != "sync":
            with torch.no_grad():
                net[2].bias[0] = float("nan")
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        log.append({"finite": bool(torch.isfinite(flat).all()), "params": flat.clone()})
    rounds = getattr(strategy, "rounds", None)
    result = {"log": log, "rank": rank, "stats": vars(group.stats),
              "skips": strategy.comm_stats().total.nonfinite_skips,
              "round_skipped": rounds.skipped if rounds is not None else 0}
    save_and_leave(a.out, rank, 0, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
