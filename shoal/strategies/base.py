"""What every strategy is: a schedule of what to synchronise, when, how, over which group.

A :class:`Strategy` is given the model, the optimizer and the group once
(:meth:`Strategy.setup`), returns the module the user trains (shoal's DDP for
gradient strategies, the module itself for local ones) and is then called
around each optimizer step by :class:`StrategyOptimizer`, the optimizer proxy
that :func:`shoal.wrap` returns. The user's loop stays
``loss.backward(); optimizer.step(); optimizer.zero_grad()``.

Writing a strategy (elastic-safe: every collective runs inside a typed
:class:`~shoal.strategies.rounds.Round`, run by
:class:`~shoal.strategies.rounds.Rounds`, which begins the step, votes and
retries; ``tests/dist/test_strategy_template.py`` runs this very code on a
static and on an elastic group)::

    import torch
    from shoal.codecs import Identity
    from shoal.strategies.base import Strategy
    from shoal.strategies.rounds import Round, Rounds

    class EveryStep(Strategy):
        # Average the parameters after every optimizer step.
        name = "every-step"

        def setup(self, model, optimizer, group):
            self._bind(model, optimizer, group)
            self.scratch = [p.detach().clone() for p in self.params]
            self.rounds = Rounds(group, self.name)
            self.params_round = self.rounds.add(Round("params", reduce=self._reduce, apply=self._apply))
            self.rounds.register(model, optimizer)   # what a newcomer heals
            self.rounds.join()   # static: check the model, broadcast rank 0's; elastic: the first heal
            return model

        def after_step(self):
            self.rounds.run(self.params_round)

        def _reduce(self, contributes):   # collectives into scratch only
            torch._foreach_copy_(self.scratch, [p.detach() for p in self.params])
            self.rounds.mean(self.scratch, self.names, Identity(), f"{self.name}/params")

        def _apply(self):                 # after the round committed on every member
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.scratch)
"""

from __future__ import annotations

import abc
import warnings
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.group import Group
from shoal.comm.meter import CommStats, StepMeter
from shoal.comm.start import broadcast_module  # noqa: F401 - re-exported: its home was here
from shoal.errors import ConfigError, ShoalError
from shoal.nonfinite import verdict_for


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                            names: Sequence[str], keys: bool | tuple[str, ...]) -> tuple[list[torch.Tensor], list[str]]:
    """The optimizer's per-parameter state tensors to average (C4), with names ``param:key``.

    ``keys=True`` takes every floating state tensor shaped like its parameter
    (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``); a
    tuple takes only those keys. Scalars such as Adam's ``step`` are never
    averaged (they are equal on every rank).
    """
    tensors: list[torch.Tensor] = []
    out_names: list[str] = []
    for p, name in zip(params, names):
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            t = state[key]
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape):
                continue
            if keys is True or (isinstance(keys, tuple) and key in keys):
                tensors.append(t)
                out_names.append(f"{name}:{key}")
    return tensors, out_names


def check_state_keys(value: bool | tuple[str, ...] | Sequence[str]) -> bool | tuple[str, ...]:
    """Validate an ``average_optimizer_state`` argument (bool or state keys)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"average_optimizer_state must be a bool or a sequence of state keys such as ('exp_avg', 'exp_avg_sq'), got {value!r}"
        )
    return tuple(value)


class Strategy(abc.ABC):
    """A synchronisation schedule; single use: one :meth:`setup` per instance.

    Hooks (all optional but :meth:`setup`): :meth:`before_step` and
    :meth:`after_step` run around every ``optimizer.step()``;
    :meth:`state_dict` / :meth:`load_state_dict` carry step counters, outer
    optimizers and codec state so that a resumed run continues exactly;
    :meth:`close` finishes pending communication.
    """

    name: ClassVar[str] = "strategy"

    def __init__(self) -> None:
        self._bound = False
        self.group: Group | None = None
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[nn.Parameter] = []
        self.names: list[str] = []
        self._meter: StepMeter | None = None

    @abc.abstractmethod
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        """Prepare (collective: every rank calls it); return the module to train."""

    def before_step(self) -> bool | None:
        """Called before the wrapped optimizer's ``step()``; returning False skips that step.

        (An elastic step discarded on every member: the gradients are dropped.)
        """
        return None

    def after_step(self) -> None:
        """Called after the wrapped optimizer's ``step()``."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None) -> Any:
        """Run the wrapped optimizer's step (between :meth:`before_step` and :meth:`after_step`).

        Unless the gradients this rank is about to apply hold a NaN/Inf
        (:meth:`skip_nonfinite_grads`): then the update is skipped, the
        gradients are dropped and the skip is counted, but :meth:`after_step`
        still runs, so the strategy's schedule (and its collectives) stays the
        same on every rank. With a ``closure`` the optimizer computes the
        gradients itself (maybe several times, as L-BFGS does), so nothing is
        checked here. A strategy that applies updates elsewhere (non-blocking:
        in the next forward) overrides this to schedule the step instead.
        """
        if closure is not None:
            return optimizer.step(closure)
        if self.skip_nonfinite_grads():
            return None
        return optimizer.step()

    def skip_nonfinite_grads(self) -> bool:
        """True (and the gradients dropped, the skip counted) if this rank's gradients hold a NaN/Inf.

        One fused check of every ``.grad`` (:func:`~shoal.comm.finite.nonfinite_flag`)
        and one host read, after the step's gradient collectives (SPEC G5).
        Gradients averaged by the strategy (DDP, a warm-up all-reduce, a
        host's DDP) are equal on every rank of their group, so every rank of
        that group reaches the same verdict without a vote; local gradients
        give a local verdict. Parameters whose ``.grad`` is ``None`` (unused,
        or already dropped by :class:`shoal.DistributedDataParallel`'s own
        check) are not looked at, so a step is never counted twice.
        """
        checked = verdict_for(self.params)  # shoal's DDP already checked (and counted) these gradients
        if checked is not None:
            if checked and self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            return checked
        grads = [g._values() if g.is_sparse else g for g in (p.grad for p in self.params) if g is not None]
        if not grads or not read_flag(nonfinite_flag(grads)):
            return False
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._count_nonfinite("gradients", "this rank skipped its optimizer step")
        return True

    def _count_nonfinite(self, what: str, action: str) -> None:
        """Count a skip under ``<name>/nonfinite`` (``comm_stats().total.nonfinite_skips``) and warn."""
        if self.group is not None:
            self.group.meter.add_nonfinite_skip(f"{self.name}/nonfinite")
        warnings.warn(f"{type(self).__name__}: non-finite (NaN/Inf) {what}: {action}; "
                      "counted in comm_stats().total.nonfinite_skips", RuntimeWarning, stacklevel=3)

    def check_grad_scaler(self) -> None:
        """Raise if this strategy cannot honour a ``torch.amp.GradScaler`` (called at its first verdict)."""

    def flush(self) -> None:
        """Apply pending updates; called before the optimizer's state is saved or replaced."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`setup`, into the same configuration)."""

    def close(self) -> None:
        """Finish pending communication (nothing to do for blocking strategies)."""

    def comm_stats(self) -> CommStats:
        """Bytes and waits on the strategy's group: last step and total."""
        if self._meter is None:
            raise ShoalError(f"{type(self).__name__} is not set up yet: call shoal.wrap(model, optimizer, strategy) first")
        return self._meter.stats()

    # --- helpers for subclasses ----------------------------------------
    def _bind(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> None:
        if self._bound:
            raise ShoalError(f"this {type(self).__name__} is already set up; build one strategy per model")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no parameter that requires grad: nothing to synchronise")
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in named if id(p) not in in_opt]
        if missing:
            raise ConfigError(
                f"the optimizer does not hold parameter(s) {missing[:3]} of the model; "
                "build the optimizer over model.parameters() before wrapping"
            )
        self._bound = True
        self.module, self.optimizer, self.group = model, optimizer, group
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._meter = StepMeter(group.meter, "")

    def _mark_step(self) -> None:
        if self._meter is not None:
            self._meter.mark_step()


def unscale_gradients(optimizer: torch.optim.Optimizer, scale: torch.Tensor) -> None:
    """Divide every gradient ``optimizer`` steps by ``scale`` (GradScaler's unscale, without its check).

    The inverse is computed in double then rounded to fp32, as GradScaler does, so a power-of-two
    scale unscales exactly; one fused multiply per device and dtype.
    """
    inv = scale.double().reciprocal().float()
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g.mul_(inv.to(g.device))
            else:
                groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _dtype), grads in groups.items():
        torch._foreach_mul_(grads, inv.to(device, non_blocking=True))


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer :func:`shoal.wrap` returns: ``step()`` runs the strategy around the real step.

    ``param_groups``, ``state``, ``zero_grad`` and hooks are the wrapped
    optimizer's (LR schedulers work unchanged). ``state_dict()`` is the
    wrapped optimizer's plus the strategy's under ``"shoal_strategy"``, so one
    checkpoint of the optimizer resumes the strategy too.

    Example::

        model, opt = shoal.wrap(model, torch.optim.AdamW(model.parameters()), shoal.LocalSGD(period=8))
        opt.step(); opt.zero_grad()
        torch.save(opt.state_dict(), "opt.pt")
    """

    STATE_KEY = "shoal_strategy"

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy) -> None:
        # No super().__init__: the wrapped optimizer owns param_groups and state.
        self.optimizer = optimizer
        self.strategy = strategy
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        # Anything not defined here (step hooks, private torch attributes) is the wrapped optimizer's.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    # torch.amp.GradScaler calls step() even when it found an Inf, handing over ``grad_scale`` and
    # ``found_inf``: a local overflow must skip only the update, never the strategy's schedule, or the
    # ranks' step counters drift apart (an averaging round would pair different steps, DiLoCo would crash).
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        overflow = self._grad_scaler_verdict()
        if self.strategy.before_step() is False:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        if overflow:  # this rank's scaled gradients overflowed: GradScaler skips the update, the schedule goes on
            self.optimizer.zero_grad(set_to_none=True)
            loss = None
        else:
            loss = self.strategy.optimizer_step(self.optimizer, closure)
        self.strategy.after_step()
        return loss

    def _grad_scaler_verdict(self) -> bool:
        """Whether a ``torch.amp.GradScaler`` stepping this optimizer found an Inf/NaN (``False`` without one).

        GradScaler sets ``found_inf`` (and ``grad_scale`` unless ``unscale_`` already ran) on this
        object for the duration of ``step()``. Finite gradients are unscaled here, as GradScaler
        would have done, before the strategy sees them. One host read of ``found_inf``, as
        GradScaler's own step does.
        """
        found_inf = self.__dict__.get("found_inf")
        if found_inf is None:
            return False
        self.strategy.check_grad_scaler()
        if bool(found_inf.item() != 0):
            return True
        scale = self.__dict__.get("grad_scale")
        if scale is not None:
            unscale_gradients(self.optimizer, scale)
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ShoalError("add parameter groups to the optimizer before shoal.wrap: the strategy has already laid out its parameters")

    def state_dict(self) -> dict[str, Any]:
        self.strategy.flush()
        return {**self.optimizer.state_dict(), self.STATE_KEY: self.strategy.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.strategy.flush()
        inner = dict(state_dict)
        strategy_state = inner.pop(self.STATE_KEY, None)
        self.optimizer.load_state_dict(inner)
        if strategy_state is not None:
            self.strategy.load_state_dict(strategy_state)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({type(self.strategy).__name__}, {self.optimizer!r})"
