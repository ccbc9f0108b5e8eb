"""Local SGD and DiLoCo on elastic groups under real faults: real processes, gloo, world 3.

A worker is SIGKILLed inside an averaging round at a random round; the round
is run again with the survivors (AVERAGE_SURVIVORS), whose parameters and
averaged/outer optimizer state end bitwise equal; `shoal run --elastic`
restarts the worker, which heals and equals them right after its first
round. A newcomer started with `--join @S` is admitted, heals, and then
contributes; a worker that calls `leave()` costs the others no round. Every run has a hard limit below its pytest timeout; the
harness kills whatever it started.

Every check runs in every run, whatever the machine's speed: the faults are
placed by parking, not by timing (strategy_worker.py): the restarted worker
stays out until the survivors have re-run the failed round alone
(``--hold-restart``), and the first workers wait between two rounds until the
newcomer is in a published quorum (``--admit-at``), so it is always admitted
right after a round that the two of them averaged.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

from shoal.testing import FaultPlan  # noqa: E402

OP = 5.0
WORKER = "strategy_worker.py"


def _rounds(result: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [(e["step"], e["round"], e["size"]) for e in result["log"] if "pre" in e]


def _assert_equal_synced(results: list[dict[str, Any]]) -> None:
    ref = results[0]
    for r in results[1:]:
        assert len(r["synced"]) == len(ref["synced"])
        for i, (a, b) in enumerate(zip(ref["synced"], r["synced"])):
            assert torch.equal(a, b), f"synced tensor {i} differs between rank {ref['rank']} and {r['rank']}"


def _by_step(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in result["log"] if "pre" in e}


def _assert_mean_of(post: float, pres: list[float]) -> None:
    want = sum(pres) / len(pres)
    assert abs(post - want) <= 1e-4 * max(1.0, abs(want)), (post, pres)


@pytest.mark.timeout(110)
@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_sigkill_mid_round_survivors_agree_and_restart_heals(strategy: str, tmp_path: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    step = rng.randrange(2, 5)   # committed rounds before the fatal one (round 0 is the set-up round)
    plan = FaultPlan().crash(rank=2, step=step, nth=0)
    args = ["--strategy", strategy, "--steps", "24", "--op", str(OP), "--pace", "0.02", "--want-size", "3",
            "--hold-restart"]
    code, out = harness.run_launcher(str(tmp_path), 3, ["--min-workers", "2", "--max-restarts", "1"], args,
                                     env={"SHOAL_FAULT_PLAN": plan.to_json()}, hard_limit=95, script=WORKER)
    why = f"(seed {seed}: crash in round {step})\n{out.logs}"
    assert code == 0, why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    survivors, reborn = final[:2], final[2]
    # Survivors went through the same rounds, re-ran the failed one among themselves, lost no round.
    assert _rounds(survivors[0]) == _rounds(survivors[1]), why
    assert survivors[0]["stats"]["discards"] >= 1 and survivors[0]["skipped"] == 0, why
    # The failed round was re-run by the survivors alone (size 2): the restarted worker was held back
    # until then (AVERAGE_SURVIVORS).
    assert any(size == 2 for _, _, size in _rounds(survivors[0])), why
    assert reborn["log"][0]["step"] <= _rounds(survivors[0])[-1][0], why
    for s in survivors:   # no stall beyond the op timeout (time parked waiting for the restart excluded)
        log = s["log"]
        assert max(b["t"] - a["t"] - b.get("parked", 0.0) for a, b in zip(log, log[1:])) <= OP + 5, why
    _assert_equal_synced(final)
    # The restarted worker healed and equalled the survivors right after its first round.
    assert reborn["stats"]["heals_received"] >= 1, why
    first = reborn["log"][0]
    assert first["joined"] and first["digest"] == _by_step(survivors[0])[first["step"]]["digest"], why
    assert reborn["contributed"] >= 1, why
    if strategy == "localsgd":
        # A round's result is the mean of its live contributors' states: the survivors' in the re-run round.
        a, b = _by_step(survivors[0]), _by_step(survivors[1])
        for s, e in a.items():
            if (s - 1) % 4 == 0 and e["size"] == 2 and e["contributed"] > a.get(s - 1, e)["contributed"]:
                _assert_mean_of(e["digest"], [e["pre"], b[s]["pre"]])
                break
        else:
            raise AssertionError(f"no round averaged by the two survivors alone {why}")


@pytest.mark.timeout(110)
@pytest.mark.parametrize("strategy,victim", [("postlocal-group", 1), ("streaming-overlap", 2)])
def test_sigkill_in_formerly_refused_combinations(strategy: str, victim: int, tmp_path: Any) -> None:
    # PostLocalSGD with local_group_size (a DISCARD round per step inside launch slots {0, 1}) and
    # StreamingDiLoCo with overlap (reductions on a background subgroup, voted where they land) on an
    # elastic group: a SIGKILL mid-run, the survivors go on and agree bitwise, the restart heals.
    seed = random.randrange(1 << 30)
    step = random.Random(seed).randrange(8, 12) if strategy == "postlocal-group" else random.Random(seed).randrange(2, 5)
    plan = FaultPlan().crash(rank=victim, step=step, nth=0)
    args = ["--strategy", strategy, "--steps", "24", "--op", str(OP), "--pace", "0.02", "--want-size", "3",
            "--hold-restart"]
    code, out = harness.run_launcher(str(tmp_path), 3, ["--min-workers", "2", "--max-restarts", "1"], args,
                                     env={"SHOAL_FAULT_PLAN": plan.to_json()}, hard_limit=95, script=WORKER)
    why = f"(seed {seed}: crash of rank {victim} in step {step})\n{out.logs}"
    assert code == 0, why
    final = out.final()
    want = [(r, 1 if r == victim else 0) for r in range(3)]
    assert [(r["rank"], r["life"]) for r in final] == want, why
    survivors, reborn = [r for r in final if r["rank"] != victim], final[victim]
    assert _rounds(survivors[0]) == _rounds(survivors[1]), why
    assert survivors[0]["stats"]["discards"] >= 1, why
    assert any(size == 2 for _, _, size in _rounds(survivors[0])), why
    _assert_equal_synced(final)
    assert reborn["stats"]["heals_received"] >= 1 and reborn["contributed"] >= 1, why
    # Right after its first synchronised round (parameter averaging / a fragment's merge), the restarted
    # worker holds what the survivors hold (between two, local groups differ by design).
    def synced(step: int) -> bool:
        return (step <= 6 or (step - 7) % 4 == 0) if strategy == "postlocal-group" else step % 4 == 0
    mine = {e["step"]: e for e in reborn["log"]}
    at = min(s for s in mine if synced(s) and s in _by_step(survivors[0]))
    assert mine[at]["digest"] == _by_step(survivors[0])[at]["digest"] == _by_step(survivors[1])[at]["digest"], why


@pytest.mark.timeout(110)
def test_join_newcomer_heals_and_contributes_then_one_leaves(tmp_path: Any) -> None:
    # Two workers; a third joins at 4 s (shoal run --join), heals, contributes; after three rounds of
    # three, worker 1 leaves gracefully; the other two go on as two and stop after four rounds of two.
    # The two wait at step 6 (between the rounds after steps 5 and 9) until the newcomer is in a quorum.
    args = ["--strategy", "localsgd", "--steps", "24", "--op", str(OP), "--pace", "0.05", "--want-size", "2",
            "--want-max", "3", "--leave-rank", "1", "--admit-at", "6"]
    code, out = harness.run_launcher(str(tmp_path), 2, ["--min-workers", "2", "--join", "@4"], args,
                                     hard_limit=95, script=WORKER)
    assert code == 0, out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], out.logs
    stayer, leaver, newcomer = final
    assert newcomer["stats"]["heals_received"] == 1, out.logs
    first = newcomer["log"][0]
    a, b = _by_step(stayer), _by_step(leaver)
    assert first["digest"] == a[first["step"]]["digest"], out.logs
    # It was admitted right after the round at step 9, which the two established workers averaged
    # alone (the newcomer then held a copy of the result).
    assert first["step"] == 9, out.logs
    joined = a[first["step"]]
    assert joined["contributed"] > a[first["step"] - 1]["contributed"], out.logs
    _assert_mean_of(joined["digest"], [joined["pre"], b[first["step"]]["pre"]])
    assert newcomer["contributed"] >= 2, out.logs
    # The leaver's last state is the group's at that step; the others lost no round to its leave.
    last = leaver["log"][-1]
    assert last["size"] == 3 and last["digest"] == a[last["step"]]["digest"], out.logs
    assert stayer["skipped"] == 0 and stayer["log"][-1]["size"] == 2, out.logs
    _assert_equal_synced([stayer, newcomer])


@pytest.mark.timeout(110)
def test_sigkill_mid_round_keeps_the_chunks_every_survivor_finished(tmp_path: Any) -> None:
    # DiLoCo's exact mean runs in 16 chunks. Rank 2 is SIGKILLed 10 ms into its fifth all-reduce of round 3
    # (the agreement on kept chunks, then chunks 0-3: it finished chunks 0-2, and its part of chunk 3 may have
    # gone out). The survivors' retry keeps the chunks both of them finished instead of reducing the whole
    # pseudo-gradient again (test_resume_round checks the values against an independent mean), and all
    # three still end bitwise equal.
    plan = FaultPlan().crash(rank=2, step=3, nth=4, op="allreduce")
    args = ["--strategy", "diloco-exact", "--chunk-bytes", "256", "--steps", "24", "--op", str(OP), "--pace", "0.02",
            "--want-size", "3", "--hold-restart"]
    code, out = harness.run_launcher(str(tmp_path), 3, ["--min-workers", "2", "--max-restarts", "1"], args,
                                     env={"SHOAL_FAULT_PLAN": plan.to_json()}, hard_limit=95, script=WORKER)
    why = out.logs
    assert code == 0, why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    survivors = final[:2]
    assert _rounds(survivors[0]) == _rounds(survivors[1]), why
    for s in survivors:
        assert s["stats"]["discards"] >= 1 and s["skipped"] == 0, why
        assert 1 <= s["kept_chunks"] <= 4 and s["kept_bytes"] > 0, why
    assert survivors[0]["kept_chunks"] == survivors[1]["kept_chunks"], why
    assert final[2]["kept_chunks"] == 0, why
    _assert_equal_synced(final)
