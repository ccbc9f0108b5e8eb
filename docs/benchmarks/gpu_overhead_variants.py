"""Where shoal DDP's GPU step time goes against torch DDP: variants in one run, and a profile.

``python -m shoal.bench.overhead --device cuda`` measured shoal/torch 1.035 at
world 1 and 1.053 at world 2 (H100, 2026-11-27). This script separates the
one thing shoal's reducer does that torch's does not, the non-finite check
(one fused norm plus one host read per step, docs/codecs.md), from the rest:
it times ``bare``, ``shoal``, ``shoal-nocheck`` (``skip_nonfinite=False``) and
``torch`` in rotating blocks in the same processes (the overhead bench's
method and its helpers), then profiles 5 steps of ``shoal`` and ``torch`` and
prints the top CPU-side ops of each.

    PYTHONPATH=. python docs/benchmarks/gpu_overhead_variants.py --workers 1,2
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from shoal.bench.overhead import Workload, _block, _join_nccl
from shoal.testing import run_workers

COLUMNS = ("bare", "shoal", "shoal-nocheck", "torch")


def _profile(work: Workload, model: Any, opt: Any) -> str:
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(7)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _block(work, model, opt, 5, g, [])
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48)


def _worker(rank: int, world: int, steps: int, rounds: int) -> dict[str, Any]:
    gpu = _join_nccl(rank, world, 600.0)
    try:
        work = Workload("gpt", device=f"cuda:{gpu}")
        torch.manual_seed(0)
        base = work.build().to(work.device)
        models = {"bare": copy.deepcopy(base),
                  "shoal": shoal.DistributedDataParallel(copy.deepcopy(base), device_ids=[gpu]),
                  "shoal-nocheck": shoal.DistributedDataParallel(copy.deepcopy(base), device_ids=[gpu],
                                                                 skip_nonfinite=False),
                  "torch": TorchDDP(copy.deepcopy(base), device_ids=[gpu])}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in COLUMNS}
        for k in COLUMNS:
            _block(work, models[k], opts[k], 3, torch.Generator().manual_seed(rank), [])
        for r in range(rounds):
            order = list(COLUMNS[r % 4:] + COLUMNS[:r % 4])
            for k in order:
                times[k] += _block(work, models[k], opts[k], steps, torch.Generator().manual_seed(r), [])
        out: dict[str, Any] = {"median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}
        if rank == 0 and world == 1:
            out["profile"] = {k: _profile(work, models[k], opts[k]) for k in ("shoal", "torch")}
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    for world in (int(w) for w in args.workers.split(",")):
        r = run_workers(_worker, world, args.steps, args.rounds, timeout=900, init_group=False)[0]
        ms = r["median_ms"]
        print(f"world {world}: " + "  ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
              + f"  shoal/torch {ms['shoal'] / ms['torch']:.3f}  nocheck/torch {ms['shoal-nocheck'] / ms['torch']:.3f}",
              flush=True)
        for name, table in r.get("profile", {}).items():
            print(f"--- profile, world 1, {name}, 5 steps\n{table}", flush=True)


if __name__ == "__main__":
    main()
