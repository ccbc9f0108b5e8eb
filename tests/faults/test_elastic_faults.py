"""Elastic DDP under real faults: real processes, gloo, world 3, a coordinator in the test.

The invariant checked everywhere: survivors agree (same commit/discard
sequence, bitwise equal parameters and optimizer state), and a restarted
worker equals them after its first step. Every run has a hard limit below
the pytest timeout; the harness kills whatever it started.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

from shoal.testing import FaultPlan  # noqa: E402

OP = 5.0


def _commits(result: dict[str, Any]) -> list[tuple[int, bool]]:
    return [(e["step"], e["committed"]) for e in result["log"]]


@pytest.mark.timeout(100)
def test_sigkill_mid_allreduce_survivors_agree_and_restart_heals(tmp_path: Any) -> None:
    _sigkill_run("ddp", tmp_path, restart=True)


@pytest.mark.timeout(80)
def test_sigkill_mid_allreduce_powersgd_through_wrap_survivors_agree(tmp_path: Any) -> None:
    # PowerSGD-DDP built by shoal.wrap(..., Sync(codec)): the strategy path votes in opt.step().
    _sigkill_run("powersgd", tmp_path, restart=False, wrap=True)


def _sigkill_run(mode: str, tmp_path: Any, restart: bool, wrap: bool = False) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    step, nth = rng.randrange(4, 12), rng.randrange(2)
    plan = FaultPlan().crash(rank=2, step=step, nth=nth)
    args = ["--mode", mode, "--steps", "20", "--op", str(OP), "--pace", "0.05", "--want-size", "3" if restart else "0"]
    args += ["--wrap"] if wrap else []
    env = {"SHOAL_FAULT_PLAN": plan.to_json()}
    if restart:  # as users run it: shoal run restarts the worker, which heals
        code, out = harness.run_launcher(str(tmp_path), 3, ["--min-workers", "2", "--max-restarts", "1"], args,
                                         env=env, hard_limit=85)
        why = f"(seed {seed}: crash at step {step}, collective #{nth})\n{out.logs}"
        assert code == 0, why
    else:
        out = harness.run(str(tmp_path), 3, args, env=env, hard_limit=65, restarts=0)
        why = f"(seed {seed}: crash at step {step}, collective #{nth})\n{out.logs}"
        assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0)] + ([(2, 1)] if restart else []), why
    survivors = final[:2]
    # Survivors took the same decisions, lost the crashed step, and went on quickly.
    assert _commits(survivors[0]) == _commits(survivors[1]), why
    assert survivors[0]["stats"]["discards"] >= 1, why
    for s in survivors:
        times = [e["t"] for e in s["log"] if e["committed"]]
        assert max(b - a for a, b in zip(times, times[1:])) <= OP + 5, why
    harness.assert_equal_state(final, cursor=False)
    if not restart:
        return
    reborn = final[2]
    # The restarted worker healed from a peer and equalled it right after its first step.
    assert reborn["stats"]["heals_received"] == 1, why
    first = reborn["log"][0]
    assert first["committed"], why
    peer = {e["step"]: e["digest"] for e in survivors[0]["log"] if e["committed"]}
    assert first["digest"] == peer[first["step"]], why


@pytest.mark.timeout(80)
def test_fault_plan_failure_and_stall_give_one_decision_everywhere(tmp_path: Any) -> None:
    op = 2.0
    plan = FaultPlan().fail(rank=1, step=3, nth=0).delay(rank=0, step=6, nth=1, seconds=op + 1.0)
    out = harness.run(str(tmp_path), 3, ["--steps", "9", "--op", str(op)],
                      env={"SHOAL_FAULT_PLAN": plan.to_json()}, hard_limit=60, restarts=0)
    final = out.final()
    assert len(final) == 3 and not out.deaths, out.logs
    seqs = [_commits(r) for r in final]
    assert seqs[0] == seqs[1] == seqs[2], out.logs
    assert (3, False) in seqs[0] and (6, False) in seqs[0], seqs[0]
    harness.assert_equal_state(final, cursor=False)
