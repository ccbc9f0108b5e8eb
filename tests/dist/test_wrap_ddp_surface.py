"""Whatever the strategy, ``shoal.wrap`` returns a module with torch DDP's surface (issue 23).

A trainer written for torch's DDP does ``raw_model = model.module``, saves
``model.state_dict()`` (keys ``module.*``) or ``model.module.state_dict()``,
and accumulates gradients with ``no_sync()`` or by setting
``require_backward_grad_sync`` (nanoGPT's way). Each is checked here against
torch's own DDP wrapped around the same network.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.errors import ShoalError
from shoal.testing import run_workers
from models import Net, make_optimizer

CASES: dict[str, Callable[[], shoal.Strategy]] = {
    "ddp": lambda: shoal.strategies.Sync(),
    "codec": lambda: shoal.strategies.Sync(codec=shoal.codecs.Cast(torch.bfloat16)),
    "localsgd": lambda: shoal.LocalSGD(period=2),
    "postlocal": lambda: shoal.PostLocalSGD(period=2, warmup_steps=1),
    "hierarchical": lambda: shoal.Hierarchical({2: 1, 4: 2}),
    "diloco": lambda: shoal.DiLoCo(inner_steps=2),
    "streaming": lambda: shoal.StreamingDiLoCo(inner_steps=2, fragments=2),
    "daso": lambda: shoal.DASO(total_epochs=2, steps_per_epoch=2, warmup_epochs=0, cooldown_epochs=0),
    "nonblocking": lambda: shoal.NonBlocking(),
}
LOCAL = ("localsgd", "hierarchical", "diloco", "streaming")  # gradients never leave the rank in backward


def _batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)


def _accumulated(model: nn.Module, net: nn.Module, rank: int, style: str) -> list[torch.Tensor]:
    """Two micro-batches, the first without sync (``no_sync()`` or nanoGPT's flag); the gradients after."""
    for micro in range(2):
        x, y = _batch(rank, micro)
        if style == "flag":
            model.require_backward_grad_sync = micro == 1
            F.mse_loss(model(x), y).backward()
        elif micro == 0:
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
        else:
            F.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def _case(rank: int, base: nn.Module, name: str) -> dict[str, Any]:
    net = copy.deepcopy(base)
    model, opt = shoal.wrap(net, make_optimizer("sgd", net.parameters()), CASES[name]())
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    out: dict[str, Any] = {"module_is_net": model.module is net,
                           "keys": sorted(model.state_dict()) == sorted(ref.state_dict())}
    model.load_state_dict(ref.state_dict())   # a torch DDP checkpoint loads unchanged
    out["has_flag"] = model.require_backward_grad_sync is True
    if name == "nonblocking":
        try:
            with model.no_sync():
                pass
        except ShoalError as e:
            out["refused"] = str(e)
        opt.strategy.close()
        return out
    for style in ("no_sync", "flag"):
        got = _accumulated(model, net, rank, style)
        opt.zero_grad()
        if name in LOCAL:  # the same two local backwards on the bare network
            plain = copy.deepcopy(net)
            for micro in range(2):
                x, y = _batch(rank, micro)
                F.mse_loss(plain(x), y).backward()
            want = [p.grad for p in plain.parameters()]
        else:  # torch's DDP with the same accumulation (DASO: one host of two ranks, DDP inside it)
            torch_ref = nn.parallel.DistributedDataParallel(copy.deepcopy(net))
            want = _accumulated(torch_ref, torch_ref.module, rank, style)
        out[f"grad/{style}"] = max(float((a - b).abs().max()) for a, b in zip(got, want))
    opt.step()  # a full step still runs after accumulation
    opt.zero_grad()
    opt.strategy.close()
    return out


def _all(rank: int, world: int) -> dict[str, Any]:
    # One host: DASO refuses hosts of a single worker among several (docs/daso.md).
    os.environ["SHOAL_HOST_ID"] = "host-0"
    torch.manual_seed(0)
    base = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: _case(rank, base, name) for name in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_all, 2, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(CASES))
def test_wrapped_model_has_ddp_surface(results: list[dict[str, Any]], name: str) -> None:
    for rank, r in enumerate(results):
        s = r[name]
        assert s["module_is_net"] and s["keys"] and s["has_flag"], (name, rank, s)
        if name == "nonblocking":
            assert "no_sync" in s["refused"] and "Sync" in s["refused"], s
            continue
        for style in ("no_sync", "flag"):
            tol = 1e-2 if name == "codec" else 1e-6
            assert s[f"grad/{style}"] <= tol, (name, rank, style, s[f"grad/{style}"])
