"""Train a small next-byte model on Python's own documentation with shoal's DDP.

Run on 2 local workers:

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 200
    shoal run -n 2 examples/train_ddp.py --steps 200
    shoal run -n 2 --elastic examples/train_ddp.py --steps 200 --elastic
    shoal run -n 3 --elastic --max-restarts 1 --kill 2@5 examples/train_ddp.py --elastic --global-batch 192 --steps 800

With ``--elastic`` it builds an ElasticGroup from the launcher's environment
(workers may die, restart and join; docs/elastic.md); across machines see
docs/multinode.md and examples/multinode/. ``--global-batch`` keeps the
step's batch when a worker is lost: the survivors take over its share
(docs/elastic.md, "Keeping the global batch when a worker is lost").

The only shoal-specific lines are `shoal.init()` and the wrapper; everything
else is a plain PyTorch loop. Each rank reads its own shard of the batches.
With CUDA present `shoal.init()` starts NCCL and selects cuda:LOCAL_RANK:
model and batches go to `group.device` (the CPU under gloo).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from pydoc_data.topics import topics
from torch import nn

import shoal
from shoal.elastic import global_share

CONTEXT = 16  # bytes of context the model sees


class NextByte(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.mlp = nn.Sequential(nn.Linear(CONTEXT * d, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x).flatten(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64, help="per worker")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--elastic", action="store_true", help="an elastic run (shoal run --elastic)")
    ap.add_argument("--global-batch", type=int, default=0,
                    help="samples per step over all workers, the survivors of a kill taking its "
                         "share (0: --batch per worker, so the step's batch shrinks while one is missing)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    if args.elastic:
        from shoal.elastic import ElasticGroup, ElasticOptimizer
        group = ElasticGroup()  # SHOAL_COORDINATOR, SHOAL_RUN_ID, SHOAL_TOKEN from the launcher
    else:
        group = shoal.init()
    device = group.device  # cuda:LOCAL_RANK under NCCL, the CPU under gloo
    data = torch.frombuffer(bytearray("".join(topics.values()).encode()), dtype=torch.uint8).long().to(device)
    model = shoal.DistributedDataParallel(NextByte().to(device), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.elastic:
        opt = ElasticOptimizer(opt, group)  # a step commits everywhere or nowhere; newcomers heal from peers

    g = torch.Generator().manual_seed(1234 + int(os.environ.get("RANK", "0")))  # each worker its own batches
    t0 = time.perf_counter()
    step = 0
    while step < args.steps:
        n = args.batch
        if args.global_batch:   # starts the step (adopts its quorum): e.g. 64 of 3 workers, 96 of 2 survivors
            n = global_share(group, args.global_batch)
        starts = torch.randint(0, len(data) - CONTEXT - 1, (n,), generator=g)
        window = data[starts.to(device).unsqueeze(1) + torch.arange(CONTEXT + 1, device=device)]
        loss = F.cross_entropy(model(window[:, :-1]), window[:, -1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        # Elastic: a discarded step is retried, and a healed newcomer continues from its peers' step.
        step = group.step if args.elastic else step + 1
        if step and group.rank == 0 and (step % 50 == 0 or step == args.steps):
            s = model.comm_stats()
            print(f"step {step}: loss {loss.item():.3f}  {n} samples here of {group.size} workers  "
                  f"{(time.perf_counter() - t0) / step * 1e3:.1f} ms/step  "
                  f"{s.last.bytes_sent / 1e6:.2f} MB sent/step  {s.total.wait_seconds:.2f} s waiting in total",
                  flush=True)
    if args.elastic:
        group.leave()
    else:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
