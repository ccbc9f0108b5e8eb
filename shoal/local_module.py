"""The DDP-shaped module that :func:`shoal.wrap` returns for strategies that train locally.

A training script written for torch's DDP reaches the user's model through
``model.module`` (``raw_model = model.module``, ``model.module.state_dict()``),
accumulates gradients under ``model.no_sync()`` or by setting
``model.require_backward_grad_sync``, and saves ``model.state_dict()`` whose
keys start with ``module.``. Local strategies (local SGD, DiLoCo, ...) average
parameters at the optimizer step, not gradients in backward, so the module
they train is the user's own; this thin wrapper gives it DDP's surface so such
scripts run unchanged.

Example::

    model, opt = shoal.wrap(net, torch.optim.AdamW(net.parameters()), shoal.DiLoCo(inner_steps=100))
    raw = model.module                      # the user's net, as with torch's DDP
    with model.no_sync():                   # accepted: gradients are local anyway
        model(x).sum().backward()
    torch.save(model.module.state_dict(), "ckpt.pt")
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn


class LocalDataParallel(nn.Module):
    """``module`` with torch DDP's attributes; forward is the module's own.

    ``no_sync()`` and ``require_backward_grad_sync`` are accepted and kept
    (gradients are never averaged in backward under a local strategy, so
    they change nothing). Attributes not found on the wrapper are looked up
    on ``module`` (torch's DDP does not do this; it keeps code that used the
    bare model returned by earlier shoal versions working).
    """

    def __init__(self, module: nn.Module, strategy_name: str) -> None:
        super().__init__()
        self.module = module
        self.strategy_name = strategy_name
        self.require_backward_grad_sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as with DDP (a no-op here: the strategy never syncs in backward)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self._modules["module"], name)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy_name}"
