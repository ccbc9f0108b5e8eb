"""NaN/Inf on one rank: every strategy skips what it must, together where ranks share the values (SPEC G5).

Rank 1 feeds a NaN (or an Inf) input at step ``BAD``, which makes its
gradients non-finite, or writes a NaN/Inf into one of its parameters. Each
scenario checks that no rank's parameters are non-finite where the strategy
says they are clean, that ranks agree where the schedule says they do, the
``nonfinite_skips`` counters, and, where one exists, an independent
reference: torch's DDP / averagers / post-local SGD, or a plain DiLoCo loop,
with the bad step simply left out.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections import OrderedDict
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.testing import run_workers
from models import Net, make_optimizer, max_diff

STEPS = 9
BAD = 2  # the step at which rank 1 goes non-finite
NAN, INF = float("nan"), float("inf")


def _batches(rank: int, poison: float | None = None, at: int = BAD) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]
    if poison is not None and rank == 1:
        out[at][0][0, 0] = poison
    return out


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _spread(model: nn.Module) -> float:
    """Largest difference of a parameter across ranks (0: all equal)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).max())


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, skip: Callable[[int], bool] = lambda s: False,
           after_step: Callable[[int], None] = lambda s: None) -> dict[str, list]:
    """Train; ``skip(step)``: leave out the optimizer update (the reference's way of omitting a bad step)."""
    finite, spread = [], []
    for step, (x, y) in enumerate(batches):
        F.mse_loss(model(x), y).backward()
        if not skip(step):
            opt.step()
        after_step(step)
        opt.zero_grad()
        finite.append(_finite(model))
        spread.append(_spread(model))
    return {"finite": finite, "spread": spread}


def _wrap(base: nn.Module, strategy: shoal.Strategy, kind: str = "sgd") -> tuple[nn.Module, Any, nn.Module]:
    module = copy.deepcopy(base)
    model, opt = shoal.wrap(module, make_optimizer(kind, module.parameters()), strategy)
    return model, opt, module


def _skips(strategy: shoal.Strategy) -> int:
    return strategy.comm_stats().total.nonfinite_skips


def _sync(rank: int, base: nn.Module, poison: float) -> dict[str, Any]:
    """Default strategy (shoal's DDP): the mean gradient is NaN everywhere, every rank skips step BAD."""
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = make_optimizer("adam", ref.parameters())
    _train(ref, ref_opt, _batches(rank), skip=lambda s: s == BAD)
    model, opt, module = _wrap(base, shoal.strategies.Sync(), "adam")
    run = _train(model, opt, _batches(rank, poison))
    return {"diff": max_diff(module, ref.module), "skips": _skips(opt.strategy), **run}


def _localsgd(rank: int, base: nn.Module) -> dict[str, Any]:
    """A local NaN gradient: only rank 1 skips its step; the averaging schedule goes on (torch's averager)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager as TorchPeriodic

    ref = copy.deepcopy(base)
    ref_opt = make_optimizer("sgd", ref.parameters())
    ref_avg = TorchPeriodic(period=3, warmup_steps=1)
    _train(ref, ref_opt, _batches(rank), skip=lambda s: s == BAD and rank == 1,
           after_step=lambda s: ref_avg.average_parameters(ref.parameters()))
    model, opt, module = _wrap(base, shoal.LocalSGD(period=3, warmup_steps=1))
    run = _train(model, opt, _batches(rank, NAN))
    return {"diff": max_diff(module, ref), "skips": _skips(opt.strategy), **run}


def _localsgd_nan_param(rank: int, base: nn.Module) -> dict[str, Any]:
    """A NaN *parameter* on rank 1: its steps are skipped, then the averaging leaves it out and heals it."""
    model, opt, module = _wrap(base, shoal.LocalSGD(period=3, warmup_steps=1))
    local: list[torch.Tensor] = []  # parameters after each local update, before the strategy's averaging
    opt.optimizer.register_step_post_hook(lambda *_: local.append(_flat(module)))
    out: dict[str, Any] = {}

    def after(step: int) -> None:
        if step == 4:
            out["after4"], out["left_out4"] = _flat(module), opt.strategy.averager.last_left_out
        if step == BAD and rank == 1:
            with torch.no_grad():
                module.fc2.weight[0, 0] = NAN

    run = _train(model, opt, _batches(rank), after_step=after)
    return {"skips": _skips(opt.strategy), **run, **out, "local4": local[4] if rank == 0 else None,
            "updates": len(local)}


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _post_local(rank: int, base: nn.Module, poison_at: int, local_size: int | None = None) -> dict[str, Any]:
    """Post-local SGD vs torch's hook + PostLocalSGDOptimizer, a NaN input in warm-up or after it.

    With ``local_size``, gradients are still averaged inside groups of that many ranks after the warm-up.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager as TorchPeriodic
    from torch.distributed.optim import PostLocalSGDOptimizer

    warmup = 4
    sub = dist.new_subgroups(group_size=2)[0]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=sub, start_localSGD_iter=warmup,
                                             post_local_gradient_allreduce=local_size is not None),
                           post_localSGD_hook)
    ref_opt = PostLocalSGDOptimizer(make_optimizer("sgd", ref.parameters()), TorchPeriodic(3, warmup))

    def omitted(step: int) -> bool:  # warm-up: the NaN reaches every rank's gradient; after: rank 1's group's
        return step == poison_at and (poison_at < warmup or rank // (local_size or 1) == 1 // (local_size or 1))

    def keep_count(step: int) -> None:  # PostLocalSGDOptimizer.step() is the update, then the averager
        if omitted(step):
            ref_opt.averager.average_parameters(ref.parameters())

    _train(ref, ref_opt, _batches(rank), skip=omitted, after_step=keep_count)
    model, opt, module = _wrap(base, shoal.PostLocalSGD(period=3, warmup_steps=warmup, local_group_size=local_size))
    run = _train(model, opt, _batches(rank, NAN, at=poison_at))
    return {"diff": max_diff(module, ref.module), "skips": _skips(opt.strategy), **run}


def _diloco_reference(rank: int, base: nn.Module, batches: list, inner_steps: int,
                      skip: Callable[[int], bool]) -> nn.Module:
    """DiLoCo by hand: inner SGD steps, then outer Nesterov SGD on the mean of ``global - local``."""
    model = copy.deepcopy(base)
    inner = make_optimizer("sgd", model.parameters())
    glob = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    for step, (x, y) in enumerate(batches):
        F.mse_loss(model(x), y).backward()
        if not skip(step):
            inner.step()
        inner.zero_grad()
        if (step + 1) % inner_steps == 0:
            for g, p in zip(glob, model.parameters()):
                g.grad = g.detach() - p.detach()
                dist.all_reduce(g.grad)
                g.grad.div_(dist.get_world_size())
            outer.step()
            with torch.no_grad():
                for g, p in zip(glob, model.parameters()):
                    p.copy_(g)
    return model


def _diloco(rank: int, base: nn.Module) -> dict[str, Any]:
    """Inner NaN on rank 1 (a local skip), then an Inf parameter that reaches the outer pseudo-gradient."""
    out: dict[str, Any] = {}
    ref = _diloco_reference(rank, base, _batches(rank), 3, skip=lambda s: s == BAD and rank == 1)
    model, opt, module = _wrap(base, shoal.DiLoCo(inner_steps=3))
    run = _train(model, opt, _batches(rank, NAN))
    out["inner"] = {"diff": max_diff(module, ref), "skips": _skips(opt.strategy), **run}

    # Rank 1's parameter goes Inf after step 4 (mid round 2): its steps 5 are skipped (NaN loss),
    # the round's mean pseudo-gradient is non-finite on every rank, every rank skips the outer step
    # and restarts from the unchanged global copy; round 3 runs as if round 2 had never happened.
    strategy = shoal.DiLoCo(inner_steps=3)
    model, opt, module = _wrap(base, strategy)
    globals_at: list[torch.Tensor] = []
    momentum_at: list[torch.Tensor] = []

    def after(step: int) -> None:
        if step == 4 and rank == 1:
            with torch.no_grad():
                module.fc1.weight[0, 0] = INF
        if (step + 1) % 3 == 0:
            f = strategy.fragments[0]
            globals_at.append(f.snapshot.clone())
            state = f.outer.state[f.global_views[0]]
            momentum_at.append(state["momentum_buffer"].clone() if "momentum_buffer" in state else torch.zeros(()))

    run = _train(model, opt, _batches(rank), after_step=after)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    out["outer"] = {"skips": _skips(strategy), **run, "global_unchanged": bool(torch.equal(globals_at[0], globals_at[1])),
                    "momentum_unchanged": bool(torch.equal(momentum_at[0], momentum_at[1])),
                    "global_moved_after": not torch.equal(globals_at[1], globals_at[2]),
                    "final_is_global": bool(torch.equal(flat, globals_at[2]))}
    return out


def _streaming(rank: int, base: nn.Module) -> dict[str, Any]:
    """Streaming DiLoCo (2 fragments, overlap 1): a NaN gradient, then an Inf parameter in fragment 0."""
    strategy = shoal.StreamingDiLoCo(inner_steps=4, fragments=2, overlap_steps=1, layout="sequential")
    model, opt, module = _wrap(base, strategy)
    frag0 = strategy.fragments[0]
    merged: list[dict[str, Any]] = []

    def after(step: int) -> None:
        if step == 4 and rank == 1:
            with torch.no_grad():
                frag0.params[0][0, 0] = INF
        if step == 6:  # fragment 0 launches after (0-based) steps 1, 5 and merges after steps 2, 6
            merged.append({"frag0": torch.cat([p.detach().reshape(-1) for p in frag0.params]),
                           "global": frag0.snapshot.clone()})

    batches = _batches(rank, NAN, at=1)
    run = _train(model, opt, batches, after_step=after)
    strategy.close()
    return {"skips": _skips(strategy), **run, "frag0": merged[0]["frag0"], "global0": merged[0]["global"],
            "finite_end": _finite(module)}


def _all(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skip warnings, torch's post-local hook logs
        out["sync/nan"] = _sync(rank, base, NAN)
        out["sync/inf"] = _sync(rank, base, INF)
        out["localsgd"] = _localsgd(rank, base)
        out["localsgd/param"] = _localsgd_nan_param(rank, base)
        out["post/warmup"] = _post_local(rank, base, poison_at=1)
        out["post/local"] = _post_local(rank, base, poison_at=5)
        out.update({f"diloco/{k}": v for k, v in _diloco(rank, base).items()})
        out["streaming"] = _streaming(rank, base)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_all, 2, timeout=150)


@pytest.mark.timeout(180)
def test_sync_skips_together_like_torch_ddp_without_the_step(results: list[dict[str, Any]]) -> None:
    for key in ("sync/nan", "sync/inf"):
        for rank, r in enumerate(results):
            s = r[key]
            assert all(s["finite"]) and all(x == 0.0 for x in s["spread"]), (key, rank, s)
            assert s["skips"] == 1, (key, rank, s["skips"])
            assert s["diff"] <= 1e-6, (key, rank, s["diff"])  # DDP bucket order: ulps


@pytest.mark.timeout(180)
def test_localsgd_skips_locally_and_matches_torch_averager(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        s = r["localsgd"]
        assert all(s["finite"]), s
        assert s["skips"] == (1 if rank == 1 else 0)
        assert s["diff"] == 0.0, (rank, s["diff"])
        assert [x == 0.0 for x in s["spread"]] == [False, True, False, False, True, False, False, True, False]


@pytest.mark.timeout(180)
def test_localsgd_leaves_a_nan_parameter_out_of_the_average(results: list[dict[str, Any]]) -> None:
    r0, r1 = results[0]["localsgd/param"], results[1]["localsgd/param"]
    # Rank 1 is NaN after step 2 until the average after step 4 heals it; rank 0 never is.
    assert all(r0["finite"])
    assert r1["finite"] == [True, True, False, False, True, True, True, True, True]
    # Rank 1's steps 3 and 4 are skipped (NaN loss); the average after step 4 left it out, counted on both.
    assert r0["skips"] == 1 and r1["skips"] == 3
    assert r0["updates"] == STEPS and r1["updates"] == STEPS - 2
    assert r0["left_out4"] == 1 and r1["left_out4"] == 1
    # The mean of the finite members is rank 0's own parameters; both ranks hold them.
    assert torch.equal(r0["after4"], r0["local4"]) and torch.equal(r1["after4"], r0["local4"])
    assert r0["spread"][4] == 0.0 and r0["spread"][7] == 0.0 and r0["spread"][5] > 0


@pytest.mark.timeout(180)
def test_post_local_sgd_matches_torch_in_and_after_warmup(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        w, p = r["post/warmup"], r["post/local"]
        assert all(w["finite"]) and all(p["finite"])
        assert w["skips"] == 1, w  # warm-up: the all-reduced gradient is NaN on every rank
        assert p["skips"] == (1 if rank == 1 else 0), p  # after: local gradients, only rank 1 skips
        assert all(x == 0.0 for x in w["spread"][:4]), w["spread"]
        assert w["diff"] <= 1e-6 and p["diff"] <= 1e-6, (rank, w["diff"], p["diff"])


@pytest.mark.timeout(180)
def test_diloco_inner_and_outer_skips(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        inner, outer = r["diloco/inner"], r["diloco/outer"]
        assert all(inner["finite"]) and inner["diff"] <= 1e-6, (rank, inner["diff"])
        assert inner["skips"] == (1 if rank == 1 else 0)
        assert [x == 0.0 for x in inner["spread"]] == [(s + 1) % 3 == 0 for s in range(STEPS)]
        # The outer step after round 2 is skipped on both ranks (rank 1 also skipped its step 5).
        assert outer["skips"] == (2 if rank == 1 else 1), outer["skips"]
        assert outer["finite"] == [True] * 4 + ([False] if rank == 1 else [True]) + [True] * 4
        assert outer["global_unchanged"] and outer["momentum_unchanged"] and outer["global_moved_after"]
        assert outer["final_is_global"] and outer["spread"][5] == 0.0 and outer["spread"][8] == 0.0


@pytest.mark.timeout(180)
def test_streaming_diloco_resets_the_poisoned_fragment(results: list[dict[str, Any]]) -> None:
    f0 = [r["streaming"]["frag0"] for r in results]
    for rank, r in enumerate(results):
        s = r["streaming"]
        assert s["finite_end"] and all(s["finite"][6:]), s["finite"]
        # Rank 1: the NaN input at step 1, then its steps 5 and 6 (Inf parameter); both: fragment 0's outer step.
        assert s["skips"] == (4 if rank == 1 else 1), s["skips"]
        assert torch.equal(s["frag0"], s["global0"].to(s["frag0"].dtype))  # reset to the global copy
    assert torch.equal(f0[0], f0[1]) and bool(torch.isfinite(f0[0]).all())


# --- world 4: Hierarchical (pairs and the world) and DASO (2 hosts x 2) ------------------------------

def _hierarchical(rank: int, base: nn.Module) -> dict[str, Any]:
    """{2: 2, 4: 4}, warm-up 1: pairs average after steps 2, 6; everyone after 4, 8 (torch's schedule)."""
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager as TorchHierarchical,
    )

    levels = OrderedDict([(2, 2), (4, 4)])
    ref = copy.deepcopy(base)
    ref_opt = make_optimizer("sgd", ref.parameters())
    ref_avg = TorchHierarchical(levels, warmup_steps=1)
    _train(ref, ref_opt, _batches(rank), skip=lambda s: s == BAD and rank == 1,
           after_step=lambda s: ref_avg.average_parameters(ref.parameters()))
    model, opt, module = _wrap(base, shoal.Hierarchical({2: 2, 4: 4}, warmup_steps=1))
    run = _train(model, opt, _batches(rank, NAN))
    out: dict[str, Any] = {"grad": {"diff": max_diff(module, ref), "skips": _skips(opt.strategy), **run}}

    # A NaN parameter on rank 1 after step 1: its step 2 is skipped, the pair average after step 2
    # leaves it out (rank 0's parameters for both), the other pair averages as usual.
    model, opt, module = _wrap(base, shoal.Hierarchical({2: 2, 4: 4}, warmup_steps=1))
    local: list[torch.Tensor] = []
    opt.optimizer.register_step_post_hook(lambda *_: local.append(_flat(module)))
    seen: dict[str, Any] = {}

    def after(step: int) -> None:
        if step == 1 and rank == 1:
            with torch.no_grad():
                module.out.bias[0] = NAN
        if step == 2:
            seen["after2"], seen["left_out2"] = _flat(module), opt.strategy.averager.last_left_out

    run = _train(model, opt, _batches(rank), after_step=after)
    everyone = [torch.zeros_like(local[2]) for _ in range(4)]
    dist.all_gather(everyone, local[2])  # each rank's third local update (rank 1's is its step 3)
    out["param"] = {"skips": _skips(opt.strategy), **run, **seen, "local2": everyone}
    return out


def _daso(rank: int, base: nn.Module, lr_zero_at: int | None, poison: str | None) -> dict[str, Any]:
    """DASO, 3 epochs of 3 steps, warm-up and cool-down 1 (blocking global sync every step in those)."""
    os.environ["SHOAL_HOST_ID"] = f"host-{rank // 2}"
    module = copy.deepcopy(base)
    daso = shoal.DASO(total_epochs=3, steps_per_epoch=3, warmup_epochs=1, cooldown_epochs=1)
    model, opt = shoal.wrap(module, torch.optim.SGD(module.parameters(), lr=0.05), daso)
    batches = _batches(rank, NAN if poison == "grad" else None)

    def after(step: int) -> None:
        daso.report_loss(1.0)
        if lr_zero_at is not None:  # the reference: host 0's update at step BAD is zero, i.e. left out
            opt.param_groups[0]["lr"] = 0.0 if (step + 1 == lr_zero_at and rank < 2) else 0.05
        if poison == "param" and step == 1 and rank == 0:  # host 0's leader: every host-0 rank's next
            with torch.no_grad():                          # gradient is NaN, and its delta too
                module.fc1.weight[0, 0] = NAN

    if lr_zero_at == 0:
        opt.param_groups[0]["lr"] = 0.0 if rank < 2 else 0.05
    run = _train(model, opt, batches, after_step=after)
    daso.close()
    return {"skips": _skips(daso), "final": _flat(module), **run}


def _all4(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out.update({f"hier/{k}": v for k, v in _hierarchical(rank, base).items()})
        out["post/group"] = _post_local(rank, base, poison_at=5, local_size=2)
        out["daso/grad"] = _daso(rank, base, None, "grad")
        out["daso/ref"] = _daso(rank, base, BAD, None)
        out["daso/param"] = _daso(rank, base, None, "param")
    return out


@pytest.fixture(scope="module")
def results4() -> list[dict[str, Any]]:
    return run_workers(_all4, 4, timeout=170)


@pytest.mark.timeout(200)
def test_hierarchical_skips_locally_and_leaves_a_nan_parameter_out(results4: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results4):
        g, p = r["hier/grad"], r["hier/param"]
        assert all(g["finite"]) and g["diff"] == 0.0, (rank, g["diff"])
        assert g["skips"] == (1 if rank == 1 else 0)
        assert p["skips"] == {0: 1, 1: 2}.get(rank, 0), (rank, p["skips"])
        assert p["finite"] == ([True, False] if rank == 1 else [True, True]) + [True] * (STEPS - 2)
        assert p["left_out2"] == (1 if rank < 2 else 0)
        pair = p["local2"][0] if rank < 2 else (p["local2"][2] + p["local2"][3]) / 2
        assert torch.allclose(p["after2"], pair, rtol=0, atol=1e-7), rank
        assert p["spread"][4] == 0.0 and p["spread"][8] == 0.0


@pytest.mark.timeout(200)
def test_daso_host_skips_together_and_leaves_a_nan_host_out(results4: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results4):
        g, ref, p = r["daso/grad"], r["daso/ref"], r["daso/param"]
        # A NaN gradient on rank 1: host 0's mean gradient is NaN, both its ranks skip, host 1 steps.
        assert all(g["finite"]) and g["skips"] == (1 if rank < 2 else 0), (rank, g["skips"])
        assert torch.equal(g["final"], ref["final"]), rank  # = host 0's update at that step left out
        assert g["spread"][:3] == [0.0] * 3 and g["spread"][-3:] == [0.0] * 3  # blocking syncs: all agree
        # A NaN parameter on host 0's leader after step 1: host 0 skips step 2 and is left out of the
        # global mean after it (counted on both leaders), then restarts from the agreed parameters.
        assert p["finite"][2:] == [True] * (STEPS - 2) and p["spread"][2] == 0.0 and p["spread"][-1] == 0.0
        assert p["skips"] == {0: 2, 1: 1, 2: 1, 3: 0}[rank], (rank, p["skips"])


@pytest.mark.timeout(200)
def test_post_local_sgd_local_groups_skip_together(results4: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results4):
        p = r["post/group"]
        # After warm-up, gradients are averaged in pairs: rank 1's NaN makes ranks 0 and 1 skip, not 2 and 3.
        assert all(p["finite"]) and p["skips"] == (1 if rank < 2 else 0), (rank, p["skips"])
        assert p["diff"] <= 1e-6, (rank, p["diff"])
