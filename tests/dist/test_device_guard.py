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


def _wrap_case(rank: int, name: str) -> list[str]:
    # Hierarchical: one rank per pretend host; DASO refuses hosts of one worker, so one host of two
    os.environ["SHOAL_HOST_ID"] = "host0" if name == "daso" else f"host{rank}"
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


def _ddp_case(rank: int, codec: str) -> list[str]:
    os.environ["SHOAL_HOST_ID"] = f"host{rank}"
    torch.manual_seed(0)
    net = Net(width=16)
    with implicit_device_guard() as guard:
        model = shoal.DistributedDataParallel(net, codec=_codec(codec), hierarchical=codec == "plain",
                                              bucket_cap_mb=0.001, find_unused_parameters=True)
        _loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank)
    return guard.hits


def _zero_case(rank: int, overlapped: str) -> list[str]:
    os.environ.pop("SHOAL_HOST_ID", None)   # both ranks on this machine's host, as without pretend hosts
    torch.manual_seed(0)
    net = Net(width=16)
    with implicit_device_guard() as guard:
        zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
        model = shoal.DistributedDataParallel(net, optimizer=zero if overlapped == "overlapped" else None,
                                              bucket_cap_mb=0.001)
        _loop(model, zero, rank)
        zero.wait_for_params()
        zero.consolidate_state_dict(to=0)
    return guard.hits


STRATEGIES = ["sync", "sync-powersgd", "local", "postlocal", "hierarchical", "diloco", "diloco-int8", "streaming",
              "nonblocking", "daso"]
CODECS = ["plain", "identity", "bf16", "int8", "topk", "powersgd", "adaptive"]
CASES = [("wrap", n) for n in STRATEGIES] + [("ddp", c) for c in CODECS] + [("zero", z) for z in ("plain", "overlapped")]
_RUN = {"wrap": _wrap_case, "ddp": _ddp_case, "zero": _zero_case}


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    """Every case in one pair of worker processes (starting a pair costs more than a case);
    a case that raises is reported by its test, and the next case runs on new groups."""
    out: dict[str, Any] = {}
    for kind, name in CASES:
        try:
            out[f"{kind}/{name}"] = _RUN[kind](rank, name)
        except Exception as e:  # noqa: BLE001 - reported by the case's test
            out[f"{kind}/{name}"] = f"raised {e!r}"
    return out


@pytest.fixture(scope="module")
def hits() -> list[dict[str, Any]]:
    return run_workers(_all_cases, 2, timeout=400)


def _check(hits: list[dict[str, Any]], case: str) -> None:
    for rank, got in enumerate(hits):
        assert got[case] == [], f"rank {rank}, {case}: shoal allocated without device= at " \
            f"{sorted(set(got[case])) if isinstance(got[case], list) else got[case]}"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_names_its_devices(hits: list[dict[str, Any]], name: str) -> None:
    _check(hits, f"wrap/{name}")


@pytest.mark.timeout(480)
@pytest.mark.parametrize("codec", CODECS)
def test_ddp_codecs_name_their_devices(hits: list[dict[str, Any]], codec: str) -> None:
    _check(hits, f"ddp/{codec}")


@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", ["plain", "overlapped"])
def test_zero_names_its_devices(hits: list[dict[str, Any]], mode: str) -> None:
    _check(hits, f"zero/{mode}")


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
