"""Heat's non-blocking mode: per-layer gradient all-reduce in backward, update in the next forward.

Each *layer* (a module owning parameters directly) has a flat gradient buffer.
As soon as backward has produced all of a layer's gradients its all-reduce is
started; nothing waits at the end of backward and ``optimizer.step()`` returns
at once. In the next forward a pre-hook on each layer waits for that layer's
reduction and applies the layer's optimizer update just before the layer runs,
so the network transfer of one layer overlaps the rest of backward, the
optimizer step and the forward of the layers before it.

The trajectory is that of synchronous data-parallel training: each update is
computed from the averaged gradients of the step before and applied before
the layer is next used, with the hyperparameters (learning rate, ...) that
were current when ``optimizer.step()`` was called. What lags by one step is
what you see *between* steps: after ``optimizer.step()`` returns, parameters
still hold the previous step's update. ``model.eval()``, ``model.state_dict()``,
``optimizer.state_dict()`` and :meth:`NonBlockingModule.finalize` apply what is
pending. See docs/nonblocking.md; on an elastic group each exchange is a voted
elastic step (see :class:`NonBlocking` and docs/elastic.md).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from shoal.codecs.base import Codec, common_dtype
from shoal.codecs.hierarchical import reduction_codec
from shoal.comm.group import Group, Handle
from shoal.comm.meter import CommStats, StepMeter
from shoal.comm.topology import Topology
from shoal.errors import ConfigError, ShoalError
from shoal.strategies.base import Strategy, broadcast_module

TAG = "nonblocking/grad"


class _Layer:
    """One module's own trainable parameters, their flat buffer and per-step state."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[nn.Parameter], names: list[str]) -> None:
        self.index, self.name, self.module = index, name, module
        self.params, self.names = params, names
        dtype = common_dtype(params)
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer.narrow(0, offset, p.numel()).view(p.shape))
            offset += p.numel()
        self.got = [False] * len(params)
        self.work: Handle | ThreadFuture | None = None
        self.pending = False  # reduced (or reducing) gradients not yet applied

    def reset(self) -> None:
        self.got = [False] * len(self.params)


def find_layers(model: nn.Module) -> list[_Layer]:
    """Layers in the order their gradients are usually ready: reverse registration.

    A parameter shared by several modules belongs to the first that registers it.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    found: list[tuple[str, nn.Module, list[nn.Parameter]]] = []
    for mod_name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            found.append((mod_name, mod, own))
    return [_Layer(i, n, m, ps, [names[id(p)] for p in ps]) for i, (n, m, ps) in enumerate(reversed(found))]


class _Exchange:
    """Per-layer reductions started in backward and finished in the next forward."""

    def __init__(self, layers: list[_Layer], optimizer: torch.optim.Optimizer, group: Group,
                 codec: Codec | None, elastic: bool = False) -> None:
        self.layers, self.optimizer, self.group, self.codec = layers, optimizer, group, codec
        self.elastic = elastic               # one vote per exchange, when it is waited (see end_step)
        self.commits = 0                     # elastic: exchanges applied
        self.discards = 0                    # elastic: exchanges dropped on every member
        self._where = {id(p): (layer, slot) for layer in layers for slot, p in enumerate(layer.params)}
        self._group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._thread: ThreadPoolExecutor | None = None
        self._armed = False
        self._started = False
        self._next = 0                       # next layer index to launch this backward
        self._step_hparams: list[dict[str, Any]] | None = None  # snapshot taken by optimizer.step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for layer in layers for p in layer.params]
        self._hooks += [layer.module.register_forward_pre_hook(self._pre_hook(layer)) for layer in layers]

    # --- backward: start reductions ------------------------------------------
    def arm(self) -> None:
        self._armed, self._started, self._next = True, False, 0
        for layer in self.layers:
            layer.reset()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        layer, slot = self._where[id(p)]
        if layer.pending:
            raise ShoalError(
                f"layer {layer.name!r} got a new gradient while last step's was not applied yet: "
                "NonBlocking needs optimizer.step() between two backward passes (no gradient accumulation)"
            )
        if not self._started:
            self._started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if layer.got[slot]:
            raise ShoalError(f"parameter {layer.names[slot]!r} received a gradient twice in one backward")
        grad, view = p.grad, layer.views[slot]
        if grad is None:  # pragma: no cover - the hook only fires after accumulation
            return
        with torch.no_grad():
            if self.codec is None:
                torch.div(grad, self.group.size, out=view)  # the sum of these is the mean
            else:
                view.copy_(grad)
        p.grad = None  # the local gradient is on its way; .grad is refilled with the mean
        layer.got[slot] = True
        self._launch_ready()

    def _launch_ready(self, end: bool = False) -> None:
        # In index order only, so collectives pair up on every rank.
        while self._next < len(self.layers):
            layer = self.layers[self._next]
            if not all(layer.got) and not end:
                return
            if any(layer.got):
                for slot, got in enumerate(layer.got):
                    if not got:
                        layer.views[slot].zero_()
                layer.work = self._launch(layer)
                layer.pending = True
            self._next += 1

    def _launch(self, layer: _Layer) -> Handle | ThreadFuture:
        if self.codec is None:
            return self.group.all_reduce(layer.buffer, op="sum", tag=TAG)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-nonblocking")
        codec, group = self.codec, self.group
        return self._thread.submit(lambda: codec.mean(layer.views, layer.names, group, TAG))

    def _end_of_backward(self) -> None:
        self._launch_ready(end=True)
        self._armed = False

    # --- step and forward: finish reductions -----------------------------------
    def request_step(self) -> None:
        """``optimizer.step()``: remember the hyperparameters; the update lands in the next forward."""
        if not self.pending():
            # Nothing in flight (e.g. finalised before step): the means are in .grad already.
            self.optimizer.step()
            return
        self._step_hparams = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _pre_hook(self, layer: _Layer) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if layer.pending and self._step_hparams is not None:
                if self.elastic:   # one vote for the whole exchange: never a layer alone
                    self.end_step()
                else:
                    self.apply([layer])

        return hook

    def pending(self) -> list[_Layer]:
        return [layer for layer in self.layers if layer.pending]

    def end_step(self) -> None:
        """Elastic: ``start_step``'s hook; ends the elastic step of a requested exchange.

        The exchange launched in a backward is that backward's elastic step:
        wait for every layer's reduction, vote, then apply it (commit) or drop
        it (discard: the means and the step request are forgotten, parameters
        and optimizer state stay as they were, on every member alike). Called
        before the next step starts, so a quorum change or heal never finds an
        exchange in flight.
        """
        if self._step_hparams is not None and self.pending():
            self._vote()

    def _vote(self) -> None:
        from shoal.comm.elastic import ElasticGroup

        todo = self.pending()
        for layer in todo:
            self._wait(layer)
        if not isinstance(self.group, ElasticGroup):  # pragma: no cover - elastic is set with it
            raise ShoalError("an elastic exchange needs an ElasticGroup")
        if self.group.should_commit():
            self.commits += 1
            self.apply(todo)
            return
        self.discards += 1
        for layer in todo:
            layer.pending = False
            for p in layer.params:
                p.grad = None
        self._step_hparams = None

    def apply(self, layers: Sequence[_Layer]) -> None:
        """Wait for ``layers``' reductions, put the means in ``.grad``, step them if a step was requested."""
        for layer in layers:
            self._wait(layer)
            with torch.no_grad():
                for p, view, got in zip(layer.params, layer.views, layer.got):
                    p.grad = view.clone() if got else None
            layer.pending = False
        if self._step_hparams is not None:
            self._step_only([p for layer in layers for p in layer.params if p.grad is not None])
            for layer in layers:
                for p in layer.params:
                    p.grad = None
        if not self.pending():
            self._step_hparams = None

    def _wait(self, layer: _Layer) -> None:
        if isinstance(layer.work, Handle):
            layer.work.wait()
        elif isinstance(layer.work, ThreadFuture):
            t0 = time.perf_counter()
            layer.work.result()
            self.group.meter.add_wait(TAG, time.perf_counter() - t0)
        layer.work = None

    def _step_only(self, params: list[torch.Tensor]) -> None:
        """One optimizer step restricted to ``params``, with the snapshot's hyperparameters."""
        groups = self.optimizer.param_groups
        saved = [dict(g) for g in groups]
        subset: list[list[torch.Tensor]] = [[] for _ in groups]
        for p in params:
            subset[self._group_of[id(p)]].append(p)
        try:
            for g, snap, ps in zip(groups, self._step_hparams or [], subset):
                g.update(snap)
                g["params"] = ps
            self.optimizer.step()
        finally:
            for g, old in zip(groups, saved):
                g.clear()
                g.update(old)

    def finalize(self) -> None:
        """Apply everything pending (or, without a requested step, leave the means in ``.grad``)."""
        if self._armed and self._started:
            raise ShoalError("cannot finalise during backward")
        todo = self.pending()
        if todo and self.elastic:
            self._vote()
        elif todo:
            self.apply(todo)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class NonBlockingModule(nn.Module):
    """The module :class:`NonBlocking` returns: the user's model with per-layer exchange hooks.

    ``eval()``, ``state_dict()`` and :meth:`finalize` apply pending updates;
    layers the forward skipped get theirs at the end of the forward.

    Example::

        model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shoal.NonBlocking())
        ...
        model.finalize()          # end of training: parameters now include the last step
    """

    def __init__(self, module: nn.Module, exchange: _Exchange, group: Group, broadcast_buffers: bool) -> None:
        super().__init__()
        self.module = module
        self._exchange = exchange
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self._steps = StepMeter(group.meter, "nonblocking")
        self._first_forward = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._exchange.elastic and torch.is_grad_enabled() and self.training:
            # Votes last step's exchange (the group's before_start_step hook), then adopts the latest
            # quorum (rebuild, heal) before this step's first collective.
            self.group.start_step()  # type: ignore[attr-defined]
        if self.broadcast_buffers and self.training and self.group.size > 1:  # eval may run on one rank
            buffers = list(self.module.buffers())
            if buffers:
                _broadcast_tensors(buffers, self.group)
        out = self.module(*args, **kwargs)
        # Layers this forward skipped (dynamic graphs) get last step's update now.
        skipped = self._exchange.pending()
        if skipped and self._exchange._step_hparams is not None:
            if self._exchange.elastic:
                self._exchange.end_step()   # one vote for the whole exchange
            else:
                self._exchange.apply(skipped)
        if torch.is_grad_enabled() and self.training:
            self._exchange.arm()
            if not self._first_forward:
                self._steps.mark_step()  # a step's traffic: from one training forward to the next
            self._first_forward = False
        return out

    def finalize(self) -> None:
        """Wait for every pending reduction and apply its update (end of training, checkpoints)."""
        self._exchange.finalize()

    def train(self, mode: bool = True) -> "NonBlockingModule":
        if not mode:
            self.finalize()  # evaluate the parameters training has reached
        super().train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.finalize()
        return super().state_dict(*args, **kwargs)

    def comm_stats(self) -> CommStats:
        """Bytes and seconds blocked on gradient reductions: last step and total."""
        return self._steps.stats()

    def remove_hooks(self) -> None:
        """Finish pending work and detach every hook (the module trains locally again)."""
        self.finalize()
        self._exchange.remove()


def _broadcast_tensors(tensors: list[torch.Tensor], group: Group) -> None:
    with torch.no_grad():
        for t in tensors:
            group.broadcast(t.detach(), src=0, tag="nonblocking/buffers").wait()


class NonBlocking(Strategy):
    """Heat's non-blocking data parallelism (SPEC E1) as a strategy.

    Args:
        codec: how each layer's gradients travel (default: exact all-reduce).
        hierarchical: two-level reduction across hosts, as in
            :class:`shoal.DistributedDataParallel` (``None``: automatic).
        broadcast_buffers: broadcast buffers from rank 0 before each forward.

    With :func:`shoal.wrap` the module returned is a
    :class:`NonBlockingModule` and ``optimizer.step()`` only records the step
    (and the hyperparameters at that moment). With an optimizer whose
    parameters are not exactly the model's trainable ones, or several
    optimizers (through :meth:`wrap`), it warns and falls back to blocking:
    :class:`shoal.DistributedDataParallel` and ordinary steps.

    On an :class:`~shoal.elastic.ElasticGroup` each step's exchange is one
    elastic step: started by the forward (or ``ElasticSampler.next_batch``)
    before the backward that launches it, voted when it is waited, at the
    start of the next step (or by ``finalize()``, ``eval()``,
    ``state_dict()``). Commit: the update is applied as usual; discard: it is
    dropped on every member alike (``FailurePolicy.DISCARD``). The whole
    exchange is waited for before the next forward's first layer (one vote,
    so no layer may step alone): the forward no longer overlaps the
    transfer. The module, the optimizer and the codec (``newcomer_state``)
    heal into newcomers; there is never an exchange in flight when they do.
    ``hierarchical=True`` and the blocking fall-back raise ``ConfigError``.

    Example::

        model, opt = shoal.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-4), shoal.NonBlocking())
        for x, y in loader:
            loss = loss_fn(model(x), y)      # each layer applies last step's update just before it runs
            loss.backward()                  # each layer's all-reduce starts as soon as its grads exist
            opt.step(); opt.zero_grad()      # returns at once
        model.eval()                         # finalises: parameters include every step
    """

    name = "nonblocking"

    def __init__(self, codec: Codec | None = None, hierarchical: bool | None = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a shoal.codecs.Codec, got {type(codec).__name__}")
        if hierarchical is not None and not isinstance(hierarchical, bool):
            raise ConfigError(f"hierarchical must be True, False or None (automatic), got {hierarchical!r}")
        self.codec = codec
        self.hierarchical = hierarchical
        self.broadcast_buffers = broadcast_buffers
        self.topology: Topology | None = None
        self.blocking = False  # True once it fell back
        self._exchange: _Exchange | None = None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        from shoal.comm.elastic import ElasticGroup

        reason, single = _fallback_reason(model, optimizer)
        if single is None:
            return self._fall_back(model, group, reason)
        if isinstance(group, ElasticGroup):
            return self._setup_elastic(model, single, group)
        self._bind(model, single, group)
        from shoal.parallel import check_same_model

        check_same_model(group, list(zip(self.names, self.params)))
        broadcast_module(model, group, tag="nonblocking/init")
        codec, self.topology = reduction_codec(group, self.codec, self.hierarchical)
        self._exchange = _Exchange(find_layers(model), single, group, codec)
        return NonBlockingModule(model, self._exchange, group, self.broadcast_buffers)

    def _setup_elastic(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any) -> nn.Module:
        """No collective: the first quorum's heal copies one member's state everywhere (as DDP does)."""
        if self.hierarchical:
            raise ConfigError("hierarchical=True is not supported on an elastic group: host subgroups would "
                              "have to be rebuilt at every quorum; leave it None (flat) or pass False")
        self._bind(model, optimizer, group)
        codec = self.codec
        group.register_state("nonblocking/module", model.state_dict, model.load_state_dict)
        group.register_state("nonblocking/optimizer", optimizer.state_dict, optimizer.load_state_dict)
        if codec is not None:  # a discarded exchange may have half-updated it: roll back on discard
            group.register_state("nonblocking/codec", codec.state_dict, codec.load_state_dict, rollback=True,
                                 heal_load=lambda s: codec.load_state_dict(codec.newcomer_state(s)))
        self._exchange = _Exchange(find_layers(model), optimizer, group, codec, elastic=True)
        group.before_start_step(self._exchange.end_step)
        return NonBlockingModule(model, self._exchange, group, self.broadcast_buffers)

    def _fall_back(self, model: nn.Module, group: Group, reason: str) -> nn.Module:
        from shoal.comm.elastic import ElasticGroup
        from shoal.parallel import DistributedDataParallel

        if isinstance(group, ElasticGroup):
            raise ConfigError(f"NonBlocking cannot fall back to blocking on an elastic group ({reason}): the "
                              "optimizers would step without a vote; use shoal.strategies.Sync (DDP) with one "
                              "optimizer, or one optimizer over exactly the model's trainable parameters")

        warnings.warn(f"NonBlocking falls back to blocking gradient all-reduce (shoal.DistributedDataParallel): "
                      f"{reason}", UserWarning, stacklevel=3)
        self.blocking, self._bound, self.group, self.module = True, True, group, model
        self._meter = StepMeter(group.meter, "")
        return DistributedDataParallel(model, process_group=group, codec=self.codec,
                                       hierarchical=self.hierarchical, broadcast_buffers=self.broadcast_buffers)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
             process_group: Any = None) -> tuple[nn.Module, Any]:
        """:func:`shoal.wrap`, also accepting several optimizers (which fall back to blocking).

        Example::

            model, (opt_a, opt_b) = shoal.NonBlocking().wrap(model, [opt_a, opt_b])   # warns: blocking
        """
        from shoal.averagers import as_group
        from shoal.wrap import wrap

        if isinstance(optimizer, torch.optim.Optimizer):
            return wrap(model, optimizer, self, process_group)
        reason, single = _fallback_reason(model, optimizer)
        if single is None:
            return self._fall_back(model, as_group(process_group), reason), optimizer
        return wrap(model, single, self, process_group)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None) -> Any:
        if self._exchange is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            raise ShoalError("NonBlocking defers the update to the next forward; step(closure) is not supported")
        self._exchange.request_step()
        return None

    def after_step(self) -> None:
        self._mark_step()

    def flush(self) -> None:
        if self._exchange is not None:
            self._exchange.finalize()

    def close(self) -> None:
        self.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict() if self.codec is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.codec is not None and state.get("codec") is not None:
            self.codec.load_state_dict(state["codec"])


def _fallback_reason(model: nn.Module, optimizer: Any) -> tuple[str, torch.optim.Optimizer | None]:
    """Why non-blocking updates cannot be used here (Heat's two limits), or the one optimizer."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(opt).__name__}")
    if len(optimizers) != 1:
        return f"{len(optimizers)} optimizers (per-layer updates need exactly one)", None
    model_ids = {id(p) for p in model.parameters() if p.requires_grad}
    opt_ids = {id(p) for g in optimizers[0].param_groups for p in g["params"]}
    if model_ids != opt_ids:
        return (f"the optimizer holds {len(opt_ids - model_ids)} parameter(s) outside the model's trainable ones "
                f"and misses {len(model_ids - opt_ids)} of them; per-layer updates need exactly the model's"), None
    return "", optimizers[0]
