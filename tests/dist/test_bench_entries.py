"""Every registered bench strategy builds and trains on real workers."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shoal.bench import strategies
from shoal.testing import run_workers

# Strategies whose replicas must be equal after every step (gradient averaging).
SYNCHRONOUS = {"ddp", "torch-ddp", "fp16", "bf16", "int8", "topk", "powersgd", "zero", "zero+powersgd"}


def _exercise(rank: int, world: int, names: list[str]) -> dict[str, dict[str, float]]:
    import shoal

    group = shoal.init()
    warnings.simplefilter("ignore")  # e.g. ZeRO's "fewer buckets than ranks" on this tiny model
    out = {}
    for name in names:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        trainer = strategies.get(name).build(module, lambda ps: torch.optim.AdamW(ps, lr=1e-2), group)
        g = torch.Generator().manual_seed(rank)
        for step in range(3):
            x = torch.randn(16, 8, generator=g)
            loss = nn.functional.mse_loss(trainer.model(x), x)
            loss.backward()
            trainer.before_step(step)
            trainer.optimizer.step()
            trainer.after_step(step)
            trainer.optimizer.zero_grad()
        if hasattr(trainer.optimizer, "wait_for_params"):  # ZeRO overlapped: broadcasts land lazily
            trainer.optimizer.wait_for_params()
        flat = torch.cat([p.detach().reshape(-1) for p in (trainer.eval_module or module).parameters()])
        spread = flat.clone()
        torch.distributed.all_reduce(spread, op=torch.distributed.ReduceOp.MAX)
        out[name] = {"loss": loss.item(), "sent": float(trainer.comm().bytes_sent),
                     "max_gap": (spread - flat).abs().max().item()}
    return out


@pytest.mark.timeout(240)
def test_every_multi_worker_entry_trains() -> None:
    names = [n for n in strategies.available() if not strategies.get(n).single_worker]
    results = run_workers(_exercise, 4, names, timeout=220)
    for rank, r in enumerate(results):
        for name in names:
            assert torch.isfinite(torch.tensor(r[name]["loss"])), (name, r[name])
            if name in SYNCHRONOUS:
                assert r[name]["max_gap"] == 0.0, f"{name}: replicas differ on rank {rank}"
                assert r[name]["sent"] > 0, f"{name}: counted no bytes"
