"""Elastic DDP with the model on the GPU under a SIGKILL (issue #13's elastic run).

Three workers (processes, all on cuda:0; the elastic group itself is gloo),
one SIGKILLed inside a gradient all-reduce by a FaultPlan: the survivors drop
that step, go on as two, and end with the same parameters and optimizer state.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from onegpu import needs_cuda
from shoal.testing import FaultPlan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults"))
import harness  # noqa: E402

pytestmark = needs_cuda
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_cuda_worker.py")


@pytest.mark.timeout(200)
def test_elastic_ddp_on_cuda_survives_a_sigkill(tmp_path: Any) -> None:
    plan = FaultPlan().crash(rank=2, step=5, nth=0)
    env = {"SHOAL_FAULT_PLAN": plan.to_json()}
    out = harness.run(str(tmp_path), 3, ["--steps", "16"], env=env, hard_limit=180, restarts=0, script=WORKER)
    assert [r for r, _ in out.deaths] == [2], out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0)], out.logs
    a, b = final
    assert a["device"] == os.environ.get("SHOAL_TEST_DEVICE", "cuda:0").split(":")[0], out.logs
    assert [(e["step"], e["committed"]) for e in a["log"]] == [(e["step"], e["committed"]) for e in b["log"]]
    assert a["stats"]["discards"] >= 1 and a["log"][-1]["size"] == 2, out.logs
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, st in a["opt"].items():
        for k, v in st.items():
            assert torch.equal(v, b["opt"][i][k]), (i, k)
