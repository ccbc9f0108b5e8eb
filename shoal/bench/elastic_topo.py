"""Per-step cost of Hierarchical SGD and DASO on an elastic group against a static one, in one run.

As :mod:`shoal.bench.elastic`: both copies of the model live in the same
worker processes (a static gloo world and an ElasticGroup over an
in-process coordinator) and train alternately in blocks of steps, so machine
noise hits both alike. Workers ``2k`` and ``2k+1`` pretend to share a host.
Reported: median step time of each and the ratio. The elastic side pays a
store vote per elastic step (every averaging round for Hierarchical; every
training step and every global round for DASO) and, for DASO, a blocking
global sync where the static one overlaps it with training.

    python -m shoal.bench.elastic_topo --strategy daso --workers 4
    python -m shoal.bench.elastic_topo --strategy hierarchical --workers 4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import secrets
import statistics
import time
import uuid
from typing import Any

import torch
import torch.nn.functional as F

import shoal
from shoal.bench.overhead import mlp
from shoal.elastic import Coordinator, ElasticGroup, Timeouts
from shoal.testing import run_workers


def _strategy(name: str, world: int) -> shoal.Strategy:
    if name == "hierarchical":
        return shoal.Hierarchical({2: 2, 8: world})
    # Cycling from the start (no warm-up or cool-down), skips allowed to grow to 4.
    return shoal.DASO(total_epochs=10**6, steps_per_epoch=10, warmup_epochs=0, cooldown_epochs=0,
                      max_global_skips=4, stability_level=0.5)


def _worker(rank: int, world: int, name: str, steps: int, rounds: int) -> dict[str, Any]:
    os.environ["SHOAL_HOST_ID"] = f"h{rank // 2}"     # pretend hosts of two workers
    torch.manual_seed(0)
    base = mlp()
    models: dict[str, Any] = {}
    opts: dict[str, Any] = {}
    strategies: dict[str, Any] = {}
    group = ElasticGroup(timeouts=Timeouts(), min_workers=world)
    for kind, g in (("static", shoal.Group()), ("elastic", group)):
        net = copy.deepcopy(base)
        strategies[kind] = _strategy(name, world)
        models[kind], opts[kind] = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=1e-3),
                                              strategies[kind], process_group=g)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    times: dict[str, list[float]] = {"static": [], "elastic": []}
    for r in range(rounds + 1):               # round 0 warms up
        for kind in ("static", "elastic"):
            model, opt = models[kind], opts[kind]
            for _ in range(steps):
                t0 = time.perf_counter()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if isinstance(strategies[kind], shoal.DASO):
                    strategies[kind].report_loss(loss.item())
                if r:
                    times[kind].append(time.perf_counter() - t0)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out["discards"] = group.stats.discards
    strategies["static"].close()
    group.leave()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.elastic_topo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=["hierarchical", "daso"], default="daso")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per model (after one warm-up block)")
    a = ap.parse_args(argv)
    token = secrets.token_urlsafe(16)   # the workers prove it at their join (elastic runs require one)
    coord = Coordinator(port=0, initial_workers=a.workers, token=token).start()
    try:
        env = {"SHOAL_COORDINATOR": coord.address, "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "SHOAL_TOKEN": token}
        res = run_workers(_worker, a.workers, a.strategy, a.steps, a.rounds, env=env, timeout=600)
    finally:
        coord.stop()
    static = statistics.median(r["static"] for r in res)
    elastic = statistics.median(r["elastic"] for r in res)
    print(json.dumps({"strategy": a.strategy, "workers": a.workers, "steps": a.steps, "rounds": a.rounds,
                      "static_ms": round(1e3 * static, 2), "elastic_ms": round(1e3 * elastic, 2),
                      "ratio": round(elastic / static, 3), "discards": sum(r["discards"] for r in res)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
