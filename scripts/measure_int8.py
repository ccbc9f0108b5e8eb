"""Int8Blockwise design choice: all-gather vs quantized reduce-scatter + all-gather.

Run: PYTHONPATH=. python scripts/measure_int8.py [numel]
Prints, per world size, bytes sent per rank (textbook ring model, as the meter
counts them), max and RMS error against the true mean, and wall time per call
on loopback gloo (CPU-bound here: it says nothing about a slow network).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from shoal.codecs.int8 import dequantize_blocks, quantize_blocks
from shoal.comm.meter import wire_bytes
from shoal.testing import run_workers

B = 256


def _q(x: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(x.numel() // B * (B + 4), dtype=torch.uint8)
    quantize_blocks(x, B, buf)
    return buf


def all_gather_mean(x: torch.Tensor, world: int) -> torch.Tensor:
    mine = _q(x)
    out = torch.empty(world * mine.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(out, mine)
    rows = out.view(world, -1)
    return sum(dequantize_blocks(rows[r], B) for r in range(world)) / world


def rs_ag_mean(x: torch.Tensor, world: int) -> torch.Tensor:
    chunks = x.view(world, -1)
    send = torch.cat([_q(c) for c in chunks])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # quantized "reduce-scatter": chunk r goes to rank r
    part = sum(dequantize_blocks(c, B) for c in recv.view(world, -1)) / world
    mine = _q(part)  # second quantization
    out = torch.empty(world * mine.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(out, mine)
    return torch.cat([dequantize_blocks(c, B) for c in out.view(world, -1)])


def worker(rank: int, world: int, numel: int) -> dict:
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    true = sum(xs) / world
    res = {}
    for name, fn in [("all_gather", all_gather_mean), ("rs+ag", rs_ag_mean)]:
        fn(xs[rank], world)  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            out = fn(xs[rank], world)
        err = out - true
        res[name] = (time.perf_counter() - t0) / 5, float(err.abs().max()), float(err.pow(2).mean().sqrt())
    return res


if __name__ == "__main__":
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 2**20
    q = numel // B * (B + 4)
    for world in (2, 3, 4):
        r = run_workers(worker, world, numel)[0]
        ag_sent = wire_bytes("all_gather", q, world)[0]
        rs_sent = wire_bytes("all_gather", q // world, world)[0] + (world - 1) * q // world
        for name, sent in (("all_gather", ag_sent), ("rs+ag", rs_sent)):
            t, mx, rms = r[name]
            print(f"world={world} {name:10s} sent/rank={sent / 4 / numel:.3f} x fp32 bytes "
                  f"max_err={mx:.5f} rms_err={rms:.6f} time={t * 1e3:.1f} ms")
