"""One worker of the lost-host and partition tests (test_lost_host_partition.py): elastic DDP on a small MLP.

Started by the test inside an emulated host's namespace. Unlike
tests/faults/elastic_worker.py it writes every step as it happens
(``<out>/steps-<rank>-<life>.jsonl``, one line per step: committed or not,
the quorum id, its members, this member's id, a digest of model + optimizer
state), so that the test can watch progress while the run goes on and read
what a worker did even if it never finishes; and several ranks can park at
once (a whole host stopped at a known step). At the end it writes
``<out>/<rank>-<life>.pt`` (harness.save_and_leave).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from elastic_worker import digest
from harness import save_and_leave
from shoal.elastic import ElasticGroup, ElasticOptimizer, ElasticSampler, Timeouts


def _park(out: str, rank: int) -> None:
    """Write ``<out>/parked-<rank>`` (this pid) and wait to be killed."""
    tmp = os.path.join(out, f"parked-{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(out, f"parked-{rank}"))
    while True:
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--want-size", type=int, default=0,
                    help="after --steps, go on until a step ran with this many workers (the lost ones rejoined)")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--op", type=float, default=5.0)
    ap.add_argument("--quorum", type=float, default=15.0)
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--pace", type=float, default=0.05, help="seconds of sleep per step (pretend compute)")
    ap.add_argument("--park-at", type=int, default=0, help="the first incarnation of --park-ranks stops here")
    ap.add_argument("--park-ranks", default="", help="comma-separated ranks that park at --park-at")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.quorum, join=a.quorum + 60)
    group = ElasticGroup(timeouts=timeouts, min_workers=a.min_workers)
    group.heal_chunk = 4096
    torch.manual_seed(100 + 10 * rank + life)   # different on purpose: the first heal must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    model = shoal.DistributedDataParallel(net, process_group=group)
    opt = ElasticOptimizer(inner, group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    data = ElasticSampler(512, group, batch_size=16)
    parks = {int(r) for r in a.park_ranks.split(",") if r}
    log, path = [], os.path.join(a.out, f"steps-{rank}-{life}.jsonl")
    with open(path, "a", buffering=1) as f:
        while group.step < a.steps or (group.size < a.want_size and group.step < a.max_steps):
            if a.park_at and life == 0 and rank in parks and group.step == a.park_at:
                _park(a.out, rank)
            idx = data.next_batch()
            opt.zero_grad()
            F.mse_loss(model(x[idx]), y[idx]).backward()
            q = group.quorum
            committed = opt.step()
            rec = {"t": time.time(), "step": group.step, "committed": committed, "size": group.size,
                   "qid": q.qid if q else 0, "members": list(q.members) if q else [],
                   "member": group.client.member_id, "digest": digest(net, inner),
                   "error": None if committed else str(group.error)[:200]}
            log.append(rec)
            f.write(json.dumps(rec) + "\n")
            if a.pace:
                time.sleep(a.pace)
    result = {"log": log, "model": net.state_dict(), "opt": inner.state_dict(),
              "stats": vars(group.stats), "cursor": data.cursor, "rank": rank, "life": life}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    main()
