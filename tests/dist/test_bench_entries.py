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
        trainer.close()
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


def _collaborative_lm(rank: int, world: int, steps: int) -> dict:
    from shoal.bench.tasks import LMConfig, build_task
    from shoal.comm.meter import wire_bytes

    import shoal

    group = shoal.init()
    task = build_task("lm", LMConfig(d_model=32, n_layers=1, n_heads=2, context=32))
    torch.manual_seed(0)
    module = task.build_model()
    trainer = strategies.get("collaborative").build(module, lambda ps: torch.optim.AdamW(ps, lr=3e-3), group)
    losses = []
    for step in range(steps):   # the bench worker's loop (shoal/bench/worker.py), on the lm task
        batch = task.corpus.train_batch(step, 0, 16, rank, world)
        loss = task.loss(trainer.model, batch)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trainer.before_step(step)
        trainer.optimizer.step()
        trainer.after_step(step)
        losses.append(loss.item())
    opt = trainer.optimizer
    numel = sum(p.numel() for p in module.parameters())
    # The gradient all-reduces of the rounds this peer averaged in, by the ring model: a lower bound
    # on what the meter must have counted under the entry's tags.
    expected = sum(wire_bytes("all_reduce", 4 * numel, r.peers)[0]
                   for r in opt.rounds if r.outcome == "averaged" and r.peers > 1)  # type: ignore[attr-defined]
    full = [r.epoch for r in opt.rounds if r.outcome == "averaged" and r.peers == world]  # type: ignore[attr-defined]
    out = {"losses": losses, "sent": trainer.comm().bytes_sent, "expected": expected, "full": full,
           "grad_sent": opt.group.meter.counters("collab/grad").bytes_sent}  # type: ignore[attr-defined]
    trainer.close()   # as the bench worker does: rank 0 keeps the coordinator up until rank 1 has left
    return out


@pytest.mark.timeout(240)
def test_collaborative_entry_averages_on_the_lm_task_and_counts_its_bytes() -> None:
    results = run_workers(_collaborative_lm, 2, 12, timeout=200)
    for r in results:
        assert all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]
        assert len(r["full"]) >= 3, f"too few 2-peer rounds: {r['full']}"
        assert r["grad_sent"] >= r["expected"] > 0, r
        assert r["sent"] >= r["grad_sent"], "the entry's counter covers the gradient traffic"


def _synced_after_each_step(rank: int, world: int, names: list[str]) -> dict[str, list[tuple[bool, bool]]]:
    import shoal

    group = shoal.init()
    out = {}
    for name in names:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        trainer = strategies.get(name).build(module, lambda ps: torch.optim.AdamW(ps, lr=1e-2), group)
        assert trainer.synced is not None
        g = torch.Generator().manual_seed(rank)
        seen = []
        for step in range(7):   # the bench worker's loop; before an evaluation it drains
            x = torch.randn(16, 8, generator=g)
            nn.functional.mse_loss(trainer.model(x), x).backward()
            trainer.before_step(step)
            trainer.optimizer.step()
            trainer.after_step(step)
            trainer.optimizer.zero_grad()
            trainer.drain()
            seen.append((trainer.comm().bytes_sent > 0, trainer.synced()))
        out[name] = seen
        trainer.close()
    return out


@pytest.mark.timeout(120)
def test_an_overlapped_diloco_is_synced_only_once_its_first_round_merged() -> None:
    """The bench's credit rule (shoal.bench.runner.credited_points) reads ``Trainer.synced``: an overlapped
    DiLoCo has sent its first round's bytes at step 5 (the launch) but merges it only at step 6."""
    names = ["diloco-h5-sp1-n1m5-o1", "diloco-h5-sp1-n1m5"]
    for r in run_workers(_synced_after_each_step, 2, names, timeout=100):
        overlapped, plain = r[names[0]], r[names[1]]
        assert overlapped[3] == (False, False)
        assert overlapped[4] == (True, False)          # after step 5: launched and drained, not merged
        assert overlapped[5] == (True, True)           # after step 6: merged
        assert plain[4] == (True, True) and plain[3] == (False, False)
