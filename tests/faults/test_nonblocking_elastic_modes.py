"""NonBlocking on an elastic group with ``hierarchical=True`` and with its blocking fall-back, under a SIGKILL.

Real processes, gloo, world 3 (``grad_worker.py --kind nonblocking --nb ...``).
Both were refused on elastic groups before; now ``hierarchical=True`` takes
its host and leader subgroups from each quorum (``group.host_groups``) and the
fall-back (two optimizers, so blocking DDP) votes each step in the first
optimizer ``step()``. Rank 2 crashes in a collective of a step: the survivors
discard that step, go on, and end, with the restarted rank 2 healed, holding
bitwise equal parameters and optimizer state, equal to serial torch Adam
over the committed steps' global batches (the oracle of
test_grad_strategy_faults.py).
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_grad_strategy_faults import OP, assert_close_params, assert_close_state, launch, replay  # noqa: E402

from shoal.testing import FaultPlan  # noqa: E402


def _check(final: list[dict[str, Any]], why: str) -> None:
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    survivors, reborn = final[:2], final[2]
    assert survivors[0]["batches"] == survivors[1]["batches"], why
    assert all(s["stats"]["discards"] >= 1 for s in survivors), why
    assert reborn["stats"]["heals_received"] >= 1, why
    flat = [torch.cat([p.reshape(-1) for p in r["params"]]) for r in final]
    assert all(torch.equal(flat[0], f) for f in flat[1:]), why
    for r in final[1:]:
        for i, st in final[0]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, r["state"][i][k]), f"optimizer state {i}/{k} differs {why}"
    # The crashed step left no trace: the run equals serial Adam over the committed steps' batches.
    params, state = replay(survivors[0], "adam")
    assert_close_params(survivors[0]["params"], params, why)
    assert_close_state(survivors[0]["state"], state, why)


@pytest.mark.timeout(110)
def test_nonblocking_hierarchical_on_elastic_group_sigkill_survivors_bitwise_equal(tmp_path: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Ranks 0 and 1 pretend to share host h0, rank 2 is alone on h1 (its leader): each of its three
    # layer reductions is one all-reduce among the leaders; it dies in one of the first three.
    step, nth = rng.randrange(3, 8), rng.randrange(3)
    plan = FaultPlan().crash(rank=2, step=step, nth=nth)
    args = ["--kind", "nonblocking", "--nb", "hier", "--steps", "14", "--op", str(OP), "--want-size", "3",
            "--pace", "0.05"]
    final, logs = launch(tmp_path, args, plan)
    why = f"(seed {seed}: crash at step {step}, collective #{nth})\n{logs}"
    _check(final, why)
    for r in final[:2]:   # two-level: host h0's stages ran (and a discard was counted by the exchange)
        assert r["tags"].get("nonblocking/grad/intra", 0) > 0 and r["exchange"]["discards"] >= 1, why


@pytest.mark.timeout(110)
def test_nonblocking_blocking_fallback_on_elastic_group_sigkill_survivors_bitwise_equal(tmp_path: Any) -> None:
    seed = random.randrange(1 << 30)
    step = random.Random(seed).randrange(3, 8)
    plan = FaultPlan().crash(rank=2, step=step, nth=0)   # one bucket: one all-reduce per step
    args = ["--kind", "nonblocking", "--nb", "fallback", "--steps", "14", "--op", str(OP), "--want-size", "3",
            "--pace", "0.05"]
    final, logs = launch(tmp_path, args, plan)
    _check(final, f"(seed {seed}: crash at step {step})\n{logs}")
