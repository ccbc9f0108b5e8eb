"""CollaborativeOptimizer with real processes: targets, equality, kills, late joiners, timeouts, roles, attacks.

Each test starts up to 3 peer processes (tests/faults/collab_worker.py)
around an in-process coordinator with a run token, under a hard limit below
its pytest timeout. Nothing here depends on speed: the checks are on what
each peer did and holds.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from harness import Outcome, run

TOKEN = "run-token-123"
TARGET = 96


def _run(tmp_path: Any, args: list[str], *, world: int = 3, hard_limit: float = 75.0, **kw: Any) -> Outcome:
    return run(str(tmp_path), world, ["--target", str(TARGET), *args], script="collab_worker.py",
               token=TOKEN, hard_limit=hard_limit, **{"restarts": 0, **kw})


def _by_epoch(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each epoch this peer went through with the swarm (averaged, or loaded the swarm's result)."""
    return {int(r["epoch"]): r for r in result["log"] if r["outcome"] in ("averaged", "loaded")}


def _assert_equal_after_each_round(results: list[dict[str, Any]], logs: str) -> set[int]:
    """Every epoch that all these peers went through ended with the same parameters on each."""
    logs_by_epoch = [_by_epoch(r) for r in results]
    common = set.intersection(*(set(b) for b in logs_by_epoch))
    assert common, f"no epoch in common\n{logs}"
    for e in sorted(common):
        digests = {b[e]["digest"] for b in logs_by_epoch}
        assert len(digests) == 1, f"epoch {e}: parameters differ between peers: {digests}\n{logs}"
    return common


@pytest.mark.timeout(100)
def test_three_peers_with_different_batch_sizes_reach_the_target_and_agree(tmp_path: Any) -> None:
    out = _run(tmp_path, ["--batch", "8,16,24", "--epochs", "5"])
    results = out.final()
    assert len(results) == 3, out.logs
    common = _assert_equal_after_each_round(results, out.logs)
    assert common == set(range(5)), out.logs
    for r in results:
        assert r["epoch"] == 5 and r["state_dict"]["local_epoch"] == 5, out.logs
        for rec in r["log"]:
            assert rec["outcome"] in ("averaged", "loaded"), out.logs
            assert rec["samples"] >= TARGET, f"epoch {rec['epoch']} stepped with {rec['samples']} samples\n{out.logs}"
            assert rec["peers"] == 3 and rec["finite"]
    # each peer's gradients counted: every peer contributed samples in some round
    assert all(any(rec["own"] > 0 for rec in r["log"]) for r in results), out.logs
    view = results[0]["progress"]
    assert view.target == TARGET and view.epoch >= 5 and view.num_peers >= 1


@pytest.mark.timeout(110)
def test_a_peer_killed_mid_round_leaves_the_others_training_and_its_restart_catches_up(tmp_path: Any) -> None:
    # Rank 2 is SIGKILLed inside epoch 2's averaging; the harness restarts it, and the new
    # incarnation is a late joiner: it must load the swarm's state, then contribute.
    out = _run(tmp_path, ["--batch", "8,16,24", "--epochs", "1000", "--until-peers", "3", "--pace", "0.02",
                          "--role", "2:die", "--max-seconds", "45"], hard_limit=90, restarts=1)
    assert [rank for rank, _ in out.deaths] == [2], out.logs
    assert (2, 1) in out.results, f"the restarted peer did not finish\n{out.logs}"
    survivors = [out.results[(0, 0)], out.results[(1, 0)]]
    for r in survivors:
        epochs = _by_epoch(r)
        # the round the peer died in was redone by the survivors, not given up
        assert epochs[2]["outcome"] == "averaged" and epochs[2]["peers"] == 2, out.logs
        assert all(rec["finite"] for rec in r["log"])
    late = out.results[(2, 1)]["log"]
    assert late and late[0]["outcome"] == "loaded" and late[0]["own"] == 0 and late[0]["epoch"] >= 3, out.logs
    assert any(rec["outcome"] == "averaged" and rec["own"] > 0 and rec["peers"] == 3 for rec in late[1:]), out.logs
    _assert_equal_after_each_round([*survivors, out.results[(2, 1)]], out.logs)
    assert survivors[0]["epoch"] == survivors[1]["epoch"] == out.results[(2, 1)]["epoch"]


@pytest.mark.timeout(100)
def test_averaging_timeout_steps_with_local_gradients(tmp_path: Any) -> None:
    out = _run(tmp_path, ["--batch", "16", "--epochs", "5", "--role", "1:stall", "--averaging-timeout", "4",
                          "--matchmaking", "1", "--load-timeout", "3", "--max-seconds", "25"], world=2)
    r0 = [r for r in out.final() if r["rank"] == 0]
    assert r0, out.logs
    outcomes = {rec["epoch"]: rec["outcome"] for rec in r0[0]["log"]}
    assert outcomes[2] == "local", out.logs
    assert r0[0]["epoch"] == 5 and all(rec["finite"] for rec in r0[0]["log"]), out.logs
    assert "averaging did not finish" in out.logs or "no averaging group formed" in out.logs


@pytest.mark.timeout(100)
def test_auxiliary_and_client_peers(tmp_path: Any) -> None:
    out = _run(tmp_path, ["--batch", "16,24", "--epochs", "4", "--role", "1:client", "--role", "2:aux"])
    results = out.final()
    assert len(results) == 3, out.logs
    _assert_equal_after_each_round(results, out.logs)
    aux, client = results[2], results[1]
    assert aux["log"] and all(rec["own"] == 0 for rec in aux["log"]), "an auxiliary peer averages with weight 0"
    assert any(rec["own"] > 0 for rec in client["log"]), "a client-mode peer still contributes gradients"
    sources = {rec["source"] for r in results for rec in r["log"]} - {None}
    assert sources and client["member"] not in sources, f"client-mode peer served state: {sources}\n{out.logs}"


@pytest.mark.timeout(100)
@pytest.mark.parametrize("attack", ["shape", "nan"])
def test_a_peer_sending_bad_tensors_is_excluded(tmp_path: Any, attack: str) -> None:
    out = _run(tmp_path, ["--batch", "8,16,24", "--epochs", "4", "--role", f"2:{attack}", "--max-seconds", "30"])
    results = {r["rank"]: r for r in out.final()}
    assert 0 in results and 1 in results, out.logs
    honest = [results[0], results[1]]
    _assert_equal_after_each_round(honest, out.logs)
    bad_member = results[2]["member"] if 2 in results else None
    for r in honest:
        assert r["epoch"] == 4, out.logs
        assert all(bool(torch.isfinite(p).all()) for p in r["params"]), "honest peers' parameters stay finite"
        assert all(math.isfinite(rec["digest"]) for rec in r["log"])
        excluded = {m for rec in r["log"] for m in rec["excluded"]}
        if bad_member is not None:
            assert bad_member in excluded, out.logs
    assert "excluding member" in out.logs or "sent non-finite" in out.logs, out.logs
