"""Step time of shoal's DDP against torch's DDP, measured in one run.

Both wrappers live in the same worker processes and train alternately in
blocks of steps, so machine noise hits both alike; the figure reported is the
ratio of median step times. Bytes per step are the meter's count, checked
against the ring formula ``2(N-1)/N * gradient bytes``.

    python -m shoal.bench.overhead --workers 2 --steps 20 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from shoal.comm.meter import wire_bytes
from shoal.testing import run_workers


def mlp() -> nn.Module:
    """~5.2M parameters: 256 -> 2048 -> 2048 -> 256."""
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 256))


class TinyTransformer(nn.Module):
    """~3.3M parameters: 4 pre-norm encoder layers, d=256, on 64 tokens of 256 symbols."""

    def __init__(self, vocab: int = 256, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def _batch(task: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if task == "mlp":
        return torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    x = torch.randint(0, 256, (8, 64), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _loss(task: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if task == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _block(task: str, model: nn.Module, opt: torch.optim.Optimizer, steps: int,
           g: torch.Generator, losses: list[float]) -> list[float]:
    times = []
    for _ in range(steps):
        x, y = _batch(task, g)
        t0 = time.perf_counter()
        loss = _loss(task, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times


def _worker(rank: int, world: int, task: str, steps: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = mlp() if task == "mlp" else TinyTransformer()
    ours = shoal.DistributedDataParallel(copy.deepcopy(base))
    models: dict[str, nn.Module] = {"shoal": ours, "torch": TorchDDP(copy.deepcopy(base))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"shoal": [], "torch": []}
    losses: dict[str, list[float]] = {"shoal": [], "torch": []}
    for k in models:  # warm-up: allocator, gloo connections
        _block(task, models[k], opts[k], 3, g, [])
    for r in range(rounds):
        order = ["shoal", "torch"] if r % 2 == 0 else ["torch", "shoal"]
        for k in order:
            # Same data for both wrappers: each block replays the same seed.
            gk = torch.Generator().manual_seed(1000 * r + rank)
            times[k] += _block(task, models[k], opts[k], steps, gk, losses[k])
    numel = sum(p.numel() for p in base.parameters())
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "final_loss": {k: v[-1] for k, v in losses.items()},
        "params": numel,
        "bytes_sent_per_step": ours.comm_stats().last.bytes_sent,
        "formula_bytes": sum(wire_bytes("all_reduce", b.buffer.numel() * 4, world)[0] for b in ours.reducer.buckets),
        "ring_bound_bytes": 2 * (world - 1) * numel * 4 // world,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per wrapper")
    ap.add_argument("--tasks", default="mlp,transformer")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    results = {}
    print(f"{args.workers} workers on loopback; {args.rounds} alternating blocks of {args.steps} steps per wrapper")
    print(f"{'task':<12} {'params':>9} {'shoal ms':>9} {'torch ms':>9} {'ratio':>6} {'shoal loss':>10} "
          f"{'torch loss':>10} {'MB/step':>8} {'formula MB':>10}")
    for task in args.tasks.split(","):
        r = run_workers(_worker, args.workers, task, args.steps, args.rounds, timeout=1800)[0]
        ratio = r["median_s"]["shoal"] / r["median_s"]["torch"]
        results[task] = dict(r, ratio=ratio)
        print(f"{task:<12} {r['params']:>9,} {1e3 * r['median_s']['shoal']:>9.1f} {1e3 * r['median_s']['torch']:>9.1f} "
              f"{ratio:>6.3f} {r['final_loss']['shoal']:>10.4f} {r['final_loss']['torch']:>10.4f} "
              f"{r['bytes_sent_per_step'] / 1e6:>8.3f} {r['formula_bytes'] / 1e6:>10.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
