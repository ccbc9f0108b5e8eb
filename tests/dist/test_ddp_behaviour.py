"""Model checks, accounting and errors of shoal's DDP with real workers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shoal
from shoal.comm.meter import wire_bytes
from shoal.errors import ModelMismatchError, ShoalError
from shoal.testing import run_workers
from models import Net


def _mismatch(rank: int, world: int) -> str:
    width = 32 if rank != 1 else 33
    try:
        shoal.DistributedDataParallel(Net(width=width))
    except ModelMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_mismatched_models_raise_on_every_rank() -> None:
    messages = run_workers(_mismatch, 3, timeout=45)
    for msg in messages:
        assert "fc1.weight" in msg and "rank 1" in msg and "[33, 16]" in msg, msg


def _stats(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = shoal.DistributedDataParallel(Net(bn=True), bucket_cap_mb=0.002)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for _ in range(3):
        nn.functional.mse_loss(model(x), y).backward()
    grad_bytes = [b.buffer.numel() * b.buffer.element_size() for b in model.reducer.buckets]
    buf_bytes = sum(b.numel() * b.element_size() for b in model.module.buffers())
    return {
        "stats": model.comm_stats().as_dict(),
        "grad_bytes": grad_bytes,
        "buf_bytes": buf_bytes,
        "buckets": len(grad_bytes),
    }


@pytest.mark.timeout(60)
def test_comm_stats_count_exact_bytes() -> None:
    world = 3
    for rank, r in enumerate(run_workers(_stats, world)):
        assert r["buckets"] > 1
        grad_sent = sum(wire_bytes("all_reduce", b, world)[0] for b in r["grad_bytes"])
        # BatchNorm buffers: one coalesced broadcast per dtype (float stats, int64 counter).
        float_buf = r["buf_bytes"] - 8
        buf_sent = sum(wire_bytes("broadcast", b, world, rank)[0] for b in (float_buf, 8))
        last = r["stats"]["last"]
        assert last["payload_bytes"] == sum(r["grad_bytes"]) + r["buf_bytes"]
        assert last["bytes_sent"] == grad_sent + buf_sent
        assert last["ops"] == r["buckets"] + 2
        assert r["stats"]["total"]["ops"] == 3 * last["ops"]
        assert last["wait_seconds"] >= 0


def _missing_grad(rank: int, world: int) -> str:
    model = shoal.DistributedDataParallel(Net(extra=True))
    try:
        model(torch.randn(2, 16)).sum().backward()
    except ShoalError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_unused_parameter_without_find_unused_is_a_clear_error() -> None:
    for msg in run_workers(_missing_grad, 2):
        assert "extra.weight" in msg and "find_unused_parameters=True" in msg


def _unused_everywhere(rank: int, world: int) -> bool:
    model = shoal.DistributedDataParallel(Net(extra=True), find_unused_parameters=True)
    model(torch.randn(2, 16)).sum().backward()
    # As in torch DDP, a parameter no rank used keeps no gradient.
    return model.module.extra.weight.grad is None and model.module.fc1.weight.grad is not None


@pytest.mark.timeout(60)
def test_parameter_unused_on_all_ranks_keeps_no_grad() -> None:
    assert run_workers(_unused_everywhere, 2) == [True, True]
