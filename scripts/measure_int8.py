"""Int8Blockwise's two methods: all-gather vs quantized reduce-scatter + all-gather.

Run: PYTHONPATH=. python scripts/measure_int8.py [numel]
Runs the codec itself (``method`` forced each way) on loopback gloo and
prints, per world size, bytes sent per rank per call (the group's meter) as a
fraction of the fp32 tensor's bytes and against fp32's ring all-reduce, max
and RMS error against the true mean, wall time per call (CPU-bound here: it
says nothing about a slow network) and what ``method="auto"`` picks.
"""

from __future__ import annotations

import sys
import time

import torch

from shoal.codecs import Int8Blockwise
from shoal.comm import Group, wire_bytes
from shoal.testing import run_workers

B = 256
CALLS = 5


def worker(rank: int, world: int, numel: int) -> dict:
    group = Group()
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    true = sum(xs) / world
    res = {}
    for method in ("all_gather", "reduce_scatter"):
        codec = Int8Blockwise(B, method=method)
        codec.mean([xs[rank].clone()], ["x"], group, "warmup")
        t0 = time.perf_counter()
        for _ in range(CALLS):
            out = xs[rank].clone()
            codec.mean([out], ["x"], group, method)
        err = out - true
        sent = group.meter.counters(method).bytes_sent / CALLS
        res[method] = (sent, (time.perf_counter() - t0) / CALLS, float(err.abs().max()), float(err.pow(2).mean().sqrt()))
    return res


if __name__ == "__main__":
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 2**20
    for world in (2, 3, 4):
        r = run_workers(worker, world, numel)[0]
        fp32_ring = wire_bytes("all_reduce", 4 * numel, world)[0]
        for method, (sent, t, mx, rms) in r.items():
            print(f"world={world} {method:14s} sent/rank={sent / 4 / numel:.3f} x fp32 tensor "
                  f"({fp32_ring / sent:.2f}x under fp32 ring) max_err={mx:.4f} rms_err={rms:.5f} time={t * 1e3:.1f} ms")
        print(f"world={world} auto picks {Int8Blockwise(B).method_for(numel, world)}")
