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
