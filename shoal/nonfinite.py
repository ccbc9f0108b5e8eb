"""DDP's verdict on a step's averaged gradients, honoured at the optimizer step.

shoal's DistributedDataParallel checks the averaged gradients once per
synchronised backward (one fused check after the last collective, the same
verdict on every rank). On a non-finite verdict the step must be skipped on
every rank, but the drop-in DDP does not own the user's optimizer, and
``torch.amp.GradScaler`` must still *see* the Inf to skip the step itself and
lower its scale (it refuses an optimizer none of whose parameters has a
gradient). So the gradients stay written, identical on every rank, and a
global optimizer step pre-hook drops them (``.grad = None``, so torch
optimizers step nothing, Adam's step counts included) just before any
optimizer holding those parameters steps. A GradScaler that found the Inf
never calls ``step``, and the verdict expires at the next backward.

Other steppers (a strategy's optimizer proxy, ZeroRedundancyOptimizer) ask
:func:`verdict_for` first, so a step DDP already checked is neither checked
nor counted twice.

Example::

    v = StepVerdict(list(model.parameters()))
    v.set(nonfinite=True)       # what the reducer does after a bad backward
    opt.step()                  # the pre-hook drops every .grad first: nothing moves
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_live: "weakref.WeakSet[StepVerdict]" = weakref.WeakSet()
_lock = threading.Lock()
_hook_handle: Any = None


class StepVerdict:
    """The last synchronised backward's verdict for one set of parameters.

    ``value`` is ``None`` when no backward was checked since the parameters'
    last optimizer step, ``False`` for finite gradients, ``True`` when every
    rank must skip the step.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._ids = frozenset(id(p) for p in self.params)
        self.value: bool | None = None
        self._covers: "weakref.WeakKeyDictionary[Any, tuple[int, bool]]" = weakref.WeakKeyDictionary()
        _install_hook()
        with _lock:
            _live.add(self)

    def set(self, nonfinite: bool) -> None:
        self.value = nonfinite

    def expire(self) -> None:
        self.value = None

    def drop_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients of these parameters that ``optimizer`` steps (only those: a
        second optimizer, maybe behind its own GradScaler, must still see its own)."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for p in self.params:
            if id(p) in held:
                p.grad = None

    def touches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these parameters (cached per optimizer and
        number of parameters it holds, so ``add_param_group`` is seen)."""
        size = sum(len(g["params"]) for g in optimizer.param_groups)
        known = self._covers.get(optimizer)
        if known is None or known[0] != size:
            known = (size, any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"]))
            self._covers[optimizer] = known
        return known[1]

    def covers(self, params: Sequence[torch.Tensor]) -> bool:
        return all(id(p) in self._ids for p in params)


def verdict_for(params: Sequence[torch.Tensor]) -> bool | None:
    """DDP's fresh verdict on ``params``' gradients, or ``None`` if no DDP checked them.

    ``True``: the step is to be skipped on every rank (already counted and
    warned by DDP); ``False``: the gradients are finite, no need to check again.
    """
    with _lock:
        live = list(_live)
    for v in live:
        if v.value is not None and v.covers(params):
            return v.value
    return None


def _before_optimizer_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """A non-finite verdict drops the stepping optimizer's gradients of those parameters and
    stays until the next backward (another optimizer over the same model drops its own);
    a finite one expires. An optimizer that reads the verdict itself
    (``_reads_nonfinite_verdict``, ZeroRedundancyOptimizer) is left alone."""
    if getattr(optimizer, "_reads_nonfinite_verdict", False):
        return
    with _lock:
        live = [v for v in _live if v.value is not None]
    for v in live:
        if v.touches(optimizer):
            if v.value:
                v.drop_grads(optimizer)
            else:
                v.expire()


def _install_hook() -> None:
    global _hook_handle
    with _lock:
        if _hook_handle is None:
            _hook_handle = register_optimizer_step_pre_hook(_before_optimizer_step)
