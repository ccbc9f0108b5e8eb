"""Hierarchical SGD, post-local SGD with a {period: size} map and DASO on elastic groups: real processes, gloo, world 4 (two pretend hosts).

Fault-free, an elastic run equals the static run of the same program (same
model, data and seeds) up to float summation order. With a worker SIGKILLed
mid-run, the survivors go on, and at the end (a step that synchronises
everyone) every worker, the restarted one included, holds the same
parameters. Every run has a hard limit below its pytest timeout.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
import topo_worker  # noqa: E402

from shoal.testing import FaultPlan  # noqa: E402
from shoal.testing.procs import run_workers  # noqa: E402

WORKER = "topo_worker.py"
EPOCHS, SPE, STOP = 6, 6, 25   # DASO: 36 steps; Hierarchical: 25 (step 24 is a global averaging)


def _elastic(tmp_path: Any, strategy: str, extra: list[str], env: dict[str, str] | None = None,
             launcher: list[str] | None = None, limit: float = 80) -> tuple[list[dict[str, Any]], str]:
    args = ["--strategy", strategy, "--epochs", str(EPOCHS), "--spe", str(SPE), "--stop", str(STOP), *extra]
    code, out = harness.run_launcher(str(tmp_path), 4, launcher or ["--min-workers", "2"], args, env=env,
                                     hard_limit=limit, script=WORKER)
    assert code == 0, out.logs
    return out.final(), out.logs


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> float:
    assert len(a) == len(b)
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert worst <= tol, worst
    return worst


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["hierarchical", "postlocal", "daso"])
def test_fault_free_elastic_equals_static(strategy: str, tmp_path: Any) -> None:
    static = run_workers(topo_worker.static_worker, 4, strategy, EPOCHS, SPE, STOP, timeout=100)
    # Timeouts.op 15 s: nothing fails here, so no wait is on a detection path, and four fresh interpreters
    # starting together on a loaded box once took more than 5 s to build a subgroup (a discard, and the test
    # failed on its "no discards").
    elastic, logs = _elastic(tmp_path, strategy, ["--op", "15"])
    assert [r["rank"] for r in elastic] == [0, 1, 2, 3], logs
    for s, e in zip(static, elastic):
        assert [x["step"] for x in e["log"]] == [x["step"] for x in s["log"]], logs
        _close(s["params"], e["params"], 1e-6)
        _close(s["momentum"], e["momentum"], 1e-6)
        assert e["events"] == s["events"], logs      # DASO: the same launches, landings and skips
        assert e["stats"]["discards"] == 0, logs
    if strategy == "daso":
        assert any(gs > 1 for _, _, gs in static[0]["events"]), "the schedule never skipped: test too weak"
    # Both pretend hosts hold the same parameters after the last (global or DASO cool-down) step.
    for r in elastic[1:]:
        _close(elastic[0]["params"], r["params"], 1e-6)


def _assert_fault_run(final: list[dict[str, Any]], logs: str, crashed: tuple[int, ...]) -> None:
    assert [(r["rank"], r["life"]) for r in final] == [(r, int(r in crashed)) for r in range(4)], logs
    survivors = [r for r in final if r["rank"] not in crashed]
    for s in survivors:
        assert s["stats"]["discards"] >= 1, logs          # the round the crash hit was dropped
        assert s["skipped"] == 0, logs                     # and re-run by the survivors, not given up
        times = [e["t"] for e in s["log"]]
        assert max(b - a for a, b in zip(times, times[1:])) <= OP + 5, logs
        # Every step was taken, in order; DASO's gradient step hit by a failure is dropped and taken again.
        steps = [e["step"] for e in s["log"]]
        assert steps == sorted(steps) and sorted(set(steps)) == list(range(steps[-1] + 1)), logs
        assert len(steps) - len(set(steps)) <= s["stats"]["discards"], logs
    # They went on without it, unless a restarted worker was back in time to heal into the re-run
    # of the failed round (fast restarts): both are the survivors' round, re-run.
    alone = any(e["size"] < 4 for e in survivors[0]["log"])
    hit = next(e["step"] for e in survivors[0]["log"] if e["discards"] >= 1)
    assert alone or any(final[c]["first"] <= hit + 1 for c in crashed), logs
    for c in crashed:
        reborn = final[c]
        assert reborn["stats"]["heals_received"] >= 1 and reborn["first"] > 0, logs
        assert reborn["log"][-1]["step"] == survivors[0]["log"][-1]["step"], logs
        steps = [e["step"] for e in reborn["log"]]
        assert steps == sorted(steps) and sorted(set(steps)) == list(range(reborn["first"], steps[-1] + 1)), logs
    for r in final[1:]:      # the last step synchronised everyone: equal parameters, bitwise
        assert all(torch.equal(a, b) for a, b in zip(final[0]["params"], r["params"])), logs


OP = 5.0


@pytest.mark.timeout(150)
def test_hierarchical_sigkill_survivors_average_and_restart_rejoins_its_group(tmp_path: Any) -> None:
    # Rank 2 dies inside the round of elastic step 5 (averaging rounds are the only elastic steps).
    plan = FaultPlan().crash(rank=2, step=5, nth=0)
    final, logs = _elastic(tmp_path, "hierarchical", ["--pace", "0.05", "--want-full", "6", "--op", str(OP)],
                           env={"SHOAL_FAULT_PLAN": plan.to_json()},
                           launcher=["--min-workers", "2", "--max-restarts", "1"], limit=130)
    _assert_fault_run(final, logs, crashed=(2,))


@pytest.mark.timeout(150)
def test_daso_sigkill_survivors_go_on_and_restarts_heal_from_their_host(tmp_path: Any) -> None:
    # Host 1 (ranks 2, 3) loses rank 2 in its first collective of elastic step 6 (in the warm-up
    # epoch every training step is a gradient vote then a global round: the third step's round),
    # then rank 3 at its first collective from step 16: by then it is surely its host's leader (alone, or the lower quorum
    # rank next to the restarted rank 2, which joins last), so a leader is lost and replaced, and
    # the host may be left empty (a one-host quorum) or be restarted as a whole.
    plan = FaultPlan().crash(rank=2, step=6, nth=0)
    for step in range(16, 24):   # alone on its host, rank 3 talks only in global rounds: the first one from 16
        plan = plan.crash(rank=3, step=step, nth=0)
    final, logs = _elastic(tmp_path, "daso", ["--pace", "0.1", "--op", str(OP), "--want-full", "8"],
                           env={"SHOAL_FAULT_PLAN": plan.to_json()},
                           launcher=["--min-workers", "2", "--max-restarts", "1"], limit=130)
    _assert_fault_run(final, logs, crashed=(2, 3))
    # Optimizer state is replicated inside a host (DDP there); restarted workers took their host's.
    for a, b in [(0, 1), (2, 3)]:
        assert all(torch.equal(x, y) for x, y in zip(final[a]["momentum"], final[b]["momentum"])), logs
    # Schedules were healed: the same launches and landings once back (a worker admitted in an
    # epoch's loss round or a global round finishes that step's schedule with its peers).
    for c in (2, 3):
        mine = final[c]["events"]
        assert mine and mine[0][0] >= final[c]["first"] - 1 and final[0]["events"][-len(mine):] == mine, logs
