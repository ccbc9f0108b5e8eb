"""torch DDP's arguments with a meaning, and ``Join`` with uneven inputs, against torch's DDP (issue 23)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join

import shoal
from shoal.testing import run_workers
from models import Net


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in list(module.parameters()) + list(module.buffers())
                      if t.is_floating_point()])


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(2)]
    torch.distributed.all_gather(out, t)
    return out


def _init_args(rank: int) -> dict[str, Any]:
    """init_sync / broadcast_buffers / forward_sync_buffers: which ranks hold rank 0's state afterwards."""
    out = {}
    for name, kwargs in {"default": {}, "init_sync=False": {"init_sync": False},
                         "broadcast_buffers=False": {"broadcast_buffers": False},
                         "forward_sync_buffers=False": {"forward_sync_buffers": False}}.items():
        torch.manual_seed(rank)  # a different model on each rank
        net = Net(bn=True)
        net.bn.running_mean.fill_(float(rank))
        ours = shoal.DistributedDataParallel(copy.deepcopy(net), **kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(net), **kwargs)
        same = [bool(torch.equal(*_gathered(_flat(m.module)))) for m in (ours, theirs)]
        params = [bool(torch.equal(*_gathered(torch.cat([p.detach().reshape(-1) for p in m.module.parameters()]))))
                  for m in (ours, theirs)]
        out[name] = {"all_equal": same, "params_equal": params,
                     "forward_sync": [ours.broadcast_buffers, theirs.broadcast_buffers]}
    return out


def _train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], opt: torch.optim.Optimizer) -> None:
    for x, y in data:
        F.mse_loss(model(x), y).backward()   # Net(extra=True): its extra layer stays unused
        opt.step()
        opt.zero_grad()


def _data(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + rank)
    return [(torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _static_mesh_mp(rank: int) -> dict[str, float]:
    """static_graph with a parameter the forward never uses; device_mesh; mixed_precision's reduce_dtype."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = Net(extra=True)
    out = {}
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    for m in (ours, theirs):
        _train(m, _data(rank, 4), torch.optim.SGD(m.parameters(), lr=0.1))
    out["static_graph"] = float((_flat(ours.module) - _flat(theirs.module)).abs().max())
    torch.manual_seed(0)
    base = Net()
    mesh = init_device_mesh("cpu", (2,))
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), device_mesh=mesh)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_mesh=mesh)
    for m in (ours, theirs):
        _train(m, _data(rank, 3), torch.optim.SGD(m.parameters(), lr=0.1))
    out["device_mesh"] = float((_flat(ours.module) - _flat(theirs.module)).abs().max())
    mp = SimpleNamespace(param_dtype=None, reduce_dtype=torch.bfloat16, buffer_dtype=None)
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), mixed_precision=mp)
    cast = shoal.DistributedDataParallel(copy.deepcopy(base), codec=shoal.codecs.Cast(torch.bfloat16))
    exact = shoal.DistributedDataParallel(copy.deepcopy(base))
    for m in (ours, cast, exact):
        _train(m, _data(rank, 3), torch.optim.SGD(m.parameters(), lr=0.1))
    out["mp_vs_cast"] = float((_flat(ours.module) - _flat(cast.module)).abs().max())
    out["mp_vs_exact"] = float((_flat(ours.module) - _flat(exact.module)).abs().max())
    out["mp_codec"] = type(ours.codec).__name__
    return out


def _join(rank: int) -> dict[str, float]:
    """Uneven shards (rank 0: 5 batches, rank 1: 3; with model.join() the other way round, so rank 0
    joins first with stale buffers) under Join, BatchNorm buffers, one no_sync accumulation: shoal's
    DDP (exact, and through a codec) against torch's DDP."""
    out = {}
    for name, make in {"exact": lambda m: shoal.DistributedDataParallel(m),
                       "codec": lambda m: shoal.DistributedDataParallel(m, codec=shoal.codecs.Cast(torch.bfloat16)),
                       "model.join": None}.items():
        n = (5 if rank == 0 else 3) if name != "model.join" else (3 if rank == 0 else 5)
        torch.manual_seed(0)
        base = Net(bn=True)
        ours = make(copy.deepcopy(base)) if make else shoal.DistributedDataParallel(copy.deepcopy(base))
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        for m in (ours, theirs):
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            with (m.join() if name == "model.join" else Join([m])):
                for i, (x, y) in enumerate(_data(rank, n)):
                    if i == 1:
                        with m.no_sync():
                            F.mse_loss(m(x), y).backward()
                        continue
                    F.mse_loss(m(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        out[name] = float((_flat(ours.module) - _flat(theirs.module)).abs().max())
        out[name + "/ranks_equal"] = bool(torch.equal(*_gathered(_flat(ours.module))))
    return out


def _all(rank: int, world: int) -> dict[str, Any]:
    return {"init": _init_args(rank), "args": _static_mesh_mp(rank), "join": _join(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(_all, 2, timeout=120)


@pytest.mark.timeout(150)
def test_init_sync_and_buffer_flags_match_torch(results: list[dict[str, Any]]) -> None:
    for r in results:
        for name, s in r["init"].items():
            assert s["all_equal"][0] == s["all_equal"][1], (name, s)
            assert s["params_equal"][0] == s["params_equal"][1], (name, s)
            assert s["forward_sync"][0] == s["forward_sync"][1], (name, s)
        assert r["init"]["default"]["all_equal"] == [True, True]
        assert r["init"]["init_sync=False"]["params_equal"] == [False, False]
        assert r["init"]["broadcast_buffers=False"]["all_equal"] == [False, False]


@pytest.mark.timeout(150)
def test_static_graph_device_mesh_and_mixed_precision(results: list[dict[str, Any]]) -> None:
    for r in results:
        a = r["args"]
        assert a["static_graph"] <= 1e-6 and a["device_mesh"] <= 1e-6, a
        assert a["mp_codec"] == "Cast" and a["mp_vs_cast"] == 0.0 and 0 < a["mp_vs_exact"] < 1e-2, a


@pytest.mark.timeout(150)
def test_join_with_uneven_inputs_matches_torch_ddp(results: list[dict[str, Any]]) -> None:
    for r in results:
        j = r["join"]
        assert j["exact"] <= 1e-6 and j["model.join"] <= 1e-6, j
        assert j["codec"] < 2e-2, j   # bf16 on the wire
        assert j["exact/ranks_equal"] and j["codec/ranks_equal"] and j["model.join/ranks_equal"], j
