"""Device-mismatch bugs caught without a GPU (issue #13).

On CUDA, a buffer that shoal allocates without ``device=`` lands on the CPU
next to CUDA tensors and fails ("Expected all tensors to be on the same
device"; NCCL: "No backend type associated with device type cpu"). Here the
model, its optimizer and the gloo group stay on the CPU, and
:func:`shoal.testing.devices.implicit_device_guard` sends every tensor that
shoal's own code creates without a device to the ``meta`` device instead: its
first use with a real tensor, in a gloo collective or on the host raises.
Covered, for a few steps on 2 ranks: every strategy through ``shoal.wrap``,
DDP with each codec (and hierarchical), ZeRO plain and overlapped with DDP,
and CollaborativeOptimizer plain, offloaded and with a delayed step. Each
run must also leave ``guard.hits`` empty: on these paths every shoal
allocation names its device.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import shoal
from collab_peers import PeerRun, raise_errors, run_peers
from models import Net
from shoal import codecs
from shoal.testing import run_workers
from shoal.testing.devices import implicit_device_guard

STEPS = 6


def _loop(model: torch.nn.Module, opt: Any, rank: int, steps: int = STEPS,
          after: Callable[[Any], None] = lambda loss: None) -> None:
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        after(loss)


def _strategy(name: str) -> shoal.Strategy:
    return {
        "sync": lambda: shoal.Sync(),
        "sync-powersgd": lambda: shoal.Sync(codec=codecs.PowerSGD(rank=2, min_compression_rate=1)),
        "local": lambda: shoal.LocalSGD(period=2, average_optimizer_state=True),
        "postlocal": lambda: shoal.PostLocalSGD(period=2, warmup_steps=2),
        "hierarchical": lambda: shoal.Hierarchical({2: 1, 4: 2}),
        "diloco": lambda: shoal.DiLoCo(inner_steps=2),
        "diloco-int8": lambda: shoal.DiLoCo(inner_steps=2, codec=codecs.Int8Blockwise(64)),
        "streaming": lambda: shoal.StreamingDiLoCo(inner_steps=2, fragments=2, overlap_steps=1),
        "nonblocking": lambda: shoal.NonBlocking(),
        "daso": lambda: shoal.DASO(total_epochs=3, steps_per_epoch=2, warmup_epochs=1, cooldown_epochs=1),
    }[name]()


def _wrap_worker(rank: int, world: int, name: str) -> list[str]:
    os.environ["SHOAL_HOST_ID"] = f"host{rank}"   # DASO and Hierarchical: one rank per pretend host
    torch.manual_seed(0)
    net = Net(width=16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    strategy = _strategy(name)
    with implicit_device_guard() as guard:
        model, opt = shoal.wrap(net, opt, strategy)
        report = getattr(strategy, "report_loss", None)
        _loop(model, opt, rank, after=(lambda loss: report(loss.detach())) if report else lambda loss: None)
        strategy.close()
    return guard.hits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["sync", "sync-powersgd", "local", "postlocal", "hierarchical", "diloco",
                                  "diloco-int8", "streaming", "nonblocking", "daso"])
def test_every_strategy_names_its_devices(name: str) -> None:
    for hits in run_workers(_wrap_worker, 2, name, timeout=200):
        assert hits == [], f"shoal allocated without device= at {sorted(set(hits))}"


def _codec(name: str) -> Any:
    return {
        "plain": lambda: None,
        "identity": codecs.Identity,
        "bf16": lambda: codecs.Cast(torch.bfloat16),
        "int8": lambda: codecs.Int8Blockwise(64),
        "topk": lambda: codecs.ErrorFeedback(codecs.TopK(0.1)),
        "powersgd": lambda: codecs.PowerSGD(rank=2, min_compression_rate=1),
        "adaptive": lambda: codecs.SizeAdaptive(codecs.Identity(), codecs.Cast(torch.bfloat16), threshold=64),
    }[name]()


def _ddp_worker(rank: int, world: int, codec: str, hierarchical: bool) -> list[str]:
    os.environ["SHOAL_HOST_ID"] = f"host{rank}"
    torch.manual_seed(0)
    net = Net(width=16)
    with implicit_device_guard() as guard:
        model = shoal.DistributedDataParallel(net, codec=_codec(codec), hierarchical=hierarchical,
                                              bucket_cap_mb=0.001, find_unused_parameters=True)
        _loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank)
    return guard.hits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", ["plain", "identity", "bf16", "int8", "topk", "powersgd", "adaptive"])
def test_ddp_codecs_name_their_devices(codec: str) -> None:
    for hits in run_workers(_ddp_worker, 2, codec, codec == "plain", timeout=200):
        assert hits == [], f"shoal allocated without device= at {sorted(set(hits))}"


def _zero_worker(rank: int, world: int, overlapped: bool) -> list[str]:
    torch.manual_seed(0)
    net = Net(width=16)
    with implicit_device_guard() as guard:
        zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
        model = shoal.DistributedDataParallel(net, optimizer=zero if overlapped else None, bucket_cap_mb=0.001)
        _loop(model, zero, rank)
        zero.wait_for_params()
        zero.consolidate_state_dict(to=0)
    return guard.hits


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlapped", [False, True])
def test_zero_names_its_devices(overlapped: bool) -> None:
    for hits in run_workers(_zero_worker, 2, overlapped, timeout=100):
        assert hits == [], f"shoal allocated without device= at {sorted(set(hits))}"


# --- CollaborativeOptimizer: two peers as threads of this process, a coordinator in it --------------

def _warm_up() -> None:
    """A first Adam step takes seconds (imports); done by both peers before they meet, so neither falls
    behind the other in its first round."""
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    torch.optim.Adam([p]).step()


def _peer(mode: str, batch: int, k: int, run: PeerRun) -> dict[str, Any]:
    _warm_up()
    net = Net(width=16)
    cfg = run.config(mode, target_batch_size=16, batch_size_per_step=batch, load_state_timeout=5,
                     average_state_every=2)
    g = torch.Generator().manual_seed(k)

    def step() -> None:
        x, y = torch.randn(batch, 16, generator=g), torch.randn(batch, 4, generator=g)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    with implicit_device_guard() as guard:
        opt = shoal.CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=1e-3), net.named_parameters(),
                                           config=cfg)
        try:
            run.train(opt, step, epochs=3)
        finally:
            opt.shutdown()
    return {"hits": guard.hits, "outcomes": [r.outcome for r in opt.rounds], "peers": [r.peers for r in opt.rounds]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["plain", "offload", "delayed"])
def test_collaborative_names_its_devices(mode: str) -> None:
    torch.set_num_threads(1)
    out = run_peers(functools.partial(_peer, mode, 8), 2, limit_s=60)
    raise_errors(out)
    for got in out:
        assert got["hits"] == [], f"shoal allocated without device= at {sorted(set(got['hits']))}"
    # The peers really averaged over gloo, together (on a loaded machine one may also have loaded state).
    assert any(o == "averaged" and n == 2 for p in out for o, n in zip(p["outcomes"], p["peers"])), out
