"""ZeroRedundancyOptimizer: optimizer-state bytes per rank, and step time against unsharded Adam.

Memory: Adam's state (exp_avg, exp_avg_sq, step) held by each rank after one
step, at each world size asked for, for the plain partition (balanced by
parameter size) and the overlapped one (whole gradient buckets per rank);
the goal is about total/N.

Time: shoal DDP + unsharded Adam, shoal DDP + ZeRO (plain: step after
backward) and ZeRO overlapped with backward (``DistributedDataParallel(...,
optimizer=zero)``) live in the same worker processes and train alternately
in blocks of steps on the same data, so machine noise hits all alike; the
figure is the ratio of median step times. All three must end with equal
parameters (reported as ``max |diff|``).

    python -m shoal.bench.zero --workers 2 --sizes 2,4 --steps 10 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from typing import Any, cast

import torch
from torch import nn

import shoal
from shoal.bench.overhead import TinyTransformer, _block, mlp
from shoal.testing import run_workers

VARIANTS = ("ddp+adam", "zero", "zero-overlap")


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of tensors in ``opt.state`` (for a ZeroRedundancyOptimizer: this rank's shard)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _build(task: str, cap_mb: float) -> tuple[nn.Module, dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(0)
    base = mlp() if task == "mlp" else TinyTransformer()
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    models["ddp+adam"] = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap_mb)
    opts["ddp+adam"] = torch.optim.Adam(models["ddp+adam"].parameters(), lr=1e-3)
    models["zero"] = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap_mb)
    opts["zero"] = shoal.ZeroRedundancyOptimizer(models["zero"].parameters(), torch.optim.Adam, lr=1e-3)
    module = copy.deepcopy(base)
    zero = shoal.ZeroRedundancyOptimizer(module.parameters(), torch.optim.Adam, lr=1e-3)
    models["zero-overlap"] = shoal.DistributedDataParallel(module, bucket_cap_mb=cap_mb, optimizer=zero)
    opts["zero-overlap"] = zero
    return base, models, opts


def _memory_worker(rank: int, world: int, task: str, cap_mb: float) -> dict[str, int]:
    _, models, opts = _build(task, cap_mb)
    g = torch.Generator().manual_seed(rank)
    for k in VARIANTS:
        _block(task, models[k], opts[k], 1, g, [])
    return {k: state_bytes(opts[k]) for k in VARIANTS}


def _time_worker(rank: int, world: int, task: str, cap_mb: float, steps: int, rounds: int) -> dict[str, Any]:
    base, models, opts = _build(task, cap_mb)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    losses: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for k in VARIANTS:  # warm-up: allocator, gloo connections, optimizer state
        _block(task, models[k], opts[k], 2, torch.Generator().manual_seed(rank), [])
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for k in order:
            gk = torch.Generator().manual_seed(1000 * r + rank)  # same data for every variant
            times[k] += _block(task, models[k], opts[k], steps, gk, losses[k])
    cast(shoal.ZeroRedundancyOptimizer, opts["zero-overlap"]).wait_for_params()
    ref = dict(models["ddp+adam"].named_parameters())
    diff = max((p - ref[n]).abs().max().item() for k in VARIANTS[1:] for n, p in models[k].named_parameters())
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "final_loss": {k: v[-1] for k, v in losses.items()},
        "params": sum(p.numel() for p in base.parameters()),
        "buckets": len(getattr(models["zero-overlap"], "reducer").buckets),
        "max_diff": diff,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.zero", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="transformer", choices=["transformer", "mlp"])
    ap.add_argument("--workers", type=int, default=2, help="world size of the timing run")
    ap.add_argument("--sizes", default="2,4", help="world sizes of the memory runs ('' to skip them)")
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0,
                    help="gradient bucket cap (the overlapped ZeRO assigns whole buckets to ranks)")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=6, help="alternating blocks per variant")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"memory": {}}
    print(f"Adam state bytes per rank, task {args.task}, bucket cap {args.bucket_cap_mb} MiB")
    print(f"{'N':>3} {'unsharded MB':>12} {'zero max MB':>11} {'zero min MB':>11} {'max/(tot/N)':>11} "
          f"{'overlap max MB':>14} {'overlap min MB':>14} {'max/(tot/N)':>11}")
    for n in [int(x) for x in args.sizes.split(",") if x]:
        per_rank = run_workers(_memory_worker, n, args.task, args.bucket_cap_mb, timeout=1800)
        total = per_rank[0]["ddp+adam"]
        row = {k: [r[k] for r in per_rank] for k in VARIANTS}
        results["memory"][n] = row
        z, o = row["zero"], row["zero-overlap"]
        print(f"{n:>3} {total / 1e6:>12.2f} {max(z) / 1e6:>11.2f} {min(z) / 1e6:>11.2f} {max(z) * n / total:>11.3f} "
              f"{max(o) / 1e6:>14.2f} {min(o) / 1e6:>14.2f} {max(o) * n / total:>11.3f}", flush=True)
    r = run_workers(_time_worker, args.workers, args.task, args.bucket_cap_mb, args.steps, args.rounds, timeout=1800)[0]
    results["time"] = r
    base_s = r["median_s"]["ddp+adam"]
    print(f"\n{args.workers} workers on loopback, {r['params']:,} parameters, {r['buckets']} buckets; "
          f"{args.rounds} alternating blocks of {args.steps} steps per variant")
    print(f"{'variant':<14} {'median ms':>9} {'vs ddp+adam':>11} {'final loss':>10}")
    for k in VARIANTS:
        s = r["median_s"][k]
        print(f"{k:<14} {1e3 * s:>9.1f} {s / base_s:>11.3f} {r['final_loss'][k]:>10.4f}")
    print(f"max |param diff| vs ddp+adam after training: {r['max_diff']:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
