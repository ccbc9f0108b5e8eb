"""One worker of the elastic NonBlocking / ZeRO fault tests (per-step gradient strategies, DISCARD).

``--kind nonblocking``: ``shoal.wrap(net, opt, NonBlocking(), process_group=group)``.
``--kind zero``: ``shoal.DistributedDataParallel(net, process_group=group)`` and a
``ZeroRedundancyOptimizer`` on the same elastic group (``--replicate``: ring replicas;
``--overlap``: the optimizer handed to the DDP, stepped bucket by bucket during backward,
three buckets of :data:`OVERLAP_CAP_MB`).

Started by harness.py as a plain process (so that it can be SIGKILLed and
restarted). Data: an :class:`ElasticSampler` without shuffling, so the test
can rebuild every committed step's global batch from its cursor and sample count. The
loop is the user's; every worker stops at the first step start at or past
``--steps`` committed steps once the last four commits had ``--want-size``
members (a count healed into newcomers, so all members stop together).
Writes ``<out>/<rank>-<incarnation>.pt``: the batches of every committed step
(``{step: (cursor, size, samples)}``), final parameters and optimizer state (ZeRO:
this member's shard and replica, keyed by global parameter index), counters.
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
from shoal.elastic import ElasticGroup, ElasticOptimizer, ElasticSampler, Timeouts
from shoal.testing import FaultPlan
from harness import save_and_leave
from forked import run_and_end

N, BATCH = 256, 8
OVERLAP_CAP_MB = 0.0003   # ~78 floats: make_net(0) falls into 3 buckets (head, middle, first layer)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 16, generator=g)
    return x, torch.tanh(x @ torch.randn(16, 4, generator=g))


def make_net(seed: int, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))


def optim_args(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if name == "adam":
        return torch.optim.Adam, {"lr": 1e-2}
    return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}


def state_tensors(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {k: v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for i, st in state.items()}


def _net_from(init: list[torch.Tensor]) -> nn.Module:
    net = make_net(0)
    with torch.no_grad():
        for p, v in zip(net.parameters(), init):
            p.copy_(v)
    return net


def _train_fault_free(model: nn.Module, opt: Any, batches: dict[int, tuple[int, int, int]], rank: int,
                      world: int) -> None:
    """The elastic run's committed batches, this rank's slice of each, one optimizer step each."""
    x, y = data()
    for step in range(len(batches)):
        cursor, size, _ = batches[step]
        assert size == world, "the reference runs fault-free elastic runs only"
        idx = torch.arange(cursor + rank * BATCH, cursor + (rank + 1) * BATCH) % N
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()


def static_nonblocking(rank: int, world: int, init: list[torch.Tensor],
                       batches: dict[int, tuple[int, int, int]]) -> list[torch.Tensor]:
    """The reference run: NonBlocking on a static world group, from ``init``, over ``batches``.

    ``shoal.testing.run_workers`` calls it in each process. Step ``k`` of a
    quorum of ``size`` reads samples ``cursor + rank * BATCH`` onwards (the
    sampler's slice of rank ``rank``), as the elastic run did.
    """
    torch.set_num_threads(1)
    net = _net_from(init)
    cls, kw = optim_args("adam")
    model, opt = shoal.wrap(net, cls(net.parameters(), **kw), shoal.NonBlocking())
    _train_fault_free(model, opt, batches, rank, world)
    model.finalize()   # type: ignore[operator]
    return [p.detach().clone() for p in net.parameters()]


def static_zero_overlap(rank: int, world: int, init: list[torch.Tensor],
                        batches: dict[int, tuple[int, int, int]]) -> list[torch.Tensor]:
    """The reference run: ZeRO overlapped with DDP on a static world group, from ``init``, over ``batches``."""
    torch.set_num_threads(1)
    net = _net_from(init)
    cls, kw = optim_args("adam")
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), cls, **kw)
    model = shoal.DistributedDataParallel(net, bucket_cap_mb=OVERLAP_CAP_MB, optimizer=zero)
    _train_fault_free(model, zero, batches, rank, world)
    zero.wait_for_params()
    return [p.detach().clone() for p in net.parameters()]


class _Both:
    """Two optimizers stepped as one (NonBlocking's blocking fall-back); state keyed by global index."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        state, base = {}, 0
        for o in self.opts:
            sd = o.state_dict()
            state.update({base + i: st for i, st in sd["state"].items()})
            base += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["nonblocking", "zero", "ddp"], required=True)
    ap.add_argument("--optim", choices=["adam", "sgdm"], default="adam")
    ap.add_argument("--replicate", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="ZeRO: DistributedDataParallel(..., optimizer=zero)")
    ap.add_argument("--consolidate", action="store_true", help="ZeRO: consolidate the state on rank 0 at the end")
    ap.add_argument("--codec", choices=["none", "powersgd"], default="none", help="NonBlocking's codec")
    ap.add_argument("--nb", choices=["plain", "hier", "fallback"], default="plain",
                    help="NonBlocking: hierarchical=True over pretend hosts h{RANK // 2}, or its blocking "
                         "fall-back (two optimizers: the first layer's and the rest's)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", type=float, default=5.0)
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--want-size", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--width", type=int, default=32, help="hidden width (measurements; the tests use 32)")
    ap.add_argument("--global-batch", type=int, default=0, help="ElasticSampler(global_batch=...) (0: batch_size)")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step (pretend compute)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    timeouts = Timeouts(op=a.op, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0,
                        quorum=a.op + 10, join=a.op + 60)
    group = ElasticGroup(timeouts=timeouts, min_workers=a.min_workers,
                         backend_factory=FaultPlan.from_env().backend_factory(),
                         host_id=f"h{rank // 2}" if a.nb == "hier" else None)
    net = make_net(100 + 10 * rank + life, a.width)   # different on purpose: the first heal must equalise
    cls, kw = optim_args(a.optim)
    full = {"rounds": 0}
    group.register_state("test/full", lambda: dict(full), full.update)
    group.on_commit(lambda: full.update(rounds=full["rounds"] + 1 if group.size == a.want_size else 0))
    sampler = (ElasticSampler(N, group, global_batch=a.global_batch, shuffle=False) if a.global_batch
               else ElasticSampler(N, group, batch_size=BATCH, shuffle=False))
    zero = None
    if a.kind == "nonblocking":
        codec = shoal.codecs.PowerSGD(rank=2, min_compression_rate=1.0, start_iter=0) if a.codec == "powersgd" else None
        if a.nb == "fallback":
            params = list(net.parameters())
            opts = [cls(params[:2], **kw), cls(params[2:], **kw)]
            model, _ = shoal.NonBlocking(codec=codec).wrap(net, opts, process_group=group)
            opt = _Both(opts)  # type: ignore[assignment]
        else:
            model, opt = shoal.wrap(net, cls(net.parameters(), **kw),
                                    shoal.NonBlocking(codec=codec, hierarchical=a.nb == "hier" or None),
                                    process_group=group)
    elif a.kind == "ddp":   # the baseline: DDP with the unsharded optimizer
        model = shoal.DistributedDataParallel(net, process_group=group)
        opt = ElasticOptimizer(cls(net.parameters(), **kw), group)  # type: ignore[assignment]
    else:
        zero = shoal.ZeroRedundancyOptimizer(net.parameters(), cls, process_group=group,
                                             replicate=a.replicate, **kw)
        if a.overlap:
            model = shoal.DistributedDataParallel(net, process_group=group, optimizer=zero,
                                                  bucket_cap_mb=OVERLAP_CAP_MB)
        else:
            model = shoal.DistributedDataParallel(net, process_group=group)
        opt = zero
    x, y = data()
    batches: dict[int, tuple[int, int, int]] = {}   # committed step -> (cursor, quorum size, samples)
    counted: dict[int, int] = {}   # step -> members whose gradients count (a background joiner's do not)
    init: list[torch.Tensor] | None = None      # parameters at this worker's first step (healed)
    t0, first = time.perf_counter(), 0
    while True:
        idx = sampler.next_batch()    # NonBlocking: votes the last exchange first; then starts the step
        if init is None:
            init = [p.detach().clone() for p in net.parameters()]
            t0, first = time.perf_counter(), group.step
        if group.step >= a.max_steps or (group.step >= a.steps and (not a.want_size or full["rounds"] >= 4)):
            break
        batches[group.step] = (sampler.cursor, group.size, sampler.last_global)
        counted[group.step] = group.contribution()[1]
        if os.environ.get("GRAD_WORKER_VERBOSE"):
            print(f"rank {rank}.{life} step {group.step} size {group.size} stats {group.stats}", flush=True)
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if a.pace:
            time.sleep(a.pace)
    result: dict[str, Any] = {"rank": rank, "life": life, "step": group.step, "batches": batches, "init": init,
                              "contributors": {k: counted[k] for k in batches},
                              "params": [p.detach().clone() for p in net.parameters()],
                              "stats": vars(group.stats),
                              "tags": {t: c.bytes_sent for t, c in group.meter.by_tag().items()},
                              "s_per_step": (time.perf_counter() - t0) / max(group.step - first, 1)}
    if a.kind == "ddp" or a.nb == "fallback":
        result["state"] = state_tensors(opt.state_dict()["state"])
    elif zero is None:
        result["state"] = state_tensors(opt.state_dict()["state"])
        exchange = model._exchange  # type: ignore[union-attr]
        result["exchange"] = {"commits": exchange.commits, "discards": exchange.discards}
    else:
        el = zero._shards
        assert el is not None
        result["state"] = state_tensors(el.held_state(replica=False))
        result["replica"] = state_tensors(el.held_state(replica=True))
        result["zero"] = {**vars(el.stats), "size": zero.world_size}
        if a.consolidate:
            zero.consolidate_state_dict(to=0)
            if zero.rank == 0:
                result["consolidated"] = state_tensors(zero.state_dict()["state"])
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
