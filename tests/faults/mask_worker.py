"""A worker for ``shoal run --elastic`` tests: a tiny causal attention model whose state holds -inf.

Started by harness.run_launcher. The model keeps an additive causal mask
buffer of -inf above the diagonal (the form torch's
``nn.Transformer.generate_square_subsequent_mask`` returns), so every heal
sends legitimately non-finite state. shoal DDP on an ElasticGroup trains
``--steps`` steps; each life writes ``<out>/<rank>-<life>.pt`` (parameters,
committed steps, heals) and leaves. ``--crash-at-end RANK``: that rank's
first life exits 1 right after its last step, after its leave
(``--crash-before-leave``: instead of it, once the others have left): a
crash at the very end of the run. ``--raise-in-training RANK``: that rank's
first life raises after step 3 through a ``leave()`` in a ``finally:``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, ElasticOptimizer, Timeouts
from harness import save_and_leave
from forked import run_and_end

T, D = 6, 8


class MaskedAttention(nn.Module):
    """One head of causal self-attention over a (T, D) sequence with an additive -inf mask buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.register_buffer("mask", torch.triu(torch.full((T, T), float("-inf")), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(D, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / D ** 0.5 + self.mask, dim=-1)
        return self.out(att @ v)


def train_one(model: nn.Module, opt: ElasticOptimizer, g: torch.Generator) -> None:
    x = torch.randn(4, T, D, generator=g)
    F.mse_loss(model(x), x.flip(1)).backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--crash-at-end", type=int, default=-1)
    ap.add_argument("--crash-before-leave", action="store_true")
    ap.add_argument("--raise-in-training", type=int, default=-1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    timeouts = Timeouts(op=10.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=5.0, quorum=20.0, join=30.0)
    group = ElasticGroup(timeouts=timeouts)
    torch.manual_seed(rank)            # different initial weights: only a heal makes them equal
    net = MaskedAttention()
    model = shoal.DistributedDataParallel(net, process_group=group)
    opt = ElasticOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), group)
    g = torch.Generator().manual_seed(10 + rank)
    if rank == a.raise_in_training and life == 0:
        try:                     # a crash in the middle of training, through a leave() in a finally:
            while True:          # that leave must not pass the crash off as a finished part
                train_one(model, opt, g)
                if group.step == 3:
                    raise RuntimeError("a crash in the middle of training")
        finally:
            group.leave()
    while group.step < a.steps:
        train_one(model, opt, g)
    params = [p.detach().clone() for p in net.parameters()]
    result = {"rank": rank, "life": life, "params": params, "step": group.step, "heals": group.stats.heals_received,
              "mask_ok": torch.equal(net.mask, torch.triu(torch.full((T, T), float("-inf")), 1))}
    crash = rank == a.crash_at_end and life == 0
    if crash and a.crash_before_leave:
        torch.save(result, os.path.join(a.out, f"{rank}-{life}.pt"))
        # Crash only once the others have left, so that the launcher always meets a run that is over
        # (a crash while they still train would be restarted into it: the usual policy).
        while int(group.client.store.add(group.client.key("finished"), 0)) < 2:
            time.sleep(0.05)
        os._exit(1)
    save_and_leave(a.out, rank, life, result, group)
    if crash:
        sys.exit(1)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
