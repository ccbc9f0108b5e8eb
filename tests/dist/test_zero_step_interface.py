"""ZeroRedundancyOptimizer runs the group's step interface on a static group too, at no extra copy.

One code path for static and elastic groups: each ZeRO step ends with
``group.commit()`` (so the group's ``on_commit`` hooks run once per step on a
static group as on an elastic one), and what a step changes is recorded in a
journal only where it may be undone: never on a static group's plain step,
and overlapped only under ``skip_nonfinite`` (a non-finite verdict undoes the
buckets). DDP attaches any :class:`shoal.reducer.BucketStepper`, not only ZeRO.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.optim import zero_layout
from shoal.reducer import BucketStepper, Reducer
from shoal.testing import run_workers

CAP_MB = 0.0003
STEPS = 3


def _train(model: Any, zero: Any, rank: int) -> None:
    """STEPS steps of the ZeRO loop (a regression target on this rank's inputs), then the last broadcast."""
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=gen)
        F.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        zero.step()
        zero.zero_grad()
    zero.wait_for_params()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _run(mode: str, rank: int) -> dict[str, Any]:
    """``STEPS`` steps of ZeRO on a static group; what the group and the journal saw, and the result."""
    recorded = [0]
    original = zero_layout.Journal.record

    def counting(self: zero_layout.Journal, opt: torch.optim.Optimizer, params: Any) -> None:
        recorded[0] += len(params)
        original(self, opt, params)

    zero_layout.Journal.record = counting  # type: ignore[method-assign]
    try:
        group = shoal.Group()
        commits = [0]
        group.on_commit(lambda: commits.__setitem__(0, commits[0] + 1))
        net = _net()
        ref = copy.deepcopy(net)
        zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, process_group=group, lr=1e-2)
        overlap = mode != "plain"
        model = shoal.DistributedDataParallel(net, process_group=group, bucket_cap_mb=CAP_MB,
                                              optimizer=zero if overlap else None,
                                              skip_nonfinite=mode == "overlap-skip-nonfinite")
        _train(model, zero, rank)
    finally:
        zero_layout.Journal.record = original  # type: ignore[method-assign]
    return {"commits": commits[0], "stats": zero.stats.commits, "recorded": recorded[0],
            "params": [p.detach().clone() for p in net.parameters()], "moved": any(
                not torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))}


class _Listener:
    """Not an optimizer: anything with attach_to_reducer is a BucketStepper."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.attached: tuple[Reducer, nn.Module] | None = None

    def attach_to_reducer(self, reducer: Reducer, module: nn.Module) -> None:
        self.attached = (reducer, module)
        reducer.on_bucket_reduced = lambda bucket: self.seen.append(bucket.index())


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {mode: _run(mode, rank) for mode in ("plain", "overlap", "overlap-skip-nonfinite")}
    listener = _Listener()
    assert isinstance(listener, BucketStepper)
    net = _net()
    model = shoal.DistributedDataParallel(net, bucket_cap_mb=CAP_MB, optimizer=listener)  # type: ignore[arg-type]
    model(torch.randn(4, 16)).sum().backward()
    out["listener"] = {"seen": listener.seen, "buckets": len(model.reducer.buckets),
                       "attached": listener.attached is not None and listener.attached[0] is model.reducer
                       and listener.attached[1] is net}
    return out


@pytest.mark.timeout(90)
def test_zero_ends_every_step_with_commit_on_a_static_group_and_copies_nothing_it_cannot_need() -> None:
    results = run_workers(_worker, 2, timeout=80)
    for rank, r in enumerate(results):
        for mode in ("plain", "overlap", "overlap-skip-nonfinite"):
            assert r[mode]["moved"], f"rank {rank} {mode}: training did not move the weights"
            # group.commit() ended every step: the static group's on_commit hooks ran once per step
            assert r[mode]["commits"] == STEPS and r[mode]["stats"] == STEPS, (rank, mode, r[mode])
        assert r["plain"]["recorded"] == 0 and r["overlap"]["recorded"] == 0   # no copy on the static path
        assert r["overlap-skip-nonfinite"]["recorded"] > 0   # kept for a non-finite undo, as before
        assert r["listener"]["attached"] and r["listener"]["seen"] == list(range(r["listener"]["buckets"]))
    for mode in ("plain", "overlap", "overlap-skip-nonfinite"):   # every rank holds the same parameters
        for a, b in zip(results[0][mode]["params"], results[1][mode]["params"]):
            assert torch.equal(a, b), mode


def _subgroup_worker(rank: int, world: int) -> list[torch.Tensor] | None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pg = dist.new_group([0, 1])    # every rank of the world takes part in this one
    if rank == 2:
        return None                # and in nothing else: the overlapped ZeRO's broadcast group must not need it
    group = shoal.Group(pg)
    net = _net()
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
    model = shoal.DistributedDataParallel(net, process_group=group, bucket_cap_mb=CAP_MB, optimizer=zero)
    _train(model, zero, rank)
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.timeout(90)
def test_overlapped_zero_on_a_subgroup_of_the_world_needs_no_other_rank() -> None:
    results = run_workers(_subgroup_worker, 3, timeout=60)
    assert results[2] is None
    assert any(not torch.equal(a, b) for a, b in zip(results[0], _net().parameters()))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
