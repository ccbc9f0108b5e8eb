"""The chaos bench's loss at equal samples (shoal.bench.chaos_curve, shoal.bench.chaos.equal_samples)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.bench.chaos import equal_samples
from shoal.bench.chaos_curve import at_equal_samples, due, read_curve, save_point, worker_steps


def test_due_keeps_only_the_last_round_boundaries() -> None:
    # DiLoCo, period 8, 64 steps, a round ends at steps 8, 16, ... (r = 0): the last 3 are 48, 56, 64
    kept = [s for s in range(1, 65) if due(s, 64, 8, 0, 3)]
    assert kept == [48, 56, 64]
    # local SGD's rounds end one step later (r = 1); a run that stops after step 65 keeps 49, 57, 65
    assert [s for s in range(1, 66) if due(s, 64, 8, 1, 3)] == [49, 57, 65]
    assert not any(due(s, 64, 8, None, 3) for s in range(1, 65))   # DDP: no curve
    assert not any(due(s, 64, 8, 0, 0) for s in range(1, 65))      # --curve 0


def test_the_curve_is_read_linearly_between_its_points_and_never_extrapolated() -> None:
    curve = [(448, 3.0), (480, 2.6)]
    assert at_equal_samples(curve, 464) == pytest.approx(2.8)
    assert at_equal_samples(curve, 456) == pytest.approx(2.9)
    assert at_equal_samples(curve, 448) == pytest.approx(3.0)
    assert at_equal_samples(curve, 480) == pytest.approx(2.6)
    assert at_equal_samples(curve, 500) == pytest.approx(2.6)     # more samples than the fault-free half
    assert at_equal_samples(curve, 447.9) is None                 # before the curve: keep more of it
    assert at_equal_samples([], 100) is None


def test_points_are_the_mean_over_the_workers_that_all_kept_them(tmp_path: Path) -> None:
    net = torch.nn.Linear(2, 1, bias=False)
    for step, values in ((8, (1.0, 3.0)), (16, (5.0, 7.0))):
        for rank, v in enumerate(values):
            with torch.no_grad():
                net.weight.fill_(v)
            save_point(net, str(tmp_path), rank, step)
    with torch.no_grad():
        net.weight.fill_(100.0)
    save_point(net, str(tmp_path), 0, 24)   # only one of the two workers got there: not a point
    curve = read_curve(str(tmp_path), lambda state: float(state["weight"][0, 0]), workers=2)
    assert curve == [(8, 2.0), (16, 6.0)]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def _steps(n: int, start: int = 1) -> list[dict[str, object]]:
    return [{"t": float(s), "dt": 1.0, "step": s, "round": s // 4, "discards": 0} for s in range(start, start + n)]


def test_worker_steps_count_progress_less_what_the_killed_lost() -> None:
    logs = {(0, 0): _steps(12), (1, 0): _steps(7), (1, 1): _steps(5, start=8)}
    # worker 1's first life was killed 3 steps after its last round (at step 4): those 3 are lost
    assert worker_steps(logs, [3.0]) == 12 + 7 + 5 - 3


def test_equal_samples_reads_the_fault_free_curve_at_the_chaos_halfs_samples() -> None:
    res = {"fault_free": {"curve": [(448, 3.0), (480, 2.6)], "worker_steps": 1920.0},
           "chaos": {"worker_steps": 1856.0, "val_loss": 2.8}}
    e = equal_samples(res, workers=4)
    assert e is not None
    assert e["samples_ratio"] == pytest.approx(1856 / 1920, abs=1e-4)
    assert e["fault_free"] == pytest.approx(2.8)                  # 464 per-worker steps: half-way
    assert e["delta_pct"] == pytest.approx(0.0)
    res["chaos"]["worker_steps"] = 1700.0                         # 425 per worker: before the curve
    assert equal_samples(res, workers=4)["delta_pct"] is None
    res["fault_free"]["curve"] = []                               # DDP, --curve 0
    assert equal_samples(res, workers=4) is None


def test_a_restart_that_went_on_from_its_last_lifes_steps_gives_them_back_to_the_committed_count(
        tmp_path: Path) -> None:
    """SHOAL_STATE_CACHE_EVERY: the killed life's steps since its last round are lost, less those its restart
    resumed from the host's progress file and its admitting round took (the restart's ``early`` event)."""
    import json

    from shoal.bench.chaos import _summarise, resumed

    def write(name: str, entries: list[dict[str, object]]) -> None:
        (tmp_path / name).write_text("".join(json.dumps(e) + "\n" for e in entries))

    joined = {"event": "joined", "t": 0.0, "started": 0.0, "pid": 1, "step": 0, "heal_s": 0.0, "heal_bytes": 0,
              "params": 10}
    survivor = [dict(joined, pid=1)] + _steps(12)
    victim = [dict(joined, pid=2)] + _steps(7)        # killed 3 steps after its round at step 4
    restart = [dict(joined, pid=3, t=7.5)] + [dict(e, early=True) for e in _steps(2, start=1)] + [
        {"event": "early", "t": 9.0, "steps": 2, "kept": 2, "resumed": 2}] + _steps(5, start=8)
    write("log-0-0.jsonl", survivor)
    write("log-1-0.jsonl", victim)
    write("log-1-1.jsonl", restart)
    kills = [{"rank": 1, "life": 0, "t": 7.2, "pid": 2, "survivors": [1]}]
    assert resumed(restart) == 2 and resumed(victim) == 0
    res = _summarise(str(tmp_path), kills, 20.0, 8, 0.0)
    # 12 + 7 + (2 early kept + 5) progress steps, less the victim's 3 unsynced steps, 2 of which were resumed
    assert res["worker_steps"] == 12 + 7 + 7 - (3 - 2)
    assert res["local_steps_lost_per_failure"] == 1.0
