"""torch.amp.GradScaler with one rank overflowing, under every strategy (issue 23).

GradScaler skips ``optimizer.step()`` on a rank whose scaled gradients hold an
Inf. Before the fix, under a local strategy only that rank skipped the call,
so its step counter fell behind (LocalSGD: rank 0 at step 5, rank 1 at 6;
averaging rounds then paired different steps, DiLoCo crashed). Now shoal's
optimizer takes GradScaler's verdict itself: the update is skipped on the
overflowing rank, the strategy's schedule moves on every rank.

Rank 1 feeds an Inf input at step ``BAD`` (its gradients overflow). Each
strategy runs twice: under a GradScaler (scale 1.0, so scaling is exact) and
without one, where shoal's own non-finite skip (SPEC G5, checked against
torch's DDP, torch's averagers and a plain DiLoCo loop in
test_nonfinite_strategies.py) leaves the same update out. Both runs must end
with the same parameters; LocalSGD is also checked against torch's own
averager with rank 1's update simply left out. The steps after which the
ranks hold equal parameters (the schedule's synchronisations) must be the
same in both runs, and there must be one after the overflow.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.errors import ShoalError
from shoal.testing import run_workers
from models import Net, make_optimizer, max_diff

STEPS = 8
BAD = 2
INF = float("inf")


def _batches(rank: int, poison: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]
    if poison and rank == 1:
        out[BAD][0][0, 0] = INF
    return out


def _spread(module: nn.Module) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).max())


def _run(base: nn.Module, rank: int, make: Callable[[], shoal.Strategy], scaler: bool,
         after: Callable[[shoal.Strategy], None] = lambda s: None) -> tuple[nn.Module, list[bool], list[bool]]:
    """Train STEPS steps with rank 1's Inf input; return the module and, per step, whether this rank's
    parameters stayed unchanged and whether all ranks held equal parameters after it."""
    module = copy.deepcopy(base)
    strategy = make()
    model, opt = shoal.wrap(module, make_optimizer("sgd", module.parameters()), strategy)
    gs = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000) if scaler else None
    skipped, equal = [], []
    for x, y in _batches(rank, poison=True):
        loss = F.mse_loss(model(x), y)
        before = [p.detach().clone() for p in module.parameters()]
        if gs is None:
            loss.backward()
            opt.step()
        else:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        opt.zero_grad()
        after(strategy)
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, module.parameters())))
        equal.append(_spread(module) == 0.0)
    strategy.close()
    return module, skipped, equal


CASES: dict[str, Callable[[], shoal.Strategy]] = {
    "ddp": lambda: shoal.strategies.Sync(),
    "codec": lambda: shoal.strategies.Sync(codec=shoal.codecs.Cast(torch.bfloat16)),
    "localsgd": lambda: shoal.LocalSGD(period=2),
    "postlocal/warmup": lambda: shoal.PostLocalSGD(period=2, warmup_steps=4),
    "postlocal/local": lambda: shoal.PostLocalSGD(period=2, warmup_steps=1),
    "hierarchical": lambda: shoal.Hierarchical({2: 1, 4: 2}),
    "diloco": lambda: shoal.DiLoCo(inner_steps=4),
    "streaming": lambda: shoal.StreamingDiLoCo(inner_steps=4, fragments=2, overlap_steps=0),
    "daso": lambda: shoal.DASO(total_epochs=2, steps_per_epoch=4, warmup_epochs=0, cooldown_epochs=0,
                               max_global_skips=2),
}


def _torch_localsgd(base: nn.Module, rank: int) -> nn.Module:
    """torch's PeriodicModelAverager; rank 1's update at BAD left out, the averager called every step."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    ref = copy.deepcopy(base)
    opt = make_optimizer("sgd", ref.parameters())
    averager = PeriodicModelAverager(period=2, warmup_steps=0)
    for step, (x, y) in enumerate(_batches(rank, poison=False)):
        F.mse_loss(ref(x), y).backward()
        if not (step == BAD and rank == 1):
            opt.step()
        averager.average_parameters(ref.parameters())  # (torch averages only parameters with a .grad)
        opt.zero_grad()
    return ref


def _nonblocking(base: nn.Module) -> str:
    module = copy.deepcopy(base)
    model, opt = shoal.wrap(module, make_optimizer("sgd", module.parameters()), shoal.NonBlocking())
    gs = torch.amp.GradScaler("cpu", init_scale=1.0)
    x, y = _batches(0, poison=False)[0]
    gs.scale(F.mse_loss(model(x), y)).backward()
    try:
        gs.step(opt)
    except ShoalError as e:
        return str(e)
    finally:
        opt.strategy.close()
    return ""


def _zero(base: nn.Module, rank: int) -> dict[str, Any]:
    """shoal's ZeroRedundancyOptimizer after shoal's DDP, stepped by GradScaler: the Inf reaches every
    rank's averaged gradients, so all skip (as without a scaler); overlapped with DDP: refused."""
    finals = []
    for scaler in (True, False):
        net = copy.deepcopy(base)
        zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
        model = shoal.DistributedDataParallel(net)
        gs = torch.amp.GradScaler("cpu", init_scale=1.0) if scaler else None
        for x, y in _batches(rank, poison=True):
            loss = F.mse_loss(model(x), y)
            if gs is None:
                loss.backward()
                zero.step()
            else:
                gs.scale(loss).backward()
                gs.step(zero)
                gs.update()
            zero.zero_grad()
        finals.append(net)
    out: dict[str, Any] = {"diff": max_diff(finals[0], finals[1]), "spread": _spread(finals[0])}
    net = copy.deepcopy(base)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.05)
    model = shoal.DistributedDataParallel(net, optimizer=zero)
    gs = torch.amp.GradScaler("cpu")
    x, y = _batches(rank, poison=False)[0]
    gs.scale(F.mse_loss(model(x), y)).backward()
    try:
        gs.step(zero)
        out["overlap"] = ""
    except ShoalError as e:
        out["overlap"] = str(e)
    return out


def _all(rank: int, world: int) -> dict[str, Any]:
    # DASO on one host of both ranks: it refuses hosts of a single worker among several (docs/daso.md), so
    # its global sync between hosts is not exercised here (tests/dist/test_daso_dist.py runs 2 hosts x 2).
    os.environ["SHOAL_HOST_ID"] = "host-0"
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite skip warnings of the reference runs
        for name, make in CASES.items():
            report = (lambda s: s.report_loss(1.0)) if name == "daso" else (lambda s: None)
            scaled, skipped, equal = _run(base, rank, make, scaler=True, after=report)
            plain, plain_skipped, plain_equal = _run(base, rank, make, scaler=False, after=report)
            out[name] = {"diff": max_diff(scaled, plain), "skipped": skipped, "plain_skipped": plain_skipped,
                         "equal": equal, "plain_equal": plain_equal}
            if name == "localsgd":
                out[name]["torch"] = max_diff(scaled, _torch_localsgd(base, rank))
        out["nonblocking"] = _nonblocking(base)
        out["zero"] = _zero(base, rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_all, 2, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_one_rank_overflowing_keeps_the_schedule(results: list[dict[str, Any]], name: str) -> None:
    for rank, r in enumerate(results):
        s = r[name]
        # Same parameters as shoal's own non-finite skip of that update (bf16 on the wire: a rounding apart).
        assert s["diff"] <= (1e-3 if name == "codec" else 0.0), (name, rank, s["diff"])
        assert s["skipped"][BAD] == s["plain_skipped"][BAD], (name, rank, s["skipped"])
        # The ranks synchronise after the same steps, one of them after the overflow (streaming: one
        # fragment at a time, so whole models are never equal after the first round).
        assert s["equal"] == s["plain_equal"], (name, rank, s["equal"], s["plain_equal"])
        if name != "streaming":
            assert any(s["equal"][BAD + 1:]), (name, rank, s["equal"])


@pytest.mark.timeout(180)
def test_localsgd_overflow_matches_torch_averager_without_the_update(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["localsgd"]["torch"] == 0.0, (rank, r["localsgd"]["torch"])


@pytest.mark.timeout(180)
def test_nonblocking_refuses_grad_scaler_with_the_alternative(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "GradScaler" in r["nonblocking"] and "Sync" in r["nonblocking"], r["nonblocking"]


@pytest.mark.timeout(180)
def test_zero_under_grad_scaler_skips_together_and_refuses_overlap(results: list[dict[str, Any]]) -> None:
    for r in results:
        z = r["zero"]
        assert z["diff"] == 0.0 and z["spread"] == 0.0, z
        assert "optimizer=" in z["overlap"] and "scaler.step(zero)" in z["overlap"], z["overlap"]
