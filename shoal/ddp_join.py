"""Uneven inputs for shoal's DDP: torch's ``Join`` context manager, and DDP's other public methods.

With unequal shards a rank runs out of batches first. Under
``torch.distributed.algorithms.join.Join([model])`` that rank *joins*: while
the others still train, it shadows each of their iterations' collectives
(buffer broadcast, the sync flag, every gradient bucket's reduction) with
zeros, so nobody waits forever and the mean is the sum of the live ranks'
gradients divided by the initial world size (torch's default,
``divide_by_initial_world_size=True``). When all have joined, the last
joiner's parameters and buffers are broadcast, so every rank ends equal.

Example::

    from torch.distributed.algorithms.join import Join
    with Join([model]):                       # or: with model.join():
        for x, y in my_shard:                 # shards of different lengths
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from shoal.errors import ConfigError, ShoalError


class _ShadowHook(JoinHook):
    """Run on a joined rank once per iteration of the others (``main_hook``), then at the end."""

    def __init__(self, ddp: "JoinableDDP") -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class JoinableDDP(Joinable):
    """torch's Joinable protocol and DDP's remaining public methods, mixed into shoal's DDP."""

    # Provided by shoal.parallel.DistributedDataParallel:
    module: torch.nn.Module
    group: Any
    reducer: Any
    elastic: bool
    optimizer: Any
    require_backward_grad_sync: bool
    _forward_sync_buffers: bool = True

    @property
    def broadcast_buffers(self) -> bool:
        """Broadcast buffers from rank 0 before each forward (torch's name; ``forward_sync_buffers`` too)."""
        return self._forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._forward_sync_buffers = bool(value)

    @property
    def forward_sync_buffers(self) -> bool:
        return self._forward_sync_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self._forward_sync_buffers = bool(value)
    static_graph: bool
    _require_forward_param_sync: bool

    def _init_join(self) -> None:
        self._join_config = _JoinConfig.construct_disabled_join_config()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's shortcut for ``Join([self], ...)``: train on uneven inputs inside it.

        Only ``divide_by_initial_world_size=True`` is supported (the mean
        divides by the world size; a joined rank contributes zeros).
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook :class:`~torch.distributed.algorithms.join.Join` runs on a rank that has joined."""
        if not kwargs.get("divide_by_initial_world_size", True):
            raise ConfigError("divide_by_initial_world_size=False is not supported: shoal's DDP divides by the "
                              "world size (a joined rank contributes zeros); scale the loss by "
                              "world_size / live ranks yourself if you need the other mean")
        if self.elastic:
            raise ShoalError("Join is for static groups; on an elastic group a worker that runs out of data "
                             "simply leaves (shoal.elastic), and the others go on")
        if self.optimizer is not None:
            raise ShoalError("Join cannot shadow the bucket steps of optimizer= (a joined rank would step "
                             "its shards forever); step the ZeroRedundancyOptimizer after backward instead")
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        p = next(self.module.parameters())
        return p.device

    @property
    def join_process_group(self) -> Any:
        return self.group.pg

    # --- the live ranks' side: called from forward --------------------------------
    def _notify_join(self) -> None:
        """Tell a Join context this rank is still live, and agree on whether this iteration syncs."""
        if not self._join_config.enable:
            return
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()

    def _buffer_source(self, joined: bool = False) -> int:
        """Rank 0, or inside Join the highest live rank (rank 0 may have joined with stale buffers):
        torch's rule, one all-reduce."""
        if not self._join_config.enable:
            return 0
        me = torch.tensor([-1 if joined else self.group.rank], device=self.join_device)
        dist.all_reduce(me, op=dist.ReduceOp.MAX, group=self.group.pg)
        return int(me.item())

    def _agree_on_sync(self, joined: bool) -> bool:
        """Inside Join: one all-reduce of the sync flags, so a joined rank knows whether to shadow a
        backward (the live ranks may be in ``no_sync``)."""
        flag = torch.tensor([0 if joined or not self.require_backward_grad_sync else 1], device=self.join_device)
        dist.all_reduce(flag, group=self.group.pg)
        return bool(flag.item() > 0)

    # --- the joined rank's side ------------------------------------------------
    def _shadow_iteration(self) -> None:
        """Match one iteration of the live ranks: buffers, the sync flag, then a backward of zeros
        through the reducer (its buckets, codec and non-finite check run as on the others)."""
        buffers = list(self.module.buffers())
        if self._require_forward_param_sync and self.broadcast_buffers and buffers and self.group.size > 1:
            self.group.broadcast_coalesced(buffers, src=self._buffer_source(joined=True), tag="ddp/buffers")
        self._require_forward_param_sync = self._agree_on_sync(joined=True)   # as the live ranks' forward sets it
        if not self._require_forward_param_sync:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None   # contribute zeros, not what this rank accumulated before it joined
        # An empty slice's sum: a zero gradient of each parameter's shape, never NaN (0 * Inf would be).
        zero = torch.stack([p.reshape(-1)[:0].sum() for p in params]).sum()
        self.reducer.prepare_for_backward(zero)
        zero.backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Everyone takes the state of the highest rank among the last joiners (torch's rule)."""
        me = torch.tensor([self.group.rank if is_last_joiner else -1], device=self.join_device)
        dist.all_reduce(me, op=dist.ReduceOp.MAX, group=self.group.pg)
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        self.group.broadcast_coalesced(tensors, src=int(me.item()), tag="ddp/join")

    # --- DDP's other public methods --------------------------------------------
    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's meaning)."""
        return bool(self.broadcast_buffers and self.group.size > 1 and any(True for _ in self.module.buffers()))

    def _set_static_graph(self) -> None:
        """torch's older spelling of ``static_graph=True`` (shoal keeps it as a promise)."""
        self.static_graph = True

    def to_kwargs(self, *args: Any, **kwargs: Any) -> Any:
        raise ShoalError(_ONE_DEVICE)

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        raise ShoalError(_ONE_DEVICE)

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        raise ShoalError(_ONE_DEVICE)

    def _register_fused_optim(self, *args: Any, **kwargs: Any) -> None:
        raise ShoalError("_register_fused_optim is not supported: pass optimizer=shoal.ZeroRedundancyOptimizer(...) "
                         "to step each bucket as soon as it is reduced, or step your optimizer after backward")


_ONE_DEVICE = ("shoal's DDP runs one device per process and does not split inputs across devices (torch's "
               "multi-device scatter/gather/to_kwargs): move the batch with .to(device) before calling the model")
