"""NaN/Inf gradients on one rank: every rank skips the step together (SPEC G5), gradient strategies.

Rank 1 poisons one parameter's gradient at step ``BAD``. On every rank the
parameters after that step equal those before it, every rank counts one
``nonfinite_skips``, training continues finite, and the end state equals a
run that simply omits step ``BAD`` (torch's DDP, or the same shoal codec for
stateless codecs).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from shoal.codecs import Cast, ErrorFeedback, Int8Blockwise, PowerSGD, TopK
from shoal.optim.zero import ZeroRedundancyOptimizer
from shoal.testing import run_workers
from models import Net, make_optimizer, max_diff

pytestmark = pytest.mark.timeout(180)

STEPS, BAD = 6, 3
CAP_MB = 0.0003  # Net in 3 buckets (head, fc2, fc1): fc1 is reduced last


def _poison(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[1] = value
        return grad
    return hook


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _count_host_reads() -> Callable[[], int]:
    """Count the verdict's host reads (shoal.comm.finite.read_flag, as the reducer and shoal.nonfinite call it)."""
    import shoal.nonfinite
    import shoal.reducer
    calls = [0]
    for mod in (m for m in (shoal.reducer, shoal.nonfinite) if hasattr(m, "read_flag")):
        def counted(flag: torch.Tensor, read: Callable[[torch.Tensor], bool] = mod.read_flag) -> bool:
            calls[0] += 1
            return read(flag)
        mod.read_flag = counted   # type: ignore[attr-defined]
    return lambda: calls[0]


def _loop(model: nn.Module, opt: Any, rank: int, value: float | None, omit: bool = False,
          micro: int = 1, sync: Callable[[], None] = lambda: None,
          reads: Callable[[], int] | None = None) -> dict[str, Any]:
    """Train STEPS steps; at BAD rank 1 poisons fc1.weight's gradient (value) or the step is omitted.
    ``reads_in_step``: host reads of the verdict between the last backward's start and opt.step()'s end."""
    module = model.module if hasattr(model, "module") else model
    target = module.fc1.weight
    g = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {"finite": True}
    count = reads or (lambda: 0)
    if reads is not None:
        out["reads_in_step"] = 0
    for step in range(STEPS):
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(micro)]
        if step == BAD and omit:
            continue
        handle = target.register_hook(_poison(value)) if step == BAD and rank == 1 and value is not None else None
        if step == BAD:
            sync()
            before = _params(module)
        for m, (x, y) in enumerate(batches):
            with model.no_sync() if m < micro - 1 else nullcontext():
                loss = F.mse_loss(model(x), y)
                seen = count()
                loss.backward()
        opt.step()
        if reads is not None:
            out["reads_in_step"] += count() - seen
        opt.zero_grad()
        if handle is not None:
            handle.remove()
        if step == BAD:
            sync()
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _params(module)))
        out["finite"] &= all(bool(torch.isfinite(p).all()) for p in module.parameters())
    sync()
    out["end"] = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return out


def _ddp_case(rank: int, base: nn.Module, value: float, opt_kind: str, ddp_kw: dict[str, Any],
              micro: int = 1, hook: Any = None) -> dict[str, Any]:
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), **ddp_kw)
    ref = TorchDDP(copy.deepcopy(base), gradient_as_bucket_view=ddp_kw.get("gradient_as_bucket_view", False))
    if hook is not None:  # torch's own hook, unchanged: the check runs on what it returns
        ours.register_comm_hook(None, hook)
        ref.register_comm_hook(None, hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _loop(ours, make_optimizer(opt_kind, ours.parameters()), rank, value, micro=micro,
                    reads=_count_host_reads())
    res["warned"] = sum("NaN/Inf" in str(w.message) for w in caught)
    _loop(ref, make_optimizer(opt_kind, ref.parameters()), rank, None, omit=True, micro=micro)
    res["vs_ref"] = max_diff(ours.module, ref.module)
    res["moved"] = max_diff(ours.module, base)
    res["skips"] = ours.comm_stats().total.nonfinite_skips
    return res


def _scaler_case(rank: int, base: nn.Module) -> dict[str, Any]:
    """With the default skip_nonfinite=True, torch's GradScaler still sees the (averaged, identical) Inf,
    skips and lowers its scale exactly as under torch's DDP (it refuses an optimizer whose parameters all
    lack a gradient, so DDP must not drop them before the scaler's unscale_); the skip is counted once."""
    ours = shoal.DistributedDataParallel(copy.deepcopy(base))
    ref = TorchDDP(copy.deepcopy(base))
    out: dict[str, Any] = {}
    for key, model in (("ours", ours), ("ref", ref)):
        opt = make_optimizer("adam", model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        g = torch.Generator().manual_seed(100 + rank)
        target = model.module.fc1.weight
        for step in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            handle = target.register_hook(_poison(float("inf"))) if step == BAD and rank == 1 else None
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if handle is not None:
                handle.remove()
        out[key] = scaler.get_scale()
    return {"unchanged": True, "finite": all(bool(torch.isfinite(p).all()) for p in ours.parameters()),
            "skips": ours.comm_stats().total.nonfinite_skips, "expected_skips": 1, "vs_ref": max_diff(ours.module, ref.module),
            "scale": (out["ours"], out["ref"]), "end": torch.cat([p.detach().reshape(-1) for p in ours.parameters()])}


def _codec_case(rank: int, base: nn.Module, value: float, make: Callable[[], Any], stateless: bool) -> dict[str, Any]:
    codec = make()
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB, codec=codec)
    res = _loop(ours, make_optimizer("adam", ours.parameters()), rank, value)
    res["skips"] = ours.comm_stats().total.nonfinite_skips
    res["state_finite"] = all(bool(torch.isfinite(t).all()) for t in _tensors(codec.state_dict()))
    if "nonfinite_steps" in codec.stats():
        res["nonfinite_steps"] = codec.stats()["nonfinite_steps"]
    if stateless:  # the same codec, step BAD omitted: exactly the same end state
        ref = shoal.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB, codec=make())
        _loop(ref, make_optimizer("adam", ref.parameters()), rank, None, omit=True)
        res["vs_ref"] = max_diff(ours.module, ref.module)
    return res


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


def _zero_case(rank: int, base: nn.Module, value: float, opt_kind: str, overlap: bool,
               torch_ddp: bool = False) -> dict[str, Any]:
    cls, kw = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}) if opt_kind == "sgd" else (torch.optim.Adam, {"lr": 1e-3})
    module = copy.deepcopy(base)
    zero = ZeroRedundancyOptimizer(module.parameters(), cls, **kw)
    if torch_ddp:
        model: nn.Module = TorchDDP(module)
    else:
        model = shoal.DistributedDataParallel(module, bucket_cap_mb=CAP_MB, optimizer=zero if overlap else None)
    res = _loop(model, zero, rank, value, sync=zero.wait_for_params)
    ref = TorchDDP(copy.deepcopy(base))
    _loop(ref, make_optimizer(opt_kind, ref.parameters()), rank, None, omit=True)
    res["vs_ref"] = max_diff(module, ref.module)
    res["skips"] = (zero.group.meter.counters("zero").nonfinite_skips if torch_ddp
                    else model.comm_stats().total.nonfinite_skips)  # type: ignore[operator]
    return res


def _worker(rank: int, world: int, which: str) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {}
    warnings.simplefilter("ignore", RuntimeWarning)
    for vname, value in (("nan", float("nan")), ("inf", float("inf"))):
        if which == "ddp":
            out[f"sgd/{vname}"] = _ddp_case(rank, base, value, "sgd", {})
            out[f"adam/{vname}"] = _ddp_case(rank, base, value, "adam", {"bucket_cap_mb": CAP_MB})
            # Skipped on the device, no host read before the step; fused SGD reads at its first step
            # only (its momentum buffers do not exist yet: skipping there on the device is not exact).
            for fused, reads in (("adamw-fused", 0), ("sgd-fused", 1)):
                out[f"{fused}/{vname}"] = dict(_ddp_case(rank, base, value, fused, {"bucket_cap_mb": CAP_MB}),
                                               expected_reads=reads)
            out[f"view_nosync/{vname}"] = _ddp_case(rank, base, value, "adam",
                                                    {"gradient_as_bucket_view": True}, micro=2)
            if vname == "inf":
                out["grad_scaler"] = _scaler_case(rank, base)
            if world == 2:  # at 3 ranks gloo's fp16 sums round differently for other bucket layouts
                out[f"torch_fp16_hook/{vname}"] = _ddp_case(rank, base, value, "sgd", {},
                                                            hook=default_hooks.fp16_compress_hook)
        elif which == "codecs":
            for name, make, stateless in (
                ("fp16", lambda: Cast(torch.float16), True),
                ("int8", lambda: Int8Blockwise(block_size=64), True),
                ("topk_ef", lambda: ErrorFeedback(TopK(0.1)), False),
                ("powersgd", lambda: PowerSGD(rank=2, min_compression_rate=1.0), False),
            ):
                out[f"{name}/{vname}"] = _codec_case(rank, base, value, make, stateless)
        else:
            for opt_kind in ("sgd", "adam"):
                out[f"zero_plain_{opt_kind}/{vname}"] = _zero_case(rank, base, value, opt_kind, overlap=False)
                out[f"zero_overlap_{opt_kind}/{vname}"] = _zero_case(rank, base, value, opt_kind, overlap=True)
            out[f"zero_torch_ddp/{vname}"] = _zero_case(rank, base, value, "adam", overlap=False, torch_ddp=True)
    return out


def _check(results: list[dict[str, Any]], tol: float = 1e-6) -> None:
    for rank, res in enumerate(results):
        for case, r in res.items():
            where = f"rank {rank} {case}"
            assert r["unchanged"], f"{where}: the non-finite step changed the parameters"
            assert r["finite"], f"{where}: parameters went non-finite"
            want = r.get("expected_skips", 1)
            assert r["skips"] == want, f"{where}: {r['skips']} non-finite skips counted, expected {want}"
            if "vs_ref" in r:
                assert r["vs_ref"] <= tol, f"{where}: differs from a run without the bad step by {r['vs_ref']:.3g}"
            if "scale" in r:  # the scaler skipped the Inf step and halved its scale, as under torch's DDP
                assert r["scale"][0] == r["scale"][1] == 2.0**7, f"{where}: scales {r['scale']}"
            if "expected_reads" in r:   # a fused optimizer took the verdict as found_inf, unread
                assert r["reads_in_step"] == r["expected_reads"], f"{where}: {r['reads_in_step']} host reads in steps"
            elif "reads_in_step" in r:   # any other optimizer reads it once per step, at its step
                assert r["reads_in_step"] == STEPS, f"{where}: {r['reads_in_step']} host reads in {STEPS} steps"
            if "warned" in r:
                assert r["warned"] == 1, f"{where}: {r['warned']} warnings about the skipped step, expected 1"
            if "moved" in r:
                assert r["moved"] > 1e-3, f"{where}: training did not move the parameters"
            if "state_finite" in r:
                assert r["state_finite"], f"{where}: codec state poisoned"
            if "nonfinite_steps" in r:
                assert r["nonfinite_steps"] == 1, f"{where}: the codec counted {r['nonfinite_steps']} non-finite calls"
    for case in results[0]:  # every rank holds the same parameters at the end
        for rank, res in enumerate(results[1:], start=1):
            assert torch.equal(res[case]["end"], results[0][case]["end"]), f"{case}: rank {rank} differs from rank 0"


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_skips_nonfinite_step_like_torch_without_it(world: int) -> None:
    _check(run_workers(_worker, world, "ddp", timeout=150), tol=1e-6 if world == 2 else 3e-6)


def test_ddp_codecs_skip_nonfinite_step() -> None:
    _check(run_workers(_worker, 2, "codecs", timeout=150))


def test_zero_plain_and_overlapped_skip_nonfinite_step() -> None:
    _check(run_workers(_worker, 2, "zero", timeout=150))
