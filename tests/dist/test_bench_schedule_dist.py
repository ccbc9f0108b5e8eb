"""Every registered bench strategy trains with the bench's learning-rate schedule, the same for all.

The bench worker runs each strategy with a warm-up + cosine schedule; a global optimizer step
pre-hook (torch's ``register_optimizer_step_pre_hook``) sees every AdamW step that really
happens (DiLoCo's inner optimizer, ZeRO's shard optimizers, collaborative training's), and the
global step it belongs to is read from the batch the worker asked for. Every such step must use
the schedule's learning rate of that global step; DiLoCo's outer SGD keeps its own.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shoal.bench import strategies
from shoal.testing import run_workers

WORLD = 4   # hierarchical averages pairs then all 4
STEPS = 8
LR = 1e-2
MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32}


def _train_each(rank: int, world: int, names: list[str], out_root: str) -> dict[str, Any]:
    from shoal.bench import data
    from shoal.bench.worker import WorkerConfig, train

    warnings.simplefilter("ignore")   # e.g. ZeRO's "fewer buckets than ranks" on this tiny model
    current = [-1]
    seen: list[tuple[int, list[float]]] = []
    original = data.ByteCorpus.train_batch

    def batch(self: Any, step: int, *args: Any) -> torch.Tensor:
        current[0] = step
        return original(self, step, *args)

    def spy(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if isinstance(opt, torch.optim.AdamW):
            seen.append((current[0], [g["lr"] for g in opt.param_groups]))

    data.ByteCorpus.train_batch = batch  # type: ignore[method-assign]
    hook = register_optimizer_step_pre_hook(spy)
    out: dict[str, Any] = {}
    try:
        for name in names:
            single = strategies.get(name).single_worker
            cfg = WorkerConfig(strategy=name, out_dir=os.path.join(out_root, name), model=MODEL, global_batch=8,
                               steps=STEPS, eval_every_steps=STEPS, val_windows=2, lr=LR,
                               lr_schedule="cosine", warmup_steps=3, lr_final_ratio=0.1)
            if rank == 0:
                os.makedirs(cfg.out_dir, exist_ok=True)
            dist.barrier()
            seen.clear()
            if not single or rank == 0:
                train(cfg, 0 if single else rank, 1 if single else world)
                out[name] = {"seen": list(seen), "expected": [LR * cfg.schedule().factor(t) for t in range(STEPS)]}
            dist.barrier()
    finally:
        hook.remove()
        data.ByteCorpus.train_batch = original  # type: ignore[method-assign]
    return out


def _match(seen: list[tuple[int, list[float]]], expected: list[float],
           anywhere: bool = False) -> tuple[list[int], str | None]:
    """The global steps whose learning rates ``seen`` used, in order, or why they do not fit.

    Calls at the same global step with the same lr are one update (ZeRO steps bucket by bucket).
    An update may use the lr of the step whose batch was last taken, of the step before
    (NonBlocking records ``optimizer.step()`` with its hyper-parameters and applies it in the next
    forward) or of the step after (collaborative training's swarm step lands in a background
    thread, possibly after the worker has set the next step's lr and before it takes the next
    batch). Updates never repeat a step and never go back. ``anywhere``: an update may use the lr
    of any later step than the last one matched (collaborative training under load: its swarm
    step, in a background thread, was seen landing with the lr of two steps after the batch the
    worker last took), and two updates may use one step's lr (a background step landing after the
    worker set that step's lr, then the step the worker's own call makes, both under it), in any
    order (a peer that loads a peer's state takes that peer's later lr with it, then its own
    schedule sets its own step's earlier one); the caller then counts distinct steps, so an
    unscheduled optimizer still fails: its constant lr fits at most two steps of the schedule.
    """
    steps: list[int] = []
    last: tuple[int, list[float]] | None = None
    for current, lrs in seen:
        if last is not None and (current, lrs) == last:
            continue
        last = (current, lrs)
        near = range(len(expected)) if anywhere else (current - 1, current, current + 1)
        fits = [t for t in near if 0 <= t < len(expected) and (anywhere or not steps or t > steps[-1])
                and lrs == pytest.approx([expected[t]] * len(lrs), rel=1e-9)]
        if not fits:
            return steps, f"in step {current} lr {lrs}, schedule {[round(expected[t], 8) for t in (current - 1, current, current + 1) if 0 <= t < len(expected)]}"
        steps.append(min(fits, key=lambda t: (t in steps, t)))   # a new step before a repeat
    return steps, None


def _check(results: list[dict[str, Any]], names: list[str], anywhere: bool = False) -> None:
    problems = []
    for name in names:
        stepped = 0
        for rank, r in enumerate(results):
            if name not in r:
                assert strategies.get(name).single_worker and rank > 0, (name, rank)
                continue
            steps, why = _match(r[name]["seen"], r[name]["expected"], anywhere)
            if why:
                problems.append(f"{name} (rank {rank}): {why}")
            stepped = max(stepped, len(set(steps)))    # distinct steps of the schedule
        # ZeRO's ranks that own no bucket of this tiny model step nothing; some rank must.
        if stepped < STEPS // 2:
            problems.append(f"{name}: AdamW stepped {stepped} times on its busiest rank in {STEPS} steps")
    assert not problems, "strategies not on the bench's schedule:\n" + "\n".join(problems)


@pytest.mark.timeout(240)
def test_every_registered_strategy_steps_with_the_schedules_lr() -> None:
    # collaborative runs in its own processes below (its swarm is slower to set up and leave).
    names = [n for n in strategies.available() if n != "collaborative"]
    with tempfile.TemporaryDirectory(prefix="shoal-sched-") as root:
        results = run_workers(_train_each, WORLD, names, root, timeout=220)
    _check(results, names)


@pytest.mark.timeout(180)
def test_collaborative_steps_with_the_schedules_lr() -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-sched-") as root:
        results = run_workers(_train_each, WORLD, ["collaborative"], root, timeout=160)
    _check(results, ["collaborative"], anywhere=True)
