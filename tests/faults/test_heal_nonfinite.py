"""Heals of state that is legitimately non-finite (issue #24): an additive -inf causal mask.

Real processes under ``shoal run -n 2 --elastic``: the two workers start
with different weights, so the first quorum heals one from the other, and
the heal carries the model's -inf mask buffer. The heal must be accepted (the
receiver's own mask holds the same -inf) and both must train to the same
state. That a NaN sent into parameters is still refused is
tests/faults/test_elastic_auth.py::test_a_heal_with_a_bad_tensor_is_refused_and_never_loaded;
the rule itself is tested in tests/unit/test_received.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402


@pytest.mark.timeout(120)
def test_a_model_with_an_inf_mask_heals_and_trains_elastically(tmp_path: Any) -> None:
    code, out = harness.run_launcher(str(tmp_path), 2, [], ["--steps", "6"], script="mask_worker.py",
                                     hard_limit=100)
    assert code == 0, out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0)], out.logs
    assert sum(r["heals"] for r in final) == 1, out.logs       # the first quorum healed one of them
    assert all(r["step"] == 6 and r["mask_ok"] for r in final), out.logs
    for a, b in zip(final[0]["params"], final[1]["params"]):
        assert torch.equal(a, b), "the two workers ended with different parameters"


# --- shoal run --elastic knows when the run is over (issue #24) ----------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("min_workers", [1, 2])
@pytest.mark.parametrize("when", ["after-leave", "before-leave"])
def test_a_crash_at_the_very_end_is_not_restarted_into_a_finished_run(tmp_path: Any, min_workers: int,
                                                                       when: str) -> None:
    # Rank 2 exits 1 right after its last step (after or before its leave()); the others finish. A restart
    # would wait for a quorum that cannot form (min 2) or train alone from scratch (min 1): the run is over.
    args = ["--steps", "8", "--crash-at-end", "2"] + (["--crash-before-leave"] if when == "before-leave" else [])
    code, out = harness.run_launcher(str(tmp_path), 3, ["--min-workers", str(min_workers), "--max-restarts", "1"],
                                     args, script="mask_worker.py", hard_limit=130)
    # After its leave the crash is in its teardown: its part is done and the run succeeds. Before its leave
    # (once the others left: the run is over), its part was never finished: not restarted, but the run fails.
    assert code == (0 if when == "after-leave" else 1), out.logs
    if when == "before-leave":
        assert "the run fails with its code" in out.logs, out.logs
    lives = sorted(out.results)
    assert lives == [(0, 0), (1, 0), (2, 0)], (lives, out.logs)   # no life of rank 2 after its crash trained
    assert all(out.results[k]["step"] == 8 for k in lives), out.logs
    if when == "after-leave":
        assert "not restarting it" in out.logs and "restarting it (1/1)" not in out.logs, out.logs


@pytest.mark.timeout(120)
def test_a_crash_through_a_leave_in_finally_fails_the_run(tmp_path: Any) -> None:
    # Rank 1 raises after step 3 inside try/finally: group.leave(). That leave must not mark its part as
    # finished (the launcher would then swallow the crash and exit 0 while rank 0 trains on alone).
    code, out = harness.run_launcher(str(tmp_path), 2, ["--min-workers", "1", "--max-restarts", "0"],
                                     ["--steps", "6", "--raise-in-training", "1"], script="mask_worker.py",
                                     hard_limit=100)
    assert code == 1, out.logs
    assert "after it finished its part" not in out.logs, out.logs
    # Whether rank 0 had finished when rank 1's process exited decides which rule fails the run; either way
    # the crash is the run's result, never "finished".
    assert "no restarts left" in out.logs or "the run fails with its code" in out.logs, out.logs
    assert [k for k in sorted(out.results)] == [(0, 0)] and out.results[(0, 0)]["step"] == 6, out.logs
