"""DDP with ``ElasticSampler(global_batch=...)`` under a real SIGKILL: the survivors take over the dead
worker's share, so every committed step reads the whole global batch, and the run still equals serial
torch over those batches (real processes, gloo, world 3; the oracle of test_grad_strategy_faults).
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

GLOBAL = 24   # 8 for each of 3 workers, 12 for each of 2 survivors


@pytest.mark.timeout(110)
@pytest.mark.parametrize("heal", ["blocking", "background"])
def test_survivors_of_a_kill_take_its_share_and_equal_serial_torch(heal: str, tmp_path: Any) -> None:
    """Background: the restart votes as a zero-weight member while it catches up; the oracle then also checks
    the weighted mean (the contributors' gradients over the contributors) against serial torch."""
    seed = random.randrange(1 << 30)
    step = random.Random(seed).randrange(3, 8)
    plan = FaultPlan().crash(rank=2, step=step, nth=0)
    args = ["--kind", "ddp", "--steps", "14", "--op", str(OP), "--want-size", "3", "--pace", "0.05",
            "--global-batch", str(GLOBAL)]
    final, logs = launch(tmp_path, args, plan, env={"SHOAL_HEAL": heal})
    why = f"(seed {seed}: crash at step {step}, {heal} heal)\n{logs}"
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    survivors, reborn = final[:2], final[2]
    assert survivors[0]["batches"] == survivors[1]["batches"], why
    assert all(s["stats"]["discards"] >= 1 for s in survivors), why
    assert reborn["stats"]["heals_received"] >= 1, why
    batches = survivors[0]["batches"]
    sizes = {size for _, size, _ in batches.values()}
    assert sizes == {2, 3}, f"no step of the survivors alone, or none of all three: {sorted(sizes)} {why}"
    assert all(n == GLOBAL for _, _, n in batches.values()), f"a step read other than {GLOBAL} samples {why}"
    zero_weight = [k for k, c in survivors[0]["contributors"].items() if c < batches[k][1]]
    if heal == "background":   # the restart counted zero for a step or more, and the survivors took its share
        assert zero_weight and reborn["stats"]["heals_received"] >= 1, f"no step with a catching-up joiner {why}"
    else:
        assert not zero_weight, why
    cursors = [batches[k][0] for k in sorted(batches)]
    assert cursors == [GLOBAL * k for k in range(len(cursors))], f"a committed step skipped or re-read samples {why}"
    flat = [torch.cat([p.reshape(-1) for p in r["params"]]) for r in final]
    assert all(torch.equal(flat[0], f) for f in flat[1:]), why
    params, state = replay(survivors[0], "adam")
    assert_close_params(survivors[0]["params"], params, why)
    assert_close_state(survivors[0]["state"], state, why)
