"""Every codec's non-finite contract over a real 3-rank gloo group: a NaN/+-Inf that any one rank
sends makes the mean non-finite on every rank (so DDP's one fused check of the averaged buckets
gives every rank the same verdict), while a finite call stays finite."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

from shoal.codecs import (Cast, ErrorFeedback, Hierarchical, Identity, Int8Blockwise, PowerSGD, SizeAdaptive, SparseLoCo,
                          TopK)
from shoal.comm import Group
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.testing import run_workers

pytestmark = pytest.mark.timeout(120)

SHAPES = [(24, 10), (7,), (5, 3, 3), (333,)]
NAMES = ["l1.w", "l1.b", "conv.w", "v"]

CODECS: dict[str, Callable[[], Any]] = {
    "identity": Identity,
    "fp16": lambda: Cast(torch.float16),
    "bf16": lambda: Cast(torch.bfloat16),
    "int8_gather": lambda: Int8Blockwise(block_size=16, method="all_gather"),
    "int8_scatter": lambda: Int8Blockwise(block_size=16, method="reduce_scatter"),
    "topk": lambda: TopK(0.01),   # 4 of 670 elements: the bad one must still travel
    "topk_ef": lambda: ErrorFeedback(TopK(0.01)),
    "sparseloco": lambda: SparseLoCo(0.01, 2, 128),   # 2 of each 128-element chunk: the bad one among them
    "powersgd": lambda: PowerSGD(rank=1, min_compression_rate=1.0),   # low-rank for every matrix
    "powersgd_plain": lambda: PowerSGD(rank=4),                        # small ones go uncompressed
    "adaptive": lambda: SizeAdaptive(Identity(), ErrorFeedback(Int8Blockwise(16)), threshold=100),
    "hier_topk": lambda: Hierarchical(ErrorFeedback(TopK(0.01))),
    "hier_exact": lambda: Hierarchical(Identity()),
}
# (tensor, flat position) a bad rank poisons: a low-rank matrix, a small vector, a 4-d tensor, a long vector
SPOTS = [(0, 17), (1, 3), (2, 40), (3, 300)]


def _data(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _worker(rank: int, world: int) -> dict[str, Any]:
    os.environ["SHOAL_HOST_ID"] = f"host-{rank // 2}"  # ranks 0, 1 on one host, rank 2 on another
    group = Group()
    out: dict[str, Any] = {}
    for name, make in CODECS.items():
        codec = make()
        step = 0
        for bad in range(world):
            for value in (float("nan"), float("inf"), float("-inf")):
                for t, pos in SPOTS:
                    ts = _data(rank, step)
                    step += 1
                    if rank == bad:
                        ts[t].view(-1)[pos] = value
                    codec.mean(ts, NAMES, group, name)
                    out[f"{name}/bad{bad}/{value}/t{t}"] = read_flag(nonfinite_flag(ts))
        ts = _data(rank, step)
        codec.mean(ts, NAMES, group, name)
        out[f"{name}/finite_after"] = not read_flag(nonfinite_flag(ts))
    return out


def test_any_rank_nonfinite_makes_every_rank_mean_nonfinite() -> None:
    results = run_workers(_worker, 3, timeout=100)
    for rank, res in enumerate(results):
        missed = [k for k, v in res.items() if not v]
        assert not missed, f"rank {rank}: {missed[:8]}"
