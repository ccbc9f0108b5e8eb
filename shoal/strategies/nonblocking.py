"""Heat's non-blocking mode: per-layer gradient all-reduce in backward, update in the next forward.

Each *layer* (a module owning parameters directly) has a flat gradient buffer.
As soon as backward has produced all of a layer's gradients its all-reduce is
started; nothing waits at the end of backward and ``optimizer.step()`` returns
at once. The next forward's first pre-hook waits for the step's reductions
(normally done by then: the first layer a forward runs is the last one
launched), checks every mean for NaN/Inf with one fused check, and applies the
whole update before any module runs, or skips it on every rank alike. So the
network transfer overlaps the rest of backward, the optimizer call and
whatever the loop does between steps (data loading, logging).

The trajectory is that of synchronous data-parallel training: each update is
computed from the averaged gradients of the step before and applied before
any parameter is next used (shared, tied parameters included), with the
hyperparameters (learning rate, ...) that were current when
``optimizer.step()`` was called. What lags by one step is what you see
*between* steps: after ``optimizer.step()`` returns, parameters still hold the
previous step's update. ``model.eval()``, ``model.state_dict()``,
``optimizer.state_dict()`` and :meth:`NonBlockingModule.finalize` apply what is
pending. The engine is in :mod:`shoal.strategies.nonblocking_exchange`. See
docs/nonblocking.md; on an elastic group each exchange is a voted elastic step
(see :class:`NonBlocking` and docs/elastic.md).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from shoal.averagers import as_group
from shoal.codecs.base import Codec
from shoal.codecs.hierarchical import reduction_codec
from shoal.comm.group import Group
from shoal.comm.meter import CommStats, StepMeter
from shoal.comm.topology import Topology
from shoal.errors import ConfigError, ShoalError
from shoal.parallel import DistributedDataParallel
from shoal.strategies.base import Strategy, StrategyOptimizer
from shoal.strategies.nonblocking_exchange import TAG, Exchange, find_layers
from shoal.strategies.rounds import FailurePolicy, Rounds, run_round

__all__ = ["NonBlocking", "NonBlockingModule", "find_layers", "TAG"]


_NO_ACCUMULATION = ("NonBlocking cannot accumulate gradients (no_sync / require_backward_grad_sync=False): each "
                    "layer's gradients are sent during backward and applied in the next forward, so every "
                    "backward needs its optimizer.step(); use a larger batch, or shoal.strategies.Sync")


class NonBlockingModule(nn.Module):
    """The module :class:`NonBlocking` returns: the user's model with per-layer exchange hooks.

    ``eval()``, ``state_dict()`` and :meth:`finalize` apply pending updates.
    :meth:`comm_stats` counts the bytes, the seconds blocked and the steps
    skipped because a mean held NaN/Inf (``nonfinite_skips``).

    Example::

        model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shoal.NonBlocking())
        ...
        model.finalize()          # end of training: parameters now include the last step
    """

    def __init__(self, module: nn.Module, exchange: Exchange, group: Group, broadcast_buffers: bool) -> None:
        super().__init__()
        self.module = module
        self._exchange = exchange
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self._steps = StepMeter(group.meter, "nonblocking")
        self._first_forward = True
        self.require_backward_grad_sync = True   # torch DDP's flag: here it must stay True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Refused: each layer's gradients leave during backward and land in the next forward."""
        raise ShoalError(_NO_ACCUMULATION)
        yield  # pragma: no cover - a generator, like DDP's no_sync

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.require_backward_grad_sync:
            raise ShoalError(_NO_ACCUMULATION)
        if torch.is_grad_enabled() and self.training:
            # Launches this step's round: its begin_step first votes last step's exchange (the end_step
            # hook) and applies it; on an elastic group then adopts the latest quorum (rebuild, heal).
            self._exchange.begin()
        if self.broadcast_buffers and self.training and self.group.size > 1:  # eval may run on one rank
            buffers = list(self.module.buffers())
            if buffers:
                _broadcast_tensors(buffers, self.group)
        # The model's first pre-hook settles last step's exchange: the whole update (or a skip) lands before
        # any module runs, layers this forward will skip (dynamic graphs) and tied parameters included.
        out = self.module(*args, **kwargs)
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
        """Bytes, seconds blocked on gradient reductions and non-finite skips: last step and total."""
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
    (and the hyperparameters at that moment); the update lands in the next
    forward's first pre-hook, all of it at once, before any module runs (so
    tied weights are safe). If any mean holds NaN/Inf (some rank's gradients
    did), every rank skips that update together and counts it in
    ``comm_stats().total.nonfinite_skips``. With an optimizer whose
    parameters are not exactly the model's trainable ones, or several
    optimizers (through :meth:`wrap`), it warns and falls back to blocking:
    :class:`shoal.DistributedDataParallel` and ordinary steps.

    Each step's exchange is one typed round (:mod:`shoal.strategies.rounds`)
    that stays in flight across the optimizer step, on static and elastic
    groups alike: launched by the forward (its step begun there or by
    ``ElasticSampler.next_batch``) before the backward that issues its
    reductions, voted by the runner (``Rounds.land``) when it is waited, at
    the start of the next step (or by ``finalize()``, ``eval()``,
    ``state_dict()``). On a static group the vote is always "commit". On an
    :class:`~shoal.elastic.ElasticGroup`: commit, the update is applied as
    usual (or skipped if non-finite); discard, it is dropped on every member
    alike (``FailurePolicy.DISCARD``). The vote comes before the next step's
    forward, so the forward does not overlap the transfer. The module, the
    optimizer and the codec (``newcomer_state``) heal into newcomers; there
    is never an exchange in flight when they do. ``hierarchical=True`` on an
    elastic group rebuilds the host and leader subgroups at each quorum
    (``group.host_groups``); ``None`` stays flat there. The blocking
    fall-back votes each step too: the first optimizer ``step()`` after a
    backward commits or discards it (a discarded step's gradients are
    dropped, so every optimizer's step changes nothing), and the optimizers'
    states heal into newcomers.

    Example::

        model, opt = shoal.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-4), shoal.NonBlocking())
        for x, y in loader:
            loss = loss_fn(model(x), y)      # first: last step's update lands (or is skipped if NaN/Inf)
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
        self._exchange: Exchange | None = None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        reason, single = _fallback_reason(model, optimizer)
        if single is None:
            return self._fall_back(model, [optimizer], group, reason)
        self._bind(model, single, group)
        group.start_state(model, list(zip(self.names, self.params)), tag="nonblocking/init")
        codec, self.topology = reduction_codec(group, self.codec, self.hierarchical)
        # Module, optimizer and codec heal into newcomers (keys under a name unique on the group: two models
        # on one group register apart); the codec rolls back on a discard (a failed exchange may have
        # half-updated it). No first round: the first forward's begin_step is the first heal.
        rounds = Rounds(group, "nonblocking", FailurePolicy.DISCARD)
        rounds.register(model, single, codec)
        self._exchange = Exchange(find_layers(model), single, rounds, codec, model=model)
        group.before_begin_step(self._exchange.end_step)
        return NonBlockingModule(model, self._exchange, group, self.broadcast_buffers)

    def _fall_back(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], group: Group,
                   reason: str) -> nn.Module:
        warnings.warn(f"NonBlocking falls back to blocking gradient all-reduce (shoal.DistributedDataParallel): "
                      f"{reason}", UserWarning, stacklevel=3)
        self.blocking, self._bound, self.group, self.module = True, True, group, model
        self._meter = StepMeter(group.meter, "")
        ddp = DistributedDataParallel(model, process_group=group, codec=self.codec,
                                      hierarchical=self.hierarchical, broadcast_buffers=self.broadcast_buffers)
        _VotedSteps(group, optimizers)
        return ddp

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
             process_group: Any = None) -> tuple[nn.Module, Any]:
        """:func:`shoal.wrap`, also accepting several optimizers (which fall back to blocking).

        Example::

            model, (opt_a, opt_b) = shoal.NonBlocking().wrap(model, [opt_a, opt_b])   # warns: blocking
        """
        if isinstance(optimizer, torch.optim.Optimizer):
            single = optimizer
        else:
            reason, one = _fallback_reason(model, optimizer)
            if one is None:
                return self._fall_back(model, list(optimizer), as_group(process_group), reason), optimizer
            single = one
        if isinstance(single, StrategyOptimizer):
            raise ConfigError("this optimizer is already wrapped by shoal.wrap; pass the original optimizer")
        # What shoal.wrap does with this strategy (not called: shoal.wrap imports the strategies).
        return self.setup(model, single, as_group(process_group)), StrategyOptimizer(single, self)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None) -> Any:
        if self._exchange is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            raise ShoalError("NonBlocking defers the update to the next forward; step(closure) is not supported")
        self._exchange.request_step()
        return None

    def after_step(self) -> None:
        self._mark_step()

    def check_grad_scaler(self) -> None:
        if self._exchange is not None:
            raise ShoalError("NonBlocking cannot run under torch.amp.GradScaler: each layer's gradients are sent "
                             "as backward produces them, still scaled and before the scaler has looked at them, "
                             "and are applied in the next forward; train in bf16 autocast without a scaler, or "
                             "use a blocking strategy (shoal.strategies.Sync) with the scaler")

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


class _VotedSteps:
    """The blocking fall-back's vote: the first ``step()`` of any of ``optimizers`` after a step began
    ends it (:func:`run_round`, the vote alone: always True on a static group); a discarded step's
    gradients are dropped before each optimizer steps, so that none of them changes anything. The
    optimizers' states heal into newcomers (registered on the group)."""

    def __init__(self, group: Group, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.group = group
        self.verdict: bool | None = None   # this step's, once voted
        group.before_begin_step(self._begin)
        key = group.unique_name("nonblocking/optimizers")
        for i, opt in enumerate(optimizers):
            group.register_state(f"{key}/{i}", opt.state_dict, opt.load_state_dict)
            opt.register_step_pre_hook(self._pre_step)

    def _begin(self) -> None:
        self.verdict = None

    def _pre_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self.verdict is None:
            verdict = run_round(self.group)   # its begin_step runs _begin (the step DDP's forward began goes on)
            self.verdict = verdict
        if not self.verdict:   # discarded on every member: this optimizer's step changes nothing
            optimizer.zero_grad(set_to_none=True)
