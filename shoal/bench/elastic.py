"""Per-step cost of elastic DDP against static DDP (shoal's), measured in one run.

Both models live in the same worker processes (a static gloo world and an
ElasticGroup over an in-process coordinator) and train alternately in blocks
of steps, so machine noise hits both alike. Reported: median step time of
each and their ratio; the elastic side's extra work per step is one store
round trip to vote (plus a quorum check by the last voter) and a snapshot of
rollback state when a codec is used.

    python -m shoal.bench.elastic --workers 2 --steps 20 --rounds 5
    python -m shoal.bench.elastic --codec powersgd
    python -m shoal.bench.elastic --snapshot-cost   # the per-step rollback snapshot alone
"""

from __future__ import annotations

import argparse
import copy
import json
import secrets
import statistics
import time
import uuid
from typing import Any

import torch
import torch.nn.functional as F

import shoal
from shoal import codecs
from shoal.bench.overhead import mlp
from shoal.elastic import Coordinator, ElasticGroup, ElasticOptimizer, Timeouts
from shoal.testing import run_workers


def _codec(name: str) -> codecs.Codec | None:
    return codecs.PowerSGD(rank=4) if name == "powersgd" else None


def _worker(rank: int, world: int, steps: int, rounds: int, codec: str) -> dict[str, Any]:
    torch.manual_seed(0)
    base = mlp()
    static = shoal.DistributedDataParallel(copy.deepcopy(base), codec=_codec(codec))
    group = ElasticGroup(timeouts=Timeouts(), min_workers=world)
    elastic = shoal.DistributedDataParallel(copy.deepcopy(base), process_group=group, codec=_codec(codec))
    opts: dict[str, Any] = {"static": torch.optim.SGD(static.parameters(), lr=1e-3),
            "elastic": ElasticOptimizer(torch.optim.SGD(elastic.parameters(), lr=1e-3), group)}
    models = {"static": static, "elastic": elastic}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    times: dict[str, list[float]] = {"static": [], "elastic": []}
    for r in range(rounds + 1):               # round 0 warms up (first quorum, heal)
        for name in ("static", "elastic"):
            model, opt = models[name], opts[name]
            for _ in range(steps):
                t0 = time.perf_counter()
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
                if r:
                    times[name].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["discards"] = group.stats.discards
    group.leave()
    return out


def snapshot_cost(repeats: int = 30) -> dict[str, float]:
    """Median ms of PowerSGD's ``state_dict()`` (the old per-step snapshot) and ``rollback_state()``.

    One process, a world-1 gloo group, the bench's MLP gradients; the codec
    steps between two snapshots as it does in training.
    """
    import datetime

    import torch.distributed as dist

    from shoal.comm import Group
    from shoal.testing import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group, net, codec = Group(), mlp(), codecs.PowerSGD(rank=4)
        names = [n for n, _ in net.named_parameters()]
        grads = [torch.randn_like(p) for p in net.parameters()]
        out: dict[str, float] = {}
        for fn in ("state_dict", "rollback_state"):
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                getattr(codec, fn)()
                ts.append(time.perf_counter() - t0)
                codec.mean([g.clone() for g in grads], names, group, "bench")
            out[f"{fn}_ms"] = round(1e3 * statistics.median(ts), 3)
        out["residual_mb"] = round(sum(v.numel() * v.element_size() for v in codec.errors.values()) / 1e6, 1)
        return out
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.elastic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per model (after one warm-up block)")
    ap.add_argument("--codec", choices=["none", "powersgd"], default="none")
    ap.add_argument("--snapshot-cost", action="store_true",
                    help="only time PowerSGD's rollback snapshot against a state_dict() copy (one process)")
    a = ap.parse_args(argv)
    if a.snapshot_cost:
        print(json.dumps(snapshot_cost()))
        return 0
    token = secrets.token_urlsafe(16)   # the workers prove it at their join (elastic runs require one)
    coord = Coordinator(port=0, initial_workers=a.workers, token=token).start()
    try:
        env = {"SHOAL_COORDINATOR": coord.address, "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "SHOAL_TOKEN": token}
        res = run_workers(_worker, a.workers, a.steps, a.rounds, a.codec, env=env, timeout=600)
    finally:
        coord.stop()
    static = statistics.median(r["static"] for r in res)
    elastic = statistics.median(r["elastic"] for r in res)
    summary = {"workers": a.workers, "codec": a.codec, "params": sum(p.numel() for p in mlp().parameters()),
               "static_ms": round(1e3 * static, 2), "elastic_ms": round(1e3 * elastic, 2),
               "ratio": round(elastic / static, 3), "discards": sum(r["discards"] for r in res)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
