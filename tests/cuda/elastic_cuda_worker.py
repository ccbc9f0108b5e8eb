"""One worker of tests/cuda/test_cuda_elastic.py: elastic DDP with the model on cuda:0.

Started by tests/faults/harness.py as a plain process (a FaultPlan in the
environment SIGKILLs one worker inside a collective). The elastic group is
gloo over the CPU, the model, its gradient buckets and optimizer state live
on the GPU. Writes ``<out>/<rank>-<incarnation>.pt``: every step's commit
decision and the final model and optimizer state (on the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, ElasticOptimizer, ElasticSampler, Timeouts
from shoal.testing import FaultPlan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults"))
from harness import save_and_leave  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", type=float, default=10.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(os.environ.get("SHOAL_TEST_DEVICE", "cuda:0"))   # cpu: a dry run without a GPU
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.op + 10, join=a.op + 60)
    group = ElasticGroup(timeouts=timeouts, min_workers=2, backend_factory=FaultPlan.from_env().backend_factory())
    torch.manual_seed(100 + rank)   # different on purpose: the first step's heal must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    model = shoal.DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.001)
    opt = ElasticOptimizer(inner, group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    x, y = x.to(dev), y.to(dev)
    data = ElasticSampler(256, group, batch_size=16)
    log = []
    while group.step < a.steps:
        idx = torch.as_tensor(data.next_batch()).to(dev)
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        commits = group.stats.commits
        opt.step()
        log.append({"step": group.step, "committed": group.stats.commits > commits, "size": group.size})
    if dev.type == "cuda":
        torch.cuda.synchronize()
    result = {"log": log, "rank": rank, "life": life, "stats": vars(group.stats),
              "model": {k: v.cpu() for k, v in net.state_dict().items()},
              "opt": {i: {k: v.cpu() for k, v in st.items() if isinstance(v, torch.Tensor)}
                      for i, st in inner.state_dict()["state"].items()},
              "device": next(net.parameters()).device.type}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    main()
