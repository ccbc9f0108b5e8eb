"""One worker of the between-rounds kill test: shoal.wrap(net, Adam, DiLoCo) on an ElasticGroup, gloo on loopback.

Rank ``--victim`` SIGKILLs itself right after inner step ``--kill-at`` (between
two outer rounds; with ``--rejoin`` the harness restarts it and the survivors
also wait until the restart is in a published quorum, so the next outer round
admits it, with ``SHOAL_HEAL=background`` as a downloader). The survivors park right
after that same inner step until their quorum's abort flag is raised (the kill
was detected: by the peer watch, or by the coordinator's ``heartbeat_timeout``,
which the test sets far longer than the park may wait), so the next outer
round always starts after the detection, whatever the machine's speed. It must
then commit at its first attempt over the survivors (no round discarded).
Everyone stops after ``--steps`` inner steps (a round boundary). Writes
``<out>/<rank>-<life>.pt``: the steps of discarded rounds, when the kill was
detected (``detected``: the inner step, or None if the park gave up), the
quorum sizes of committed rounds, and what every survivor must hold equal.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, Timeouts
from diloco_heal_worker import synced_state
from harness import save_and_leave

PERIOD = 4


def restarted(group: ElasticGroup, q: Any) -> bool:
    """Whether the restarted victim is in the latest published quorum: one after ``q`` with three members again."""
    latest = group.client.latest()
    return latest > q.qid and len(group.client.quorum(latest).members) == 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=5)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--park", type=float, default=20.0, help="longest wait for the detection (s)")
    ap.add_argument("--rejoin", action="store_true",
                    help="the survivors also wait until the restarted victim is in a published quorum")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    # heartbeat_timeout far above the park: the coordinator's own timeout never detects the kill in time;
    # only the peer watch (a window of `probe` seconds, then the coordinator's probe) does.
    timeouts = Timeouts(op=10.0, heartbeat_interval=0.1, probe=1.0, heartbeat_timeout=60.0, quorum=90.0, join=120.0)
    group = ElasticGroup(timeouts=timeouts, min_workers=2)
    first_chunk: dict[str, int | None] = {"step": None}   # the joiner: its step at its first download request

    def before_chunk(source: int, received: int) -> None:
        if first_chunk["step"] is None:
            first_chunk["step"] = group.step
    group.catchup.before_chunk = before_chunk
    torch.manual_seed(100 + 10 * rank)   # different on purpose: the start state must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    strategy: Any = (shoal.DiLoCo(inner_steps=PERIOD) if a.fragments == 1 else
                     shoal.StreamingDiLoCo(inner_steps=PERIOD, fragments=a.fragments, overlap_steps=0, mixing=0.0))
    sizes: list[int] = []
    group.on_commit(lambda: sizes.append(group.size))
    model, opt = shoal.wrap(net, torch.optim.Adam(net.parameters(), lr=1e-2), strategy, process_group=group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    pick = torch.Generator().manual_seed(1000 * rank)
    discarded: list[int] = []
    detected: int | None = None
    while strategy.step < a.steps:
        idx = torch.randint(0, 256, (16,), generator=pick)
        F.mse_loss(model(x[idx]), y[idx]).backward()
        discards = group.stats.discards
        opt.step()
        opt.zero_grad()
        if group.stats.discards > discards:
            discarded.append(strategy.step)
        if strategy.step == a.kill_at:
            if rank == a.victim:
                os.kill(os.getpid(), signal.SIGKILL)
            q, t0 = group.quorum, time.monotonic()
            while q is not None and not group.client.abort.raised(q.prefix) and time.monotonic() < t0 + a.park:
                time.sleep(0.01)
            detected = strategy.step if q is not None and group.client.abort.raised(q.prefix) else None
            while a.rejoin and detected is not None and not restarted(group, q) and time.monotonic() < t0 + 90:
                time.sleep(0.02)
    result = {"discarded": discarded, "detected": detected, "sizes": sizes, "stats": vars(group.stats),
              "suspected": group.watcher.suspected,
              "catchup": asdict(group.catchup.stats), "first_chunk_step": first_chunk["step"],
              "synced": synced_state(strategy, model), "rank": rank, "life": life, "step": strategy.step}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    main()
