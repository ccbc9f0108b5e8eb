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

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn

from shoal.comm.group import Group
from shoal.comm.meter import CommCounters, wire_bytes
from shoal.errors import ConfigError

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _noop(step: int) -> None:
    return None


@dataclass
class Trainer:
    """What the training loop needs from a strategy.

    ``before_step(step)`` runs after backward and before ``optimizer.step()``;
    ``after_step(step)`` after it (e.g. periodic averaging). ``comm()`` returns
    the bytes this worker has put on the wire since the strategy was built,
    as :class:`~shoal.comm.meter.CommCounters`. ``eval_module`` is the module
    whose parameters are evaluated (default: the module the strategy got).
    ``report_loss(value)``, if set, receives each step's training loss on
    this worker after the step (strategies that adapt to the loss, e.g. DASO).
    ``close()`` ends the run on this worker (e.g. leave a swarm) once the loop
    and its last evaluation are done; the worker calls it once.

    Example:
        >>> m = nn.Linear(2, 1)
        >>> t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> t.comm().bytes_sent
        0
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    before_step: Callable[[int], None] = _noop
    after_step: Callable[[int], None] = _noop
    comm: Callable[[], CommCounters] = field(default=CommCounters)
    eval_module: nn.Module | None = None
    report_loss: Callable[[float], None] | None = None
    close: Callable[[], None] = lambda: None


# (module, make_optimizer, group) -> Trainer; group is None for single-worker strategies.
Builder = Callable[[nn.Module, OptimizerFactory, "Group | None"], Trainer]


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy: its builder and how many workers it runs on.

    ``single_worker`` strategies run one process with the whole global batch
    instead of one process per host.
    """

    name: str
    build: Builder
    description: str
    single_worker: bool = False
    communicates: bool = True


_REGISTRY: dict[str, StrategySpec] = {}


def register(
    name: str, *, description: str, single_worker: bool = False, communicates: bool = True
) -> Callable[[Builder], Builder]:
    """Decorator adding a strategy builder under ``name`` (names are unique).

    Example:
        >>> @register("doc-example", description="plain local training", single_worker=True)
        ... def _b(module, make_optimizer, group):
        ...     return Trainer(module, make_optimizer(module.parameters()))
        >>> get("doc-example").single_worker
        True
        >>> unregister("doc-example")
    """
    if not name or "," in name or name != name.strip():
        raise ConfigError(f"strategy name must be non-empty without commas or outer spaces, got {name!r}")

    def deco(fn: Builder) -> Builder:
        if name in _REGISTRY:
            raise ConfigError(f"strategy {name!r} is already registered")
        _REGISTRY[name] = StrategySpec(name, fn, description, single_worker, communicates)
        return fn

    return deco


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (for tests and examples)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> StrategySpec:
    """The strategy registered as ``name``; a ConfigError lists the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; available: {', '.join(available())}") from None


def available() -> list[str]:
    """Registered strategy names, in registration order."""
    return list(_REGISTRY)


def grad_bytes(module: nn.Module) -> int:
    """Bytes of all trainable parameters' gradients (one full gradient exchange)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


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


# The library's own strategies register themselves on import (after the built-ins above).
from shoal.bench import entries as _entries  # noqa: E402,F401
