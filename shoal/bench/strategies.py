"""Training strategies the benchmark can compare, registered by name.

A strategy turns a plain model and an optimizer factory into a
:class:`Trainer`: the model to call, the optimizer to step, hooks around the
step, and a counter of the bytes it put on the wire. The worker's training loop
(:mod:`shoal.bench.worker`) knows nothing else, so a later issue adds a
strategy by registering one function::

    @register("fp16", description="shoal DDP with gradients cast to fp16 on the wire")
    def _fp16(module, make_optimizer, group):
        model = shoal.DistributedDataParallel(module, codec="fp16")
        return Trainer(model, make_optimizer(model.parameters()),
                       comm=lambda: model.comm_stats().total)

Built in:

* ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel``. torch does
  not count bytes, so the meter figure is the ring all-reduce model applied to
  the model's gradient bytes every step
  (``wire_bytes("all_reduce", grad_bytes, world)``); bucketing splits the
  same bytes into several all-reduces and does not change that total beyond
  rounding. Interface counters (emulated clusters) give the real figure.
* ``ddp``: ``shoal.DistributedDataParallel``, counted by its own meter.
* ``local``: one worker with the whole global batch: per sample, the quality a
  perfect network would give.
* ``nosync``: every worker trains its own replica on its own slice of the
  batch with no communication at all: per second, the cluster's compute floor.
"""

from __future__ import annotations

import torch.nn as nn

from shoal.bench.registry import (Builder, OptimizerFactory, StrategySpec, Trainer, available, get, grad_bytes,
                                  register, unregister)
from shoal.comm.group import Group
from shoal.comm.meter import CommCounters, wire_bytes
from shoal.errors import ConfigError

__all__ = ["Builder", "OptimizerFactory", "StrategySpec", "Trainer", "available", "get", "grad_bytes",
           "register", "unregister"]

@register("torch-ddp", description="torch.nn.parallel.DistributedDataParallel (bucket_cap_mb=25)")
def _torch_ddp(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    if group is None:
        raise ConfigError("strategy 'torch-ddp' needs a process group (it runs on every worker)")
    size = group.size
    model = DistributedDataParallel(module, bucket_cap_mb=25)
    payload = grad_bytes(module)
    sent, received = wire_bytes("all_reduce", payload, size)
    steps = [0]

    def count(step: int) -> None:
        steps[0] += 1

    def comm() -> CommCounters:
        n = steps[0]
        return CommCounters(ops=n, payload_bytes=n * payload, bytes_sent=n * sent, bytes_received=n * received)

    return Trainer(model, make_optimizer(model.parameters()), after_step=count, comm=comm)


@register("ddp", description="shoal.DistributedDataParallel (bucket_cap_mb=25)")
def _shoal_ddp(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    try:
        from shoal.parallel import DistributedDataParallel
    except ImportError as e:
        raise ConfigError(
            "strategy 'ddp' needs shoal.parallel.DistributedDataParallel, which this checkout lacks "
            f"({e}); use 'torch-ddp' or update shoal"
        ) from e
    model = DistributedDataParallel(module, bucket_cap_mb=25)
    return Trainer(model, make_optimizer(model.parameters()), comm=lambda: model.comm_stats().total)


@register("local", description="one worker, whole global batch: per-sample quality of a perfect network",
          single_worker=True, communicates=False)
def _local(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    return Trainer(module, make_optimizer(module.parameters()))


@register("nosync", description="all workers, no communication: per-second compute floor",
          communicates=False)
def _nosync(module: nn.Module, make_optimizer: OptimizerFactory, group: Group | None) -> Trainer:
    return Trainer(module, make_optimizer(module.parameters()))


# The library's own strategies register after the built-ins above (registration order is listing order).
from shoal.bench import entries as _entries  # noqa: E402,F401
