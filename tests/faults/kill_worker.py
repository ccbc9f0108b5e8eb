"""One worker of the between-rounds kill tests: shoal.wrap(net, Adam, <strategy>) on an ElasticGroup, gloo on loopback.

``--strategy`` is one of the averaging strategies (DiLoCo, streaming DiLoCo
with or without overlapped reductions, local SGD, post-local SGD,
Hierarchical, DASO). Rank ``--victim`` SIGKILLs itself right after optimizer
step ``--kill-at`` (between two of the strategy's rounds; with ``--rejoin``
the harness restarts it and the survivors also wait until the restart is in
a published quorum, so the next round admits it). The survivors park right
after that same step until their quorum's abort flag is raised (the kill was
detected: by the peer watch, or by the coordinator's ``heartbeat_timeout``,
which the test sets far longer than the park may wait), so the next round
always starts after the detection, whatever the machine's speed. It must then
commit at its first attempt over the survivors (no round discarded).
Everyone stops at the first step at or past ``--steps`` right after a round
that every member takes part in (streaming DiLoCo: then ``close()`` merges
what is in flight). Writes ``<out>/<rank>-<life>.pt``: the steps at which a
step or round was discarded, when the kill was detected (``detected``: the
step, or -1 if the park gave up), the quorum sizes of committed steps, and
what every survivor must hold equal.
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
from harness import save_and_leave
from strategy_worker import synced_state
from forked import run_and_end

PERIOD = 4
STRATEGIES = ["diloco", "streaming", "streaming-overlap", "localsgd", "postlocal", "postlocal-group", "hierarchical",
              "daso"]


def make_strategy(name: str, steps: int) -> Any:
    """The strategy, with rounds every PERIOD optimizer steps (DASO: every step is a voted step)."""
    if name == "diloco":
        return shoal.DiLoCo(inner_steps=PERIOD)
    if name in ("streaming", "streaming-overlap"):   # rounds (launches) after steps 2 and 0 mod 4; overlap: lands +1
        return shoal.StreamingDiLoCo(inner_steps=PERIOD, fragments=2, overlap_steps=int(name != "streaming"),
                                     mixing=0.0)
    if name == "localsgd":       # averages after steps 1, 5, 9, ...
        return shoal.LocalSGD(period=PERIOD, average_optimizer_state=True)
    if name == "postlocal":      # a gradient round per step up to 6, then averages after steps 7, 11, 15, ...
        return shoal.PostLocalSGD(period=PERIOD, warmup_steps=6, average_optimizer_state=True)
    if name == "postlocal-group":   # also a gradient round per step after it, inside launch slots {0, 1}, {2}
        return shoal.PostLocalSGD(period=PERIOD, warmup_steps=6, local_group_size=2, average_optimizer_state=True)
    if name == "hierarchical":   # launch slots {0, 1} and {2} after steps 3, 7, ...; everyone after 1, 5, 9, ...
        return shoal.Hierarchical({2: 2, 4: 4}, average_optimizer_state=True)
    if name == "daso":           # hosts {0, 1} and {2}; global syncs every step in the first epoch, then fewer
        return shoal.DASO(total_epochs=steps // PERIOD, steps_per_epoch=PERIOD, warmup_epochs=1, cooldown_epochs=1,
                          max_global_skips=4, stability_level=0.9)
    raise SystemExit(f"unknown strategy {name}")


def step_of(strategy: Any) -> int:
    return int(strategy.schedule.step if isinstance(strategy, shoal.DASO) else strategy.step)


def synced(strategy: Any) -> bool:
    """Right after a round of every member (so that every survivor holds the same synced_state)."""
    s = step_of(strategy)
    if isinstance(strategy, (shoal.DiLoCo, shoal.DASO)):   # DASO: one host is left, its DDP keeps it equal
        return s % PERIOD == 0
    warmup = strategy.warmup_steps if isinstance(strategy, shoal.PostLocalSGD) else 0
    return (s - warmup - 1) % PERIOD == 0


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
    ap.add_argument("--strategy", choices=STRATEGIES, default="diloco")
    ap.add_argument("--park", type=float, default=20.0, help="longest wait for the detection (s)")
    ap.add_argument("--rejoin", action="store_true",
                    help="the survivors also wait until the restarted victim is in a published quorum")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    # heartbeat_timeout far above the park: the coordinator's own timeout never detects the kill in time;
    # only the peer watch (a window of `probe` seconds, then the coordinator's probe) does.
    timeouts = Timeouts(op=10.0, heartbeat_interval=0.1, probe=1.0, heartbeat_timeout=60.0, quorum=90.0, join=120.0)
    group = ElasticGroup(timeouts=timeouts, min_workers=2, host_id=f"h{rank // 2}")
    # The joiner at its first download request: its step, whether it was admitted yet (a download begun while it
    # waited for its round, CatchUp.prefetch) and whether it was in a round or past a quorum's barrier.
    first_chunk: dict[str, Any] = {"step": None}

    def before_chunk(source: int, received: int) -> None:
        if first_chunk["step"] is None:
            first_chunk.update(step=group.step, admitted=group.catchup.stats.admitted_step >= 0,
                               in_round=bool(group._in_step or group._entering))
    group.catchup.before_chunk = before_chunk
    torch.manual_seed(100 + 10 * rank)   # different on purpose: the start state must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    strategy = make_strategy(a.strategy, a.steps)
    sizes: list[int] = []
    group.on_commit(lambda: sizes.append(group.size))
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    model, opt = shoal.wrap(net, inner, strategy, process_group=group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    pick = torch.Generator().manual_seed(1000 * rank)
    discarded: list[int] = []
    detected: int | None = None
    def done() -> bool:
        if not (step_of(strategy) >= a.steps and synced(strategy)):
            return False
        # --rejoin: also until the joiner contributes (caught up; the same answer on every member after a
        # round), so that a download slower than the last rounds is not cut short (bounded at 4x the steps)
        return not a.rejoin or group.contribution()[1] == group.size or step_of(strategy) >= 4 * a.steps

    while not done():
        idx = torch.randint(0, 256, (16,), generator=pick)
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        discards = group.stats.discards
        opt.step()
        opt.zero_grad()
        if isinstance(strategy, shoal.DASO):
            strategy.report_loss(loss.item())
        if group.stats.discards > discards:
            discarded.append(step_of(strategy))
        if step_of(strategy) == a.kill_at and life == 0 and detected is None:
            if rank == a.victim:
                os.kill(os.getpid(), signal.SIGKILL)
            q, t0 = group.quorum, time.monotonic()
            while q is not None and not group.client.abort.raised(q.prefix) and time.monotonic() < t0 + a.park:
                time.sleep(0.01)
            detected = step_of(strategy) if q is not None and group.client.abort.raised(q.prefix) else -1
            while a.rejoin and detected >= 0 and not restarted(group, q) and time.monotonic() < t0 + 90:
                time.sleep(0.02)
    discards = group.stats.discards
    if isinstance(strategy, shoal.StreamingDiLoCo):
        strategy.close()   # the reduction launched last lands in a round of every member
    if group.stats.discards > discards:
        discarded.append(step_of(strategy))
    result = {"discarded": discarded, "detected": detected, "sizes": sizes, "stats": vars(group.stats),
              "suspected": group.watcher.suspected,
              "catchup": asdict(group.catchup.stats), "first_chunk_step": first_chunk["step"],
              "first_chunk": first_chunk,
              "synced": [t.clone() for t in synced_state(strategy, model, inner)], "rank": rank, "life": life,
              "step": step_of(strategy)}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
