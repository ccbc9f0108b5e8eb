"""``shoal.wrap``: one call for every strategy; the training loop does not change."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.averagers import as_group
from shoal.errors import ConfigError
from shoal.local_module import LocalDataParallel
from shoal.strategies.base import Strategy, StrategyOptimizer
from shoal.strategies.sync import Sync


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy | None = None,
         process_group: Any = None) -> tuple[nn.Module, StrategyOptimizer]:
    """Set ``strategy`` up on ``model`` and ``optimizer``; return the module to train and the optimizer to step.

    Collective: every rank calls it, with the same model architecture and
    strategy. The returned optimizer is a real ``torch.optim.Optimizer``
    (``param_groups``, ``state``, ``zero_grad``, LR schedulers work) whose
    ``step()`` runs the strategy around the wrapped optimizer's step, and whose
    ``state_dict()`` also carries the strategy's state.

    The returned module has torch DDP's surface whatever the strategy:
    ``model.module`` is ``model`` as passed, ``no_sync()`` and
    ``require_backward_grad_sync`` are accepted, and ``state_dict()`` keys
    start with ``module.`` (load a torch DDP checkpoint into it unchanged;
    save ``model.module.state_dict()`` for bare keys). Strategies that
    average gradients return :class:`shoal.DistributedDataParallel`; local
    ones (local SGD, DiLoCo, ...) a :class:`shoal.local_module.LocalDataParallel`.

    Args:
        model: this rank's replica (on one device).
        optimizer: built over ``model.parameters()``.
        strategy: a :class:`shoal.Strategy` (default :class:`shoal.strategies.Sync`: DDP).
        process_group: ``None`` (world), a ProcessGroup or a :class:`shoal.Group`.

    Example::

        model, opt = shoal.wrap(model, torch.optim.AdamW(model.parameters()), shoal.LocalSGD(period=16))
        for x, y in data:
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()
    """
    if strategy is None:
        strategy = Sync()
    if not isinstance(strategy, Strategy):
        raise ConfigError(f"strategy must be a shoal.Strategy (e.g. shoal.LocalSGD(period=8)), got {type(strategy).__name__}")
    if isinstance(optimizer, StrategyOptimizer):
        raise ConfigError("this optimizer is already wrapped by shoal.wrap; pass the original optimizer")
    group = as_group(process_group)
    wrapped = strategy.setup(model, optimizer, group)
    if wrapped is model:  # a local strategy: give the model DDP's surface (.module, no_sync, module.* keys)
        wrapped = LocalDataParallel(model, type(strategy).__name__)
    return wrapped, StrategyOptimizer(optimizer, strategy)
