"""One worker of the elastic Hierarchical / DASO tests (hosts pretended from RANK).

``train`` runs the user's loop (``loss.backward(); opt.step(); opt.zero_grad()``)
on a static group (called by ``run_workers``) or an elastic one (``main``,
started by ``shoal run --elastic`` through the harness), with the same model,
data and seeds, so that a fault-free elastic run can be compared with the
static one. Worker ``RANK`` r is on host ``r // PER_HOST``. Writes
``<out>/<rank>-<incarnation>.pt`` (elastic) or returns (static): final
parameters, optimizer state, DASO's schedule events, a per-step log.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from harness import save_and_leave
from forked import run_and_end

PER_HOST = 2
HIER = {2: 2, 4: 4}


def make_strategy(name: str, epochs: int, spe: int) -> Any:
    if name == "hierarchical":
        return shoal.Hierarchical(HIER)
    if name == "postlocal":
        return shoal.PostLocalSGD(period=HIER, warmup_steps=6)
    if name == "daso":
        return shoal.DASO(total_epochs=epochs, steps_per_epoch=spe, warmup_epochs=1, cooldown_epochs=1,
                          max_global_skips=4, stability_level=0.9)
    raise SystemExit(f"unknown strategy {name}")


def train(rank: int, life: int, name: str, group: Any, epochs: int, spe: int, pace: float = 0.0,
          stop: Any = None, want_full: int = 0) -> dict[str, Any]:
    """Train; stop at the first synchronised step at or past ``stop`` (Hierarchical: a global
    averaging; DASO: the schedule's end) after which the last ``want_full`` committed elastic steps
    had 4 members (a count healed into newcomers, so all stop together)."""
    full = {"rounds": 0}
    if want_full:
        group.register_state("test/full_rounds", lambda: dict(full), full.update)
        group.on_commit(lambda: full.update(rounds=full["rounds"] + 1 if group.size == 4 else 0))
    torch.manual_seed(100 + 10 * rank * life)   # a restarted worker starts different: its heal must equalise
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    strategy = make_strategy(name, epochs, spe)
    opt0 = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, opt = shoal.wrap(net, opt0, strategy, process_group=group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 2, generator=g))
    log: list[dict[str, Any]] = []
    total = epochs * spe if name == "daso" else stop

    def step_of() -> int:
        return strategy.schedule.step if name == "daso" else strategy.step

    def done() -> bool:
        s = step_of()
        if name == "daso":   # past total_epochs every step is a blocking sync (the cool-down goes on)
            return s >= total and full["rounds"] >= want_full
        return s >= total and (s - 1) % 4 == 0 and full["rounds"] >= want_full

    first = step_of()
    while not done():
        s = step_of()
        pick = torch.Generator().manual_seed(1000 * rank + s)   # this rank's batch at step s
        idx = torch.randint(0, 256, (8,), generator=pick)
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if name == "daso":
            strategy.report_loss(loss.item())
        log.append({"step": s, "size": getattr(group, "size", 0), "t": time.time(),
                    "discards": group.stats.discards if hasattr(group, "stats") else 0})
        if pace:
            time.sleep(pace)
    state = opt0.state_dict()["state"]
    return {"rank": rank, "life": life, "first": first, "log": log,
            "params": [p.detach().clone() for p in net.parameters()],
            "momentum": [state[i]["momentum_buffer"].clone() for i in sorted(state)],
            "events": list(getattr(getattr(strategy, "schedule", None), "events", [])),
            "stats": vars(group.stats) if hasattr(group, "stats") else {},
            "skipped": strategy.rounds.skipped if name == "daso" else
                       strategy.elastic.skipped if getattr(strategy, "elastic", None) else 0}


def static_worker(rank: int, world: int, name: str, epochs: int, spe: int, stop: int) -> dict[str, Any]:
    """For ``shoal.testing.procs.run_workers``: the same training on the static world group."""
    os.environ["SHOAL_HOST_ID"] = f"h{rank // PER_HOST}"
    return train(rank, 0, name, shoal.Group(), epochs, spe, stop=stop)


def main() -> None:
    from shoal.elastic import ElasticGroup, Timeouts
    from shoal.testing import FaultPlan

    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["hierarchical", "postlocal", "daso"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--spe", type=int, default=6)
    ap.add_argument("--stop", type=int, default=24)
    ap.add_argument("--op", type=float, default=5.0)
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--pace", type=float, default=0.0)
    ap.add_argument("--want-full", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.op + 25, join=a.op + 60)   # quorum: room for a few op-long stalls in a row
    group = ElasticGroup(timeouts=timeouts, min_workers=a.min_workers, host_id=f"h{rank // PER_HOST}",
                         backend_factory=FaultPlan.from_env().backend_factory())
    result = train(rank, life, a.strategy, group, a.epochs, a.spe, a.pace, stop=a.stop, want_full=a.want_full)
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
