"""The bench's inner learning-rate schedule (--lr-schedule): its values and its configuration.

The cosine schedule is checked against torch's own schedulers (LinearLR for the warm-up, then
CosineAnnealingLR, chained by SequentialLR), the reference a user would reach for.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from shoal.bench.command import _parser, _samples_args, _speed_args, config_from_args
from shoal.bench.runner import BenchConfig
from shoal.bench.schedule import LRSchedule, ScheduledLR, default_warmup
from shoal.bench.worker import WorkerConfig
from shoal.errors import ConfigError


def _torch_lrs(lr: float, total: int, warmup: int, final_ratio: float) -> list[float]:
    """Learning rates of ``total`` steps under torch's warm-up + cosine schedulers."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - 1 - warmup, eta_min=final_ratio * lr)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[warmup])
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("total,warmup,final", [(1000, 50, 0.1), (40, 3, 0.0), (20, 1, 0.5)])
def test_cosine_matches_torch_warmup_then_cosine_annealing(total: int, warmup: int, final: float) -> None:
    s = LRSchedule("cosine", total_steps=total, warmup_steps=warmup, final_ratio=final)
    ref = _torch_lrs(1e-3, total, warmup, final)
    ours = [1e-3 * s.factor(t) for t in range(total)]
    assert ours == pytest.approx(ref, rel=1e-6, abs=1e-12)
    assert ours[warmup - 1] == pytest.approx(1e-3) and ours[-1] == pytest.approx(final * 1e-3)


def test_cosine_without_warmup_starts_at_the_base_lr_and_stays_at_the_floor_past_the_horizon() -> None:
    s = LRSchedule("cosine", total_steps=11, warmup_steps=0, final_ratio=0.1)
    assert s.factor(0) == 1.0
    assert s.factor(5) == pytest.approx(0.55)
    assert s.factor(10) == pytest.approx(0.1) and s.factor(500) == pytest.approx(0.1)


def test_constant_is_one_everywhere() -> None:
    assert {LRSchedule().factor(t) for t in (0, 1, 10**6)} == {1.0}


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "linear", "total_steps": 10}, "one of constant, cosine"),
    ({"kind": "cosine"}, "needs the run's step count"),
    ({"kind": "cosine", "total_steps": 10, "warmup_steps": 10}, "fewer than the run's 10 steps"),
    ({"kind": "cosine", "total_steps": 10, "warmup_steps": -1}, "integer >= 0"),
    ({"kind": "cosine", "total_steps": 10, "final_ratio": 1.5}, r"in \[0, 1\]"),
    ({"kind": "cosine", "total_steps": 0}, ">= 1"),
    ({"kind": "constant", "warmup_steps": 5}, "need --lr-schedule cosine"),
])
def test_bad_schedules_are_refused_with_the_reason(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LRSchedule(**kwargs)


def test_scheduled_lr_sets_every_group_of_every_tracked_optimizer_once() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    sched = ScheduledLR(LRSchedule("cosine", total_steps=5, warmup_steps=2, final_ratio=0.0), base_lr=0.2)
    make = sched.track(lambda ps: torch.optim.AdamW(ps, lr=0.2))
    first = make([{"params": [a.weight]}, {"params": [a.bias]}])
    second = make(b.parameters())
    sched.add(first)                              # the strategy hands back one of the factory's
    sched.add(object())                           # no param_groups: nothing to schedule
    assert len(sched.optimizers) == 2
    assert sched.apply(0) == pytest.approx(0.1)
    assert [g["lr"] for o in (first, second) for g in o.param_groups] == pytest.approx([0.1] * 3)
    sched.apply(4)
    assert [g["lr"] for o in (first, second) for g in o.param_groups] == pytest.approx([0.0] * 3)


def _args(*extra: str) -> argparse.Namespace:
    return _parser().parse_args(["--loopback", "--hosts", "4", "--mode", "samples", *extra])


def test_cli_cosine_defaults_to_5_percent_warmup_for_every_strategy() -> None:
    cfg = config_from_args(_samples_args(_args("--steps", "1000", "--lr-schedule", "cosine",
                                               "--strategies", "ddp,local,diloco-h5-sp1-n1m5")))
    workers = [cfg.worker_config(name, "x") for name in cfg.strategies]
    assert {(w.lr_schedule, w.warmup_steps, w.lr_final_ratio) for w in workers} == {("cosine", 50, 0.1)}
    assert {w.schedule() for w in workers} == {LRSchedule("cosine", 1000, 50, 0.1)}
    assert default_warmup(1000) == 50 and default_warmup(3) == 1


def test_cli_explicit_warmup_and_final_ratio_and_constant_default() -> None:
    cfg = config_from_args(_samples_args(_args("--steps", "200", "--lr-schedule", "cosine",
                                               "--warmup-steps", "7", "--lr-final-ratio", "0.2")))
    assert cfg.worker_config("ddp", "x").schedule() == LRSchedule("cosine", 200, 7, 0.2)
    plain = config_from_args(_samples_args(_args("--steps", "200")))
    assert plain.worker_config("ddp", "x").schedule() == LRSchedule("constant", 200)


def test_mode_both_speed_run_keeps_the_quality_runs_horizon() -> None:
    args = _parser().parse_args(["--mode", "both", "--loopback", "--steps", "400", "--lr-schedule", "cosine"])
    speed = config_from_args(_speed_args(args, "/tmp/unused"))
    assert speed.steps is None and speed.time_budget_s is not None
    assert speed.worker_config("ddp", "x").schedule() == LRSchedule("cosine", 400, 20, 0.1)


@pytest.mark.parametrize("kwargs,match", [
    ({"time_budget_s": 30.0, "lr_schedule": "cosine"}, "needs the run's step count"),
    ({"steps": 10, "lr_schedule": "cosine", "warmup_steps": 10}, "fewer than"),
    ({"steps": 10, "warmup_steps": 3}, "need --lr-schedule cosine"),
    ({"steps": 10, "lr_schedule": "step"}, "one of constant, cosine"),
])
def test_bench_config_refuses_bad_schedules_before_any_process_starts(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BenchConfig(strategies=("ddp",), **kwargs)


def test_worker_config_round_trips_the_schedule(tmp_path) -> None:
    cfg = WorkerConfig(strategy="ddp", out_dir=str(tmp_path), steps=30, eval_every_steps=10,
                       lr_schedule="cosine", warmup_steps=3, lr_final_ratio=0.05)
    cfg.save(str(tmp_path / "c.json"))
    assert WorkerConfig.load(str(tmp_path / "c.json")).schedule() == LRSchedule("cosine", 30, 3, 0.05)


def test_table_footer_names_the_schedule_every_strategy_trained_with() -> None:
    from shoal.bench.command import schedule_line

    assert schedule_line(BenchConfig(strategies=("ddp",), steps=10)).endswith("AdamW 0.001, constant")
    line = schedule_line(BenchConfig(strategies=("ddp",), steps=1000, lr=3e-3, lr_schedule="cosine"))
    assert line.endswith("AdamW 0.003, cosine: warm-up 50 steps, then down to 0.0003 at step 1000")
