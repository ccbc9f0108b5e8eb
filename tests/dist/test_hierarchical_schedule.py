"""Which level of a three-level hierarchy averages at each step (world 8, a one-weight model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shoal
from shoal.errors import ConfigError
from shoal.testing import run_workers


def _schedule(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The world-size check needs the group: a map whose last level is not the world.
    for name, levels in (("averager", {2: 2, 4: 4}), ("strategy", {2: 2, 4: 4})):
        try:
            if name == "averager":
                shoal.HierarchicalModelAverager(levels)
            else:
                m = nn.Linear(1, 1)
                shoal.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), shoal.Hierarchical(levels))
            out[name + "/error"] = None
        except ConfigError as e:
            out[name + "/error"] = str(e)

    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    averager = shoal.HierarchicalModelAverager({2: 2, 4: 4, 8: 8}, warmup_steps=1)
    levels, weights = [], []
    for step in range(10):
        with torch.no_grad():
            model.weight.add_(float((rank + 1) * (step + 1)))  # every rank moves differently
        averager.average_parameters(model.parameters())
        levels.append(averager.last_group.size if averager.last_group is not None else None)
        w = model.weight.detach().reshape(1).clone()
        everyone = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(everyone, w)
        weights.append([t.item() for t in everyone])
    out["levels"], out["weights"] = levels, weights
    out["ops"] = {tag: c.ops for tag, c in averager.group.meter.by_tag().items()}
    return out


@pytest.mark.timeout(300)  # 8 processes start on 2 shared cores
def test_three_level_schedule_world8() -> None:
    results = run_workers(_schedule, 8, timeout=280)
    for r in results:
        for name in ("averager", "strategy"):
            assert r[name + "/error"] is not None and "4" in r[name + "/error"] and "8" in r[name + "/error"]
    r = results[0]
    # warm-up 1; then at step s (0-based) the largest period dividing s: 8 -> all 8, 4 -> fours, 2 -> pairs.
    assert r["levels"] == [None, None, 2, None, 4, None, 2, None, 8, None]
    assert all(other["levels"] == r["levels"] for other in results)
    for step, (size, w) in enumerate(zip(r["levels"], r["weights"])):
        blocks = [w[s:s + (size or 1)] for s in range(0, 8, size or 1)]
        # Inside each group every rank holds the group's mean; different groups hold different means.
        assert all(len(set(b)) == 1 for b in blocks), (step, size, w)
        assert len({b[0] for b in blocks}) == len(blocks), (step, size, w)
    # One mean per averaging, and with it the 4-byte count of members with finite parameters (SPEC G5).
    assert r["ops"] == {"hierarchical/params/g2/identity": 2, "hierarchical/params/g4/identity": 1,
                        "hierarchical/params/g8/identity": 1, "hierarchical/params/g2/finite": 2,
                        "hierarchical/params/g4/finite": 1, "hierarchical/params/g8/finite": 1}
