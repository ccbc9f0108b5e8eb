"""What a DiLoCo heal carries: the global copies, not the parameters a second time (issue #15).

Mid-round (parameters drifted from the global copy), the state registered for
newcomers is taken and loaded back the way a newcomer's heal loads it: the
parameters are rebuilt from the healed global copies and the buffers come
from the module's state, which holds no trained parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.membership.stateserve import tree_tensors
from shoal.testing import run_workers


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net[2].bias.requires_grad_(False)   # frozen: in no global copy, so healed with the buffers
    group = shoal.Group()
    strategy = shoal.DiLoCo(inner_steps=2)
    model, opt = shoal.wrap(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1),
                            strategy, process_group=group)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):   # two rounds, then one inner step: the parameters are not the global copy
        F.mse_loss(model(torch.randn(8, 4, generator=g)), torch.ones(8, 2)).backward()
        opt.step()
        opt.zero_grad()
    f = strategy.fragments[0]
    drifted = any(not torch.equal(p, v) for p, v in zip(f.params, f.global_views))
    states = group.hooks.states
    blob = {k: s.get() for k, s in states.items()}
    buffers = blob[[k for k in blob if k.endswith("/buffers")][0]]
    carried = sum(t.numel() for t in tree_tensors(blob))
    trained = sum(p.numel() for p in f.params)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)             # a newcomer's own, unrelated parameters
        net[1].running_mean.add_(1.0)
    want_buffer = buffers["1.running_mean"].clone()
    for k, s in states.items():
        (s.heal_load or s.load)(blob[k])
    return {"drifted": drifted, "buffer_keys": sorted(buffers), "carried": carried, "trained": trained,
            "global_numel": f.snapshot.numel(),
            "rebuilt": all(torch.equal(p, v) for p, v in zip(f.params, f.global_views)),
            "frozen_healed": bool(torch.equal(net[2].bias, buffers["2.bias"])),
            "buffer_healed": bool(torch.equal(net[1].running_mean, want_buffer))}


@pytest.mark.timeout(60)
def test_diloco_heal_rebuilds_parameters_from_the_global_copy() -> None:
    for r in run_workers(_worker, 2, timeout=50):
        assert r["drifted"], "the check needs parameters that differ from the global copy"
        # Buffers and the frozen parameter, no trained parameter.
        assert r["buffer_keys"] == ["1.num_batches_tracked", "1.running_mean", "1.running_var", "2.bias"]
        assert r["rebuilt"] and r["frozen_healed"] and r["buffer_healed"]
        # Global copy + outer momentum + inner SGD (no momentum: nothing) + buffers: the trained
        # parameters are carried once (as the global copy), not twice.
        assert r["carried"] == 2 * r["global_numel"] + 8 + 8 + 1 + 2, r
