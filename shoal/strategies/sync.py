"""The synchronous strategy: shoal's DistributedDataParallel (gradients averaged every step)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from shoal.codecs.base import Codec
from shoal.comm.group import Group
from shoal.errors import ConfigError
from shoal.parallel import DistributedDataParallel
from shoal.strategies.base import Strategy
from shoal.membership.catchup import OptimizerReplay
from shoal.strategies.rounds import run_round


class Sync(Strategy):
    """Average gradients during backward, every step: plain data parallelism.

    :func:`shoal.wrap` with this strategy (its default) returns a
    :class:`shoal.DistributedDataParallel`; ``codec`` compresses the gradients.
    On an :class:`~shoal.elastic.ElasticGroup` each ``optimizer.step()``
    ends the elastic step: it votes, and a step discarded on every member
    (a peer was lost) is skipped with its gradients dropped
    (``FailurePolicy.DISCARD``); the optimizer's state heals into newcomers.
    A step whose averaged gradients hold a NaN/Inf is skipped on every rank
    together (the mean is the same everywhere: no vote; on an elastic group
    it is committed, not discarded) and counted in
    ``comm_stats().total.nonfinite_skips``.

    Args:
        codec: gradient codec (``None``: exact all-reduce).
        bucket_cap_mb: gradient bucket size cap.
        broadcast_buffers: broadcast buffers from rank 0 before each forward.
        find_unused_parameters: see :class:`shoal.DistributedDataParallel`.

    Example::

        model, opt = shoal.wrap(model, opt, shoal.strategies.Sync(codec=shoal.codecs.Cast()))
    """

    name = "ddp"

    def __init__(self, codec: Codec | None = None, bucket_cap_mb: float = 25.0,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False) -> None:
        super().__init__()
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a shoal.codecs.Codec, got {type(codec).__name__}")
        self.codec = codec
        self._ddp_kwargs: dict[str, Any] = dict(
            bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
        )

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        self._bind(model, optimizer, group)
        ddp = DistributedDataParallel(model, process_group=group, codec=self.codec, **self._ddp_kwargs)
        key = group.unique_name("ddp/optimizer")
        group.register_state(key, optimizer.state_dict, optimizer.load_state_dict)
        group.register_replay(OptimizerReplay(optimizer, key))   # elastic: a background heal replays steps
        return ddp

    def before_step(self) -> bool | None:
        """End the step: its verdict (always True on a static group; elastic: False drops it everywhere)."""
        if self.group is None:
            raise ConfigError("Sync is not set up: use shoal.wrap(model, optimizer, strategy)")
        return run_round(self.group)

    def after_step(self) -> None:
        self._mark_step()

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict() if self.codec is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.codec is not None and state.get("codec") is not None:
            self.codec.load_state_dict(state["codec"])
