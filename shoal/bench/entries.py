"""The library's strategies as bench entries (issues #4 to #6).

Each entry builds the strategy exactly as a user would, on the worker's world
group, and reports the bytes its own collectives put on the wire (the meter's
tags of that strategy, so the benchmark's control traffic is left out).
Parametrised variants get their own names (``powersgd-r8``, ``diloco-h100``),
so a bench command line says exactly what ran.
"""

from __future__ import annotations

import inspect
from typing import Callable, Protocol

import torch
from torch import nn

import shoal
from shoal import codecs
from shoal.bench.registry import OptimizerFactory, Trainer, register
from shoal.comm.group import Group
from shoal.comm.meter import CommCounters, Meter
from shoal.strategies.outer import OuterSGD
from shoal.errors import ConfigError


def _need_group(name: str, group: Group | None) -> Group:
    if group is None:
        raise ConfigError(f"strategy {name!r} needs a process group (it runs on every worker)")
    return group


class _Metered(Protocol):
    @property
    def meter(self) -> Meter: ...


def _counter(group: _Metered, *prefixes: str) -> Callable[[], CommCounters]:
    """Bytes under ``prefixes`` since now (setup traffic such as the initial broadcast excluded)."""
    def now() -> CommCounters:
        total = CommCounters()
        for p in prefixes:
            total = total + group.meter.counters(p)
        return total

    start = now()
    return lambda: now() - start


def _ddp_with(name: str, make_codec: Callable[[], codecs.Codec], description: str) -> None:
    @register(name, description=description)
    def build(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
        g = _need_group(name, group)
        model = shoal.DistributedDataParallel(module, process_group=g, codec=make_codec())
        return Trainer(model, make_optimizer(model.parameters()), comm=_counter(g, "ddp/grad"))


_ddp_with("fp16", lambda: codecs.Cast(torch.float16), "shoal DDP, gradients cast to fp16 on the wire")
_ddp_with("bf16", lambda: codecs.Cast(torch.bfloat16), "shoal DDP, gradients cast to bf16 on the wire")
_ddp_with("int8", lambda: codecs.Int8Blockwise(256), "shoal DDP, 8-bit blockwise gradients (block 256)")
_ddp_with("topk", lambda: codecs.ErrorFeedback(codecs.TopK(0.01)),
          "shoal DDP, top-1% gradients with error feedback")
_ddp_with("powersgd", lambda: codecs.PowerSGD(rank=4), "shoal DDP, PowerSGD rank 4 with error feedback")
for _r in (1, 2, 8, 16):
    _ddp_with(f"powersgd-r{_r}", (lambda r: lambda: codecs.PowerSGD(rank=r))(_r),
              f"shoal DDP, PowerSGD rank {_r} with error feedback")


def _wrapped(name: str, make_strategy: Callable[[], shoal.Strategy], description: str) -> None:
    @register(name, description=description)
    def build(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
        g = _need_group(name, group)
        strategy = make_strategy()
        model, opt = shoal.wrap(module, make_optimizer(module.parameters()), strategy, process_group=g)
        # The strategy tags its traffic with its own name (e.g. diloco/pseudograd). The DiLoCo family's
        # reductions in flight at an evaluation land first, on the clock (merged at their own step as always).
        drain = strategy.wait_in_flight if isinstance(strategy, shoal.DiLoCo) else (lambda: None)
        # An overlapped DiLoCo sends a round's bytes a step or more before its model takes the round in.
        synced = (lambda: strategy.merged_rounds > 0) if isinstance(strategy, shoal.DiLoCo) else None
        return Trainer(model, opt, comm=_counter(g, strategy.name), eval_module=model, drain=drain, synced=synced)


_wrapped("localsgd", lambda: shoal.LocalSGD(period=8), "local SGD, parameters averaged every 8 steps")
_wrapped("hierarchical", lambda: shoal.Hierarchical({4: 2, 16: 4}),
         "hierarchical SGD: pairs every 4 steps, all 4 workers every 16")
for _h in (20, 100):
    _wrapped(f"diloco-h{_h}", (lambda h: lambda: shoal.DiLoCo(inner_steps=h, codec=codecs.Cast(torch.float16)))(_h),
             f"DiLoCo, {_h} inner steps, fp16 pseudo-gradients, outer Nesterov lr 0.7")
    _wrapped(f"diloco-h{_h}-int8", (lambda h: lambda: shoal.DiLoCo(inner_steps=h, codec=codecs.Int8Blockwise(256)))(_h),
             f"DiLoCo, {_h} inner steps, int8 pseudo-gradients, outer Nesterov lr 0.7")
# Issue #22's outer-step and SparseLoCo measurements (docs/BENCHMARKS.md): the outer optimizer
# (avg: lr 1 without momentum, i.e. parameter averaging; m5: Nesterov lr 0.7 momentum 0.5; lr4:
# Nesterov lr 0.4 momentum 0.9; n1m5: Nesterov lr 1 momentum 0.5) and the SparseLoCo codec
# (sp: top 2 % of each 4096-element chunk in 2 bits with error feedback; d95: residual decay 0.95).
_OUTER = {"avg": OuterSGD(1.0, 0.0, False), "m5": OuterSGD(0.7, 0.5), "lr4": OuterSGD(0.4, 0.9),
          "n1m5": OuterSGD(1.0, 0.5), "n": OuterSGD(0.7, 0.9),
          "n1m3": OuterSGD(1.0, 0.3), "n1m7": OuterSGD(1.0, 0.7)}   # the outer momentum around 0.5 at H 5
_SPARSE = {"sp": (0.02, 1.0), "sp-d95": (0.02, 0.95), "sp4": (0.04, 1.0),   # (ratio, residual decay)
           "sp1": (0.01, 1.0), "sp04": (0.004, 1.0)}   # the same bytes as sp at H 10, sent more often
_SPARSE_TEXT = {"sp": "SparseLoCo (top 2 %, 2 bits)", "sp-d95": "SparseLoCo (top 2 %, 2 bits, residual decay 0.95)",
                "sp4": "SparseLoCo (top 4 %, 2 bits)", "sp1": "SparseLoCo (top 1 %, 2 bits)",
                "sp04": "SparseLoCo (top 0.4 %, 2 bits)"}
for _h, _sp, _o in ((20, None, "avg"), (20, None, "m5"), (20, None, "lr4"), (20, None, "n1m5"),
                    (10, "sp", "n"), (10, "sp", "m5"), (10, "sp-d95", "avg"), (10, "sp", "n1m5"), (20, "sp4", "m5"),
                    (5, "sp1", "n1m5"), (2, "sp04", "n1m5"), (5, "sp1", "n1m3"), (5, "sp1", "n1m7"),
                    (5, "sp1", "m5")):
    _codec = (lambda rd: lambda: codecs.SparseLoCo(rd[0], 2, decay=rd[1]))(_SPARSE[_sp]) if _sp else \
        (lambda: codecs.Cast(torch.float16))
    _name = f"diloco-h{_h}-{_sp}-{_o}".replace("-sp-d95-avg", "-sp-avg-d95") if _sp else f"diloco-h{_h}-{_o}"
    _wrapped(_name, (lambda h, o, c: lambda: shoal.DiLoCo(inner_steps=h, outer_optimizer=o, codec=c()))(
        _h, _OUTER[_o], _codec), f"DiLoCo, {_h} inner steps, {_SPARSE_TEXT[_sp] if _sp else 'fp16'} "
             f"pseudo-gradients, outer {_OUTER[_o]}")
_wrapped("diloco-sparse", lambda: shoal.DiLoCo(inner_steps=10, outer_optimizer=OuterSGD(1.0, 0.5),
                                                codec=codecs.SparseLoCo(0.02, 2)),
         "DiLoCo, 10 inner steps, SparseLoCo (top 2 % per 4096 in 2 bits, error feedback), outer Nesterov lr 1.0 "
         "momentum 0.5: over 400x fewer bytes than DDP (the config of diloco-h10-sp-n1m5)")

_wrapped("diloco-h5-sp1-n1m5-o1", lambda: shoal.StreamingDiLoCo(
    inner_steps=5, fragments=1, overlap_steps=1, merge="carry", outer_optimizer=_OUTER["n1m5"],
    codec=codecs.SparseLoCo(_SPARSE["sp1"][0], 2, decay=_SPARSE["sp1"][1])),
    "diloco-h5-sp1-n1m5 with its exchange behind the next inner step (StreamingDiLoCo, 1 fragment, overlap 1, "
    "merge='carry': no inner step lost)")
_wrapped("streaming-diloco",
         lambda: shoal.StreamingDiLoCo(inner_steps=100, fragments=4, codec=codecs.Cast(torch.float16)),
         "streaming DiLoCo, 100 inner steps, 4 staggered fragments, fp16")


def _zero(name: str, make_codec: Callable[[], codecs.Codec | None], description: str) -> None:
    @register(name, description=description)
    def build(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
        g = _need_group(name, group)
        probe = make_optimizer(module.parameters())  # the bench's optimizer class and settings
        accepted = inspect.signature(type(probe).__init__).parameters
        settings = {k: v for k, v in probe.defaults.items() if k in accepted}
        zero = shoal.ZeroRedundancyOptimizer(module.parameters(), type(probe), process_group=g, **settings)
        model = shoal.DistributedDataParallel(module, process_group=g, codec=make_codec(), optimizer=zero)
        # Overlapped ZeRO's parameter broadcasts land lazily: drained (on the clock) before an evaluation.
        return Trainer(model, zero, comm=_counter(g, "ddp/grad", "zero"), drain=zero.wait_for_params)


_zero("zero", lambda: None, "shoal DDP with ZeRO optimizer sharding, stepped during backward")
_zero("zero+powersgd", lambda: codecs.PowerSGD(rank=4), "ZeRO overlapped with DDP, PowerSGD rank 4 gradients")


@register("ddp-hier", description="shoal DDP forcing the two-level all-reduce (reduce in host, leaders, broadcast)")
def _ddp_hier(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    g = _need_group("ddp-hier", group)
    model = shoal.DistributedDataParallel(module, process_group=g, hierarchical=True)
    return Trainer(model, make_optimizer(model.parameters()), comm=_counter(g, "ddp/grad"))


@register("nonblocking", description="shoal.NonBlocking: per-layer all-reduce in backward, update in the next forward")
def _nonblocking(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    g = _need_group("nonblocking", group)
    strategy = shoal.NonBlocking()
    model, opt = shoal.wrap(module, make_optimizer(module.parameters()), strategy, process_group=g)
    # Before an evaluation the worker drains on the clock: flush() waits for the step's
    # reductions and applies their update (the update the next forward would apply, with the
    # same values), so the bare module then holds every step's update and no all-reduce
    # runs on while the clock is paused.
    return Trainer(model, opt, comm=_counter(g, "nonblocking"), eval_module=module, drain=strategy.flush)


@register("daso", description="shoal.DASO (10-step epochs, 1 warm-up epoch, no cool-down, max_global_skips=8)")
def _daso(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    g = _need_group("daso", group)
    # The bench stops on a step count or a time budget, not after a known number of epochs:
    # an open-ended total and no cool-down; epochs of 10 steps let the skips adapt within minutes.
    strategy = shoal.DASO(total_epochs=10**6, steps_per_epoch=10, warmup_epochs=1, cooldown_epochs=0,
                          max_global_skips=8, stability_level=0.05)
    model, opt = shoal.wrap(module, make_optimizer(module.parameters()), strategy, process_group=g)
    # Exact averaging inside hosts is the host-local DDP's traffic (ddp/...), global syncs are daso/...
    return Trainer(model, opt, comm=_counter(g, "daso", "ddp"), eval_module=module,
                   report_loss=strategy.report_loss)


def _leave_swarm(opt: shoal.CollaborativeOptimizer, coordinator: object) -> None:
    """At the end of the run: leave the swarm; rank 0 first waits (bounded) for the others to leave,
    then stops the coordinator (a peer still in a round would lose its store). The bound covers a peer
    still inside a round: it finishes or gives up within ``averaging_timeout``.

    A process that exits with its round groups and the coordinator's store server still live can
    abort in their threads.
    """
    import time

    from shoal.membership.coordinator import Coordinator

    try:
        if isinstance(coordinator, Coordinator):
            deadline = time.monotonic() + opt.config.averaging_timeout + opt.config.matchmaking_time + 10.0
            while opt.group.live_others() and time.monotonic() < deadline:   # a peer that left says so at once
                time.sleep(0.05)
        opt.shutdown()
    except Exception as e:  # noqa: BLE001 - at exit, a peer already gone must not turn a finished run into an error
        print(f"shoal bench collaborative: leaving the swarm failed: {e}", flush=True)
    finally:
        if isinstance(coordinator, Coordinator):
            coordinator.stop()


@register("collaborative", description="shoal.CollaborativeOptimizer: the swarm steps once every rank's batches "
          "add up to one global batch; coordinator on rank 0, matchmaking 1 s")
def _collaborative(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    import atexit
    import os
    import secrets
    from typing import cast

    from shoal.membership.coordinator import Coordinator

    g = _need_group("collaborative", group)
    # Rank 0 runs the coordinator (membership and the shared store) and tells the others its port
    # and a fresh run token, over the bench's group, before anything is counted.
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    coordinator = None
    setup = torch.zeros(2, dtype=torch.int64)
    if g.rank == 0:
        setup[1] = secrets.randbits(62)
        coordinator = Coordinator(port=0, host=host, initial_workers=g.size,
                                  token=f"bench-{int(setup[1]):016x}").start()
        setup[0] = coordinator.port
    g.broadcast(setup, src=0, tag="bench/setup").wait()
    # Batches, not samples: every rank of the bench trains on global_batch / world samples per step,
    # so counting one unit per step and a target of `world` units is the same weighting.
    cfg = shoal.CollaborativeConfig(run_id="bench", target_batch_size=g.size, batch_size_per_step=1,
                                    coordinator=f"{host}:{int(setup[0])}", token=f"bench-{int(setup[1]):016x}",
                                    matchmaking_time=1.0, average_state_every=0)
    opt = shoal.CollaborativeOptimizer(lambda ps: make_optimizer(cast(list[nn.Parameter], ps)),
                                       module.named_parameters(), config=cfg)
    opt.wait_for_peers(g.size, timeout=60.0)   # all ranks joined: nobody races ahead alone
    left = False

    def close() -> None:   # the worker's end of run; at exit too if the loop raised before it
        nonlocal left
        if not left:
            left = True
            _leave_swarm(opt, coordinator)
    atexit.register(close)
    # The bench loop calls zero_grad(set_to_none=True) and step() only, which CollaborativeOptimizer has.
    return Trainer(module, cast(torch.optim.Optimizer, opt), comm=_counter(opt.group, "collab"), eval_module=module,
                   close=close)
