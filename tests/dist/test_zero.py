"""ZeroRedundancyOptimizer against torch's and against unsharded optimizers, world 2 and 3."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import shoal
from shoal.optim.zero import ZeroRedundancyOptimizer
from shoal.testing import run_workers
from models import Net, max_diff, train

CAP_MB = 0.0003  # ~78 floats: Net falls into 3 buckets (head, fc2, fc1), one per rank at world 3
OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], float]] = {
    # kind -> (class, defaults, head's lr)
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, 0.01),
    "adam": (torch.optim.Adam, {"lr": 1e-3}, 3e-3),
}


def two_groups(model: nn.Module, head_lr: float) -> list[dict[str, Any]]:
    """Body and head with different learning rates."""
    named = dict(model.named_parameters())
    head = [named.pop("out.weight"), named.pop("out.bias")]
    return [{"params": list(named.values())}, {"params": head, "lr": head_lr}]


def _base(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # different on every rank: DDP must broadcast rank 0's
    return Net()


def _differential(rank: int, world: int) -> dict[str, float]:
    out: dict[str, float] = {}
    base = _base(rank)
    for kind, (cls, defaults, head_lr) in OPTS.items():
        ref = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        ref_opt = cls(two_groups(ref.module, head_lr), **defaults)
        theirs = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        torch_zero = TorchZero(two_groups(theirs.module, head_lr), cls, **defaults)
        plain = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        zero_plain = ZeroRedundancyOptimizer(two_groups(plain.module, head_lr), cls, **defaults)
        module = copy.deepcopy(base)
        zero_overlap = ZeroRedundancyOptimizer(two_groups(module, head_lr), cls, **defaults)
        overlap = shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, optimizer=zero_overlap)
        runs = [(ref, ref_opt), (theirs, torch_zero), (plain, zero_plain), (overlap, zero_overlap)]
        for model, opt in runs:
            train(model, opt, rank, steps=30)
        zero_overlap.wait_for_params()
        out[f"{kind}/plain_vs_torch_zero"] = max_diff(plain.module, theirs.module)
        out[f"{kind}/plain_vs_unsharded"] = max_diff(plain.module, ref.module)
        out[f"{kind}/overlap_vs_unsharded"] = max_diff(overlap.module, ref.module)
        out[f"{kind}/moved"] = max_diff(ref.module, base)
        out[f"{kind}/buckets"] = len(overlap.reducer.buckets)
        # The shard really is a shard: this rank holds state for fewer parameters than exist.
        out[f"{kind}/owned"] = sum(1 for s in zero_plain.optim.state.values() if s)
        out[f"{kind}/total"] = sum(len(g["params"]) for g in ref_opt.param_groups)
        out.update(_add_group_later(rank, base, kind))
    return out


def _add_group_later(rank: int, base: nn.Module, kind: str) -> dict[str, float]:
    """The head joins the optimizer after 5 steps (it trains only from then on)."""
    cls, defaults, head_lr = OPTS[kind]
    models = [shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB) for _ in range(2)]
    opts: list[torch.optim.Optimizer] = [cls(two_groups(models[0].module, 0)[:1], **defaults),
                                         ZeroRedundancyOptimizer(two_groups(models[1].module, 0)[:1], cls, **defaults)]
    module = copy.deepcopy(base)
    zero = ZeroRedundancyOptimizer(two_groups(module, 0)[:1], cls, **defaults)
    models.append(shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, optimizer=zero))
    opts.append(zero)
    for model, opt in zip(models, opts):
        train(model, opt, rank, steps=5)
        opt.add_param_group(two_groups(model.module, head_lr)[1])
        train(model, opt, rank, steps=5, seed=3000)
    zero.wait_for_params()
    return {f"{kind}/add_group_plain": max_diff(models[1].module, models[0].module),
            f"{kind}/add_group_overlap": max_diff(models[2].module, models[0].module)}


def _check_differential(world: int, results: list[dict[str, float]]) -> None:
    for rank, r in enumerate(results):
        for kind in OPTS:
            assert r[f"{kind}/moved"] > 1e-3, "training did not move the weights: the comparison would be vacuous"
            assert r[f"{kind}/buckets"] >= world, "too few buckets for every rank to own one"
            assert 0 < r[f"{kind}/owned"] < r[f"{kind}/total"]
            for what in ("plain_vs_torch_zero", "plain_vs_unsharded", "overlap_vs_unsharded",
                         "add_group_plain", "add_group_overlap"):
                d = r[f"{kind}/{what}"]
                assert d <= 1e-6, f"world {world} rank {rank} {kind} {what}: max diff {d:.3g}"


class _Gate(torch.autograd.Function):
    """Identity on the input; its backward (the last of a step) waits until ``watch`` changes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, watch: torch.Tensor, seen: list[bool]) -> torch.Tensor:
        ctx.watch, ctx.before, ctx.seen = watch, watch.detach().clone(), seen
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        deadline = time.monotonic() + 20
        while torch.equal(ctx.watch, ctx.before) and time.monotonic() < deadline:
            time.sleep(0.002)
        ctx.seen.append(not torch.equal(ctx.watch, ctx.before))
        return grad, None, None


class _GatedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.watch: torch.Tensor | None = None
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        if self.watch is not None:
            # detached: an autograd edge to the parameter would hold its gradient back until the gate
            x = _Gate.apply(x.requires_grad_(), self.watch.detach(), self.seen)
        return super().forward(x)


def _codecs_and_overlap(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    base = Net()
    for name, make in {"powersgd": lambda: shoal.codecs.PowerSGD(rank=2, min_compression_rate=1.0),
                       "int8": lambda: shoal.codecs.Int8Blockwise(block_size=64)}.items():
        ref = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB, codec=make())
        ref_opt = torch.optim.Adam(two_groups(ref.module, 3e-3), lr=1e-3)
        module = copy.deepcopy(base)
        zero = ZeroRedundancyOptimizer(two_groups(module, 3e-3), torch.optim.Adam, lr=1e-3)
        ours = shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, codec=make(), optimizer=zero)
        exact = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        for model, opt in ((ref, ref_opt), (ours, zero),
                           (exact, torch.optim.Adam(two_groups(exact.module, 3e-3), lr=1e-3))):
            train(model, opt, rank, steps=30)
        zero.wait_for_params()  # the last step's broadcasts: no forward follows to wait for them
        out[name] = max_diff(ours.module, ref.module)
        out[name + "/lossy"] = max_diff(ours.module, exact.module)
    # Overlap: the owner of bucket 0 (the head) has stepped it before backward reaches the input.
    module = _GatedNet()
    zero = ZeroRedundancyOptimizer(module.parameters(), torch.optim.SGD, lr=0.1)
    model = shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, optimizer=zero)
    first = model.reducer.buckets[0].params[0]
    if zero._shards.shard.bucket_owner[0] == rank:
        module.watch = first
    train(model, zero, rank, steps=3)
    out["seen"] = module.seen
    out["stepped_none"] = zero.step() is None  # after an overlapped backward: nothing left to do
    return out


def _check_codecs_and_overlap(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for name in ("powersgd", "int8"):
            assert r[name] <= 1e-6, f"rank {rank} {name}: ZeRO+codec differs from Adam+codec by {r[name]:.3g}"
            assert r[name + "/lossy"] > 1e-6, f"{name} did not compress: the comparison would not test it"
        assert r["stepped_none"]
    # Exactly the owner watched, and saw its bucket stepped while backward was still running, every step.
    assert sorted(r["seen"] for r in results) == [[], [True, True, True]]


def _train_then_save(rank: int, world: int, path: str) -> float:
    base = _base(rank)
    module = copy.deepcopy(base)
    zero = ZeroRedundancyOptimizer(two_groups(module, 3e-3), torch.optim.Adam, lr=1e-3)
    model = shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, optimizer=zero)
    ref = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    ref_opt = torch.optim.Adam(two_groups(ref.module, 3e-3), lr=1e-3)
    for m, o in ((model, zero), (ref, ref_opt)):
        train(m, o, rank, steps=10)
    zero.consolidate_state_dict(to=0)
    if rank != 0:
        with pytest.raises(shoal.errors.ShoalError, match="consolidate_state_dict"):
            zero.state_dict()
        return 0.0
    sd = zero.state_dict()
    torch.save({"model": model.module.state_dict(), "opt": sd}, path)
    return _state_diff(sd, ref_opt.state_dict())


def _state_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    if a["state"].keys() != b["state"].keys() or len(a["param_groups"]) != len(b["param_groups"]):
        return float("inf")
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        if ga != gb:
            return float("inf")
    return max((a["state"][i][k].float() - b["state"][i][k].float()).abs().max().item()
               for i in a["state"] for k in a["state"][i])


def _resume(rank: int, world: int, path: str) -> dict[str, float]:
    ckpt = torch.load(path, weights_only=True)
    base = Net()
    base.load_state_dict(ckpt["model"])
    ref = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    ref_opt = torch.optim.Adam(two_groups(ref.module, 3e-3), lr=1e-3)
    ref_opt.load_state_dict(copy.deepcopy(ckpt["opt"]))
    plain = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    zero_plain = ZeroRedundancyOptimizer(two_groups(plain.module, 0.5), torch.optim.Adam, lr=0.5)
    zero_plain.load_state_dict(ckpt["opt"])  # learning rates come from the checkpoint
    module = copy.deepcopy(base)
    zero_overlap = ZeroRedundancyOptimizer(two_groups(module, 3e-3), torch.optim.Adam, lr=1e-3)
    overlap = shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, optimizer=zero_overlap)
    zero_overlap.load_state_dict(ckpt["opt"])
    for m, o in ((ref, ref_opt), (plain, zero_plain), (overlap, zero_overlap)):
        train(m, o, rank, steps=10, seed=2000)
    zero_overlap.consolidate_state_dict(to=1)
    out = {"plain": max_diff(plain.module, ref.module), "moved": max_diff(ref.module, base)}
    out["overlap"] = max(abs(a - b).max().item() for a, b in
                         zip(overlap.state_dict().values(), ref.module.state_dict().values()))
    out["state"] = _state_diff(zero_overlap.state_dict(), ref_opt.state_dict()) if rank == 1 else 0.0
    return out


def _check_resume(results: list[dict[str, float]]) -> None:
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-4
        assert r["plain"] <= 1e-6, f"rank {rank}: resumed ZeRO differs from resumed Adam by {r['plain']:.3g}"
        assert r["overlap"] <= 1e-6, f"rank {rank}: resumed overlapped ZeRO differs by {r['overlap']:.3g}"
        assert r["state"] <= 1e-6, f"rank {rank}: re-sharded state diverged from Adam's by {r['state']:.3g}"


# Spawning workers costs seconds on a shared 2-core machine: each run does several checks.
def _world_2(rank: int, world: int) -> dict[str, Any]:
    return {"diff": _differential(rank, world), "codecs": _codecs_and_overlap(rank, world)}


def _world_3(rank: int, world: int, path: str) -> dict[str, Any]:
    return {"diff": _differential(rank, world), "saved": _train_then_save(rank, world, path)}


@pytest.mark.timeout(150)
def test_world_2_matches_torch_zero_and_unsharded_with_codecs_and_overlap() -> None:
    results = run_workers(_world_2, 2, timeout=140)
    _check_differential(2, [r["diff"] for r in results])
    _check_codecs_and_overlap([r["codecs"] for r in results])


@pytest.mark.timeout(150)
def test_world_3_matches_then_checkpoint_resumes_at_world_2(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "ckpt.pt")
    results = run_workers(_world_3, 3, path, timeout=90)
    _check_differential(3, [r["diff"] for r in results])
    # Consolidated ZeRO state equals the unsharded optimizer's state after the same steps.
    assert results[0]["saved"] <= 1e-6
    _check_resume(run_workers(_resume, 2, path, timeout=50))
