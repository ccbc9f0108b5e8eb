"""NaN/Inf on an elastic group (SPEC G5): a non-finite step or round is skipped, never discarded.

Real processes around a coordinator, world 2, no faults. Rank 1 feeds a NaN
input at step 1 and (averaging strategies) writes a NaN into a parameter
after step 4. A skipped step needs no vote (the verdict is the same on every
member where the values are shared) and is no failure: the elastic group
commits every round and discards none.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

WORKER = "nonfinite_worker.py"
STEPS = 9
# (strategy, steps after which both members hold equal parameters, rank 0's skips, rank 1's skips)
CASES = {
    "sync": (range(STEPS), 1, 1),            # the NaN gradient is averaged: both skip step 1 together
    "localsgd": ([0, 3, 6], 1, 4),           # rank 1: steps 1, 5, 6; both: rank 1 left out of step 6's average
    "diloco": ([2, 5, 8], 1, 3),             # rank 1: steps 1 and 5; both: the outer step after step 5
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", sorted(CASES))
def test_elastic_nonfinite_skip_is_no_discard(strategy: str, tmp_path: Any) -> None:
    out = harness.run(str(tmp_path), 2, ["--strategy", strategy, "--steps", str(STEPS)], script=WORKER,
                      hard_limit=100, restarts=0)
    res = out.final()
    assert [r["rank"] for r in res] == [0, 1] and not out.deaths, out.logs
    equal_at, skips0, skips1 = CASES[strategy]
    assert [r["skips"] for r in res] == [skips0, skips1], out.logs
    for r in res:
        assert r["stats"]["discards"] == 0 and r["round_skipped"] == 0, (r["stats"], out.logs)
    r0, r1 = (r["log"] for r in res)
    assert all(e["finite"] for e in r0)
    # Rank 1 is non-finite only between its NaN parameter (after step 4) and the next round.
    bad = {"sync": [], "localsgd": [4, 5], "diloco": [4]}[strategy]
    assert [s for s, e in enumerate(r1) if not e["finite"]] == bad, strategy
    for s in equal_at:
        assert torch.equal(r0[s]["params"], r1[s]["params"]), (strategy, s)
