"""ElasticOptimizer and ElasticSampler on a static group: the same script runs without elasticity.

On a static group every step commits (the step interface is trivial there), so
ElasticOptimizer equals the bare optimizer and the sampler's cursor advances
by the world's batch at every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticOptimizer, ElasticSampler
from shoal.testing import run_workers


def _worker(rank: int, world: int) -> dict[str, Any]:
    group = shoal.Group()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    ref = nn.Linear(4, 2)
    ref.load_state_dict(net.state_dict())
    model = shoal.DistributedDataParallel(net, process_group=group)
    opt = ElasticOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = ElasticSampler(64, group, batch_size=4, shuffle=False)
    x = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) / 100
    y = torch.ones(64, 2)
    committed, batches = [], []
    for _ in range(3):
        idx = data.next_batch()
        batches.append(idx)
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        committed.append(opt.step())
        # The reference: one process over the world's batch of the step (the mean of the members' means).
        start = len(batches) - 1
        whole = list(range(start * world * 4, (start + 1) * world * 4))
        ref_opt.zero_grad()
        F.mse_loss(ref(x[whole]), y[whole]).backward()
        ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
    return {"committed": committed, "batches": batches, "cursor": data.cursor, "diff": diff}


@pytest.mark.timeout(60)
def test_elastic_optimizer_and_sampler_on_a_static_group() -> None:
    results = run_workers(_worker, 2, timeout=50)
    for rank, r in enumerate(results):
        assert r["committed"] == [True, True, True]
        assert r["cursor"] == 3 * 2 * 4
        assert r["batches"][1] == list(range(8 + 4 * rank, 8 + 4 * rank + 4))
        assert r["diff"] <= 1e-6, r["diff"]
