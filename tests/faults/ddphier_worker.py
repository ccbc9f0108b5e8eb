"""One worker of the elastic two-level DDP tests: ``DistributedDataParallel(hierarchical=True)``.

Worker ``RANK`` r pretends to be on host ``h{r // 2}``. ``static_worker``
(for ``run_workers``) trains the same model on the static world twice, with
shoal's DDP ``hierarchical=True`` and with torch's own DDP; ``main`` (a
plain process started by harness.py) trains it on an ``ElasticGroup``. The
batch of a step is a function of (RANK, step) only, so every run sees the
same data. ``--kill-step K``: in step K the first incarnation that leads
host h1 SIGKILLs itself in the middle of backward (after the last layers'
buckets were handed to the reduction). Writes ``<out>/<rank>-<life>.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from harness import save_and_leave
from forked import run_and_end

PER_HOST = 2


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 8, generator=g)
    return x, torch.tanh(x @ torch.randn(8, 2, generator=g))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(1000 * rank + step))


def momentum(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [state[i]["momentum_buffer"].clone() for i in sorted(state)]


def make_codec(name: str) -> Any:
    from shoal import codecs

    return codecs.PowerSGD(rank=2, min_compression_rate=1.0, start_iter=0) if name == "powersgd" else None


def static_worker(rank: int, world: int, steps: int, codec: str = "none") -> dict[str, Any]:
    """Shoal's static DDP(hierarchical=True) and torch's DDP, same data, on the static world."""
    import shoal

    os.environ["SHOAL_HOST_ID"] = f"h{rank // PER_HOST}"
    torch.set_num_threads(1)
    x, y = data()
    out: dict[str, Any] = {}
    for name in ("shoal", "torch"):
        net = make_net(0)
        if name == "shoal":
            model: nn.Module = shoal.DistributedDataParallel(net, hierarchical=True, bucket_cap_mb=0.002,
                                                             codec=make_codec(codec))
            assert model.topology is not None and model.topology.num_hosts == 2  # type: ignore[union-attr]
        else:
            model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.002)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for s in range(steps):
            idx = batch(rank, s)
            F.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
        out[name] = {"params": [p.detach().clone() for p in net.parameters()], "momentum": momentum(opt)}
        if name == "shoal":
            out[name]["tags"] = {t: c.bytes_sent for t, c in model.group.meter.by_tag().items()}  # type: ignore[union-attr]
    return out


def main() -> None:
    import shoal
    from shoal.elastic import ElasticGroup, ElasticOptimizer, Timeouts

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--op", type=float, default=5.0)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--want-full", type=int, default=0,
                    help="after --steps, go on until this many steps in a row had 4 members")
    ap.add_argument("--distinct-init", action="store_true", help="each (rank, life) starts from its own weights")
    ap.add_argument("--pace", type=float, default=0.0)
    ap.add_argument("--codec", choices=["none", "powersgd"], default="none", help="the leaders' inner codec")
    ap.add_argument("--auto", action="store_true", help="hierarchical=None: DDP chooses at each quorum")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    host = f"h{rank // PER_HOST}"
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.op + 25, join=a.op + 40)
    group = ElasticGroup(timeouts=timeouts, min_workers=2, host_id=host)
    full = {"n": 0}     # steps in a row with 4 members: healed into newcomers, so all stop together
    group.register_state("test/full", lambda: dict(full), full.update)
    group.on_commit(lambda: full.update(n=full["n"] + 1 if group.size == 4 else 0))
    net = make_net(100 + 10 * rank + life if a.distinct_init else 0)
    model = shoal.DistributedDataParallel(net, process_group=group, hierarchical=None if a.auto else True,
                                          bucket_cap_mb=0.002,
                                          codec=make_codec(a.codec))
    inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    opt = ElasticOptimizer(inner, group)
    armed = {"on": False}

    marker = os.path.join(a.out, "killed")   # the kill happens once, whatever quorums came before it

    def die(_g: torch.Tensor) -> None:
        if armed["on"]:     # mid-backward: later layers' buckets are already being reduced
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    net[0].weight.register_hook(die)   # type: ignore[index]
    x, y = data()
    log = []
    while group.step < a.steps or full["n"] < a.want_full:
        group.start_step()       # adopt the quorum first: a healed worker learns the step it is in
        s = group.step
        topo = model.topology
        assert topo is not None
        armed["on"] = (life == 0 and s == a.kill_step and host == "h1" and topo.is_leader
                       and not os.path.exists(marker))   # once: not h1's next leader in the re-run
        idx = batch(rank, s)
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        committed = opt.step()
        log.append({"t": time.time(), "step": s, "committed": committed, "size": group.size,
                    "hosts": topo.num_hosts, "leader": topo.is_leader})
        inner.zero_grad()
        if a.pace:
            time.sleep(a.pace)
    result = {"rank": rank, "life": life, "log": log, "stats": vars(group.stats),
              "params": [p.detach().clone() for p in net.parameters()], "momentum": momentum(inner),
              "tags": {t: c.bytes_sent for t, c in group.meter.by_tag().items()}}
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
