"""One worker of the elastic fault tests: shoal DDP (plain or PowerSGD) on an ElasticGroup.

DDP is built directly (``DistributedDataParallel`` + ``ElasticOptimizer``),
or with ``--wrap`` through ``shoal.wrap(net, opt, Sync(codec), process_group=group)``.

Started by harness.py as a plain process (so that it can be SIGKILLed and
restarted). Writes ``<out>/<rank>-<incarnation>.pt`` at the end: a log of
every step (committed or not, wall time, a digest of model + optimizer) and
the final model and optimizer state.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal import codecs
from shoal.elastic import ElasticGroup, ElasticOptimizer, ElasticSampler, Timeouts
from shoal.testing import FaultPlan
from harness import save_and_leave
from forked import run_and_end


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """A position-weighted float64 sum of parameters and optimizer state (differs on any change)."""
    total = 0.0
    tensors = [p.detach() for p in model.parameters()]
    for st in opt.state_dict()["state"].values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        flat = t.double().reshape(-1)
        total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "powersgd"], default="ddp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", type=float, default=5.0)
    ap.add_argument("--quorum", type=float, default=0.0, help="Timeouts.quorum (default: --op + 10)")
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--want-size", type=int, default=0,
                    help="after --steps, go on until a step ran with this many workers (a restart rejoined)")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--wrap", action="store_true", help="DDP through shoal.wrap(..., Sync(codec))")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step (pretend compute)")
    ap.add_argument("--park-at", type=int, default=0,
                    help="rank 1's first incarnation stops at this committed step, writes <out>/parked-1 "
                         "(its pid) and waits to be killed: a kill at a known step, whatever the machine's speed")
    ap.add_argument("--hold-at", type=int, default=0,
                    help="every worker, at this committed step (outside any step: no collective or vote in "
                         "flight), writes <out>/held-<rank> and waits while <out>/hold exists")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.quorum or a.op + 10, join=a.op + 40)
    group = ElasticGroup(timeouts=timeouts, min_workers=a.min_workers,
                         backend_factory=FaultPlan.from_env().backend_factory())
    group.heal_chunk = 1024   # small models: heals still take many messages (the 4 MiB default would take one)
    torch.manual_seed(100 + 10 * rank + life)   # different on purpose: the first heal must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    codec = codecs.PowerSGD(rank=2, min_compression_rate=1.0, start_iter=0) if a.mode == "powersgd" else None
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    opt: torch.optim.Optimizer | ElasticOptimizer
    if a.wrap:
        model, opt = shoal.wrap(net, inner, shoal.strategies.Sync(codec=codec, bucket_cap_mb=0.002),
                                process_group=group)
    else:
        model = shoal.DistributedDataParallel(net, process_group=group, codec=codec, bucket_cap_mb=0.002)
        opt = ElasticOptimizer(inner, group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    data = ElasticSampler(512, group, batch_size=16)
    log = []
    # The size of the last COMMITTED step, the same on every member: all stop together. (group.size
    # alone is the last step's quorum, committed or not: a member that stopped after a discarded step
    # of the wanted size left a joiner that was never healed alone in a finished run.)
    full = {"size": 0}
    group.on_commit(lambda: full.update(size=group.size))
    while group.step < a.steps or (full["size"] < a.want_size and group.step < a.max_steps):
        if a.park_at and rank == 1 and life == 0 and group.step == a.park_at:
            with open(os.path.join(a.out, "parked-1.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(a.out, "parked-1.tmp"), os.path.join(a.out, "parked-1"))
            while True:
                time.sleep(1)
        if a.hold_at and group.step == a.hold_at and not os.path.exists(os.path.join(a.out, f"held-{rank}")):
            open(os.path.join(a.out, f"held-{rank}"), "w").close()
            while os.path.exists(os.path.join(a.out, "hold")):
                time.sleep(0.01)
        idx = data.next_batch()
        opt.zero_grad()
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        commits = group.stats.commits
        opt.step()   # ElasticOptimizer says whether it committed; wrap's optimizer returns the loss
        committed = group.stats.commits > commits
        log.append({"t": time.time(), "step": group.step, "committed": committed, "size": group.size,
                    "digest": digest(net, inner), "loss": loss.item(),
                    "error": None if committed else str(group.error)})
        if a.pace:
            time.sleep(a.pace)
    result = {"log": log, "model": net.state_dict(), "opt": inner.state_dict(),
              "stats": vars(group.stats), "cursor": data.cursor, "rank": rank, "life": life}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
