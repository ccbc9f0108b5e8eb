"""One worker of the elastic strategy fault tests: shoal.wrap(..., process_group=ElasticGroup).

Started by harness.py as a plain process (so that it can be SIGKILLed and
restarted). The loop is the user's: ``loss.backward(); opt.step();
opt.zero_grad()``. Every worker stops at the first synchronised step (right
after a round) at or past ``--steps`` once the last four rounds had
exactly ``--want-size`` members (and some round ``--want-max``) (a count healed into newcomers), so all members stop together. Writes
``<out>/<rank>-<incarnation>.pt``: a log of every step (time, optimizer
step, committed rounds, quorum size, digest of the synchronised state) and
the final model, optimizer and strategy state.

Parking (so that a fault lands at the same place on any machine, fast or slow):
``--hold-restart`` keeps a restarted incarnation out of the run until a
survivor has committed a round without it (``<out>/alone``), and the
survivors then wait between two rounds until it is in a published quorum
(however long its start takes, they do not run to ``--max-steps`` without it);
``--admit-at S`` makes the first workers wait at optimizer step ``S`` (between
two rounds) until the coordinator has published a quorum with the joiner
(``RANK >= WORLD_SIZE``), which itself joins only once they are there
(``<out>/ready``): the joiner is then admitted right after the next round.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, Timeouts
from shoal.strategies.resume import ResumableMean
from shoal.testing import FaultPlan
from harness import save_and_leave
from forked import run_and_end

PERIOD = 4
PARK_S = 60.0   # a parked worker gives up waiting after this long (the test then fails, it does not hang)


def touch(out: str, name: str) -> None:
    tmp = os.path.join(out, f"{name}.{os.getpid()}.tmp")   # several workers may touch the same name
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(out, name))


def park(until: Callable[[], bool]) -> float:
    """Wait until ``until()`` (at most PARK_S); the seconds waited."""
    t0 = time.monotonic()
    while not until() and time.monotonic() < t0 + PARK_S:
        time.sleep(0.02)
    return time.monotonic() - t0


def digest(tensors: list[torch.Tensor]) -> float:
    """A position-weighted float64 sum (differs on any change)."""
    total = 0.0
    for t in tensors:
        flat = t.detach().double().reshape(-1)
        total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def synced_state(strategy: Any, model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What every member holds equal after a round.

    Averaging: parameters and the (averaged) Adam moments. DiLoCo: global
    copies and outer optimizer state, and parameters unless fragments are
    staggered (the inner optimizer's state is each worker's own by design).
    """
    if isinstance(strategy, shoal.DiLoCo):
        out = [p.detach() for p in model.parameters()] if strategy.config.fragments == 1 else []
        for f in strategy.fragments:
            out.append(f.snapshot)
            for st in f.outer.state_dict()["state"].values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out
    out = [p.detach() for p in model.parameters()]
    for st in opt.state_dict()["state"].values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def make_strategy(name: str) -> Any:
    if name == "localsgd":
        return shoal.LocalSGD(period=PERIOD, average_optimizer_state=True)
    if name == "postlocal":
        return shoal.PostLocalSGD(period=PERIOD, warmup_steps=6, average_optimizer_state=True)
    if name == "diloco":
        return shoal.DiLoCo(inner_steps=PERIOD, codec=shoal.codecs.PowerSGD(rank=2, min_compression_rate=1.0,
                                                                            start_iter=0))
    if name == "diloco-exact":     # the exact mean: its rounds are resumable (shoal.strategies.resume)
        return shoal.DiLoCo(inner_steps=PERIOD)
    if name == "streaming":
        return shoal.StreamingDiLoCo(inner_steps=PERIOD, fragments=2, overlap_steps=0, mixing=0.0)
    if name == "postlocal-group":   # gradients averaged inside launch slots {0, 1}, {2} after warm-up
        return shoal.PostLocalSGD(period=PERIOD, warmup_steps=6, local_group_size=2, average_optimizer_state=True)
    if name == "streaming-overlap":   # reductions in the background for one inner step
        return shoal.StreamingDiLoCo(inner_steps=PERIOD, fragments=2, overlap_steps=1, mixing=0.0)
    raise SystemExit(f"unknown strategy {name}")


def synced(strategy: Any) -> bool:
    """Right after a round (so every member holds the same synced_state)."""
    if isinstance(strategy, shoal.DiLoCo):
        return strategy.step % PERIOD == 0
    w = strategy.schedule.warmup_steps if isinstance(strategy, shoal.LocalSGD) else strategy.warmup_steps
    return strategy.step <= w or (strategy.step - w - 1) % PERIOD == 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["localsgd", "postlocal", "diloco", "diloco-exact", "streaming",
                                           "postlocal-group", "streaming-overlap"], default="localsgd")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="resumable rounds in chunks of at least this many bytes (16 at most; 0: the default)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", type=float, default=5.0)
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--want-size", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--want-max", type=int, default=0, help="and a round had at least this many members")
    ap.add_argument("--leave-rank", type=int, default=-1, help="this RANK leaves after its third round of three")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step (pretend compute)")
    ap.add_argument("--hold-restart", action="store_true",
                    help="a restarted incarnation waits until a survivor committed a round of --hold-size")
    ap.add_argument("--hold-size", type=int, default=2)
    ap.add_argument("--admit-at", type=int, default=-1,
                    help="the first workers wait at this optimizer step until the joiner is in a quorum")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    joiner = "WORLD_SIZE" in os.environ and rank >= int(os.environ["WORLD_SIZE"])   # started by --join
    if a.hold_restart and life > 0:
        park(lambda: os.path.exists(os.path.join(a.out, "alone")))
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.op + 10, join=a.op + 60)
    group = ElasticGroup(timeouts=timeouts, min_workers=a.min_workers,
                         backend_factory=FaultPlan.from_env().backend_factory())
    group.heal_chunk = 1024   # small models: heals still take many messages (the 4 MiB default would take one)
    torch.manual_seed(100 + 10 * rank + life)   # different on purpose: the first heal must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    strategy = make_strategy(a.strategy)
    # Consecutive committed rounds with at least --want-size members, healed into newcomers so that all agree when to stop.
    full = {"rounds": 0, "max": 0}
    group.register_state("test/full_rounds", lambda: dict(full), full.update)
    group.on_commit(lambda: full.update(rounds=full["rounds"] + 1 if group.size == a.want_size else 0,
                                        max=max(full["max"], group.size)))
    # A survivor committed a round of --hold-size ("seen"): it waits for the restarted worker once ("waited").
    alone = {"seen": False, "waited": False}
    if a.hold_restart and life == 0:
        def left_alone() -> None:
            if group.size == a.hold_size and not alone["seen"]:
                alone["seen"] = True
                touch(a.out, "alone")
        group.on_commit(left_alone)
    threes = [0]   # this worker's own count of committed rounds of three (when to leave)
    group.on_commit(lambda: threes.__setitem__(0, threes[0] + int(group.size == 3)))
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    pre: list[float] = []   # digest after the inner step, before the strategy's round
    if joiner and a.admit_at >= 0:
        park(lambda: os.path.exists(os.path.join(a.out, "ready")))
    model, opt = shoal.wrap(net, inner, strategy, process_group=group)
    if a.chunk_bytes:   # this small model in 16 chunks, so that a kill mid-round leaves some finished
        strategy.rounds.resume = ResumableMean(min_bytes=a.chunk_bytes, max_chunks=16)
    inner.register_step_post_hook(lambda *_: pre.append(digest(synced_state(strategy, model, opt))))
    log = [{"t": time.time(), "step": strategy.step, "round": group.step, "size": group.size, "joined": True,
            "digest": digest(synced_state(strategy, model, opt))}]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    pick = torch.Generator().manual_seed(1000 * rank + life)   # each worker its own stream of samples
    while not (strategy.step >= a.steps and synced(strategy) and full["max"] >= a.want_max
               and (full["rounds"] >= 4 or not a.want_size or strategy.step >= a.max_steps)):
        if rank == a.leave_rank and synced(strategy) and threes[0] >= 3:
            break    # a graceful leave() right after a round
        parked = 0.0   # seconds this step waited on purpose (not a stall)
        if not joiner and strategy.step == a.admit_at:
            touch(a.out, "ready")
            q = group.quorum
            parked += park(lambda: q is None or group.client.latest() > q.qid)
        if alone["seen"] and not alone["waited"]:
            alone["waited"] = True
            q = group.quorum
            parked += park(lambda: q is None or group.client.latest() > q.qid)
        idx = torch.randint(0, 512, (16,), generator=pick)
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append({"t": time.time(), "step": strategy.step, "round": group.step, "size": group.size,
                    "pre": pre[-1] if pre else None, "contributed": strategy.rounds.contributed,
                    "digest": digest(synced_state(strategy, model, opt)), "loss": loss.item(), "parked": parked})
        if a.pace:
            time.sleep(a.pace)
    rounds = strategy.rounds
    result = {"log": log, "model": net.state_dict(), "synced": [t.clone() for t in synced_state(strategy, model, opt)],
              "stats": vars(group.stats), "rank": rank, "life": life,
              "contributed": rounds.contributed, "skipped": rounds.skipped,
              "kept_chunks": rounds.resume.kept_chunks, "kept_bytes": rounds.resume.kept_bytes}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
