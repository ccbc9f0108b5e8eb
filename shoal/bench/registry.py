"""The benchmark's strategy registry: what a strategy builds (:class:`Trainer`) and the names.

:mod:`shoal.bench.strategies` registers the built-in strategies and imports
:mod:`shoal.bench.entries` (the library's own); both register here, and
readers go through :mod:`shoal.bench.strategies`, which re-exports this
module's names, so that every strategy is registered when one is looked up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn

from shoal.comm.group import Group
from shoal.comm.meter import CommCounters
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
    and its last evaluation are done; the worker calls it once. ``drain()``
    waits for this worker's communication still in flight without changing
    what training computes; the worker calls it on the clock before each
    evaluation, so that no transfer finishes unseen during the paused clock.
    ``synced()``, if set, says whether the evaluated model has taken in an
    exchange yet (the bench credits no evaluation before that); unset, a byte
    on the meter says so, which is wrong only for a strategy that sends
    before it merges (an overlapped DiLoCo).

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
    drain: Callable[[], None] = lambda: None
    synced: Callable[[], bool] | None = None


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
