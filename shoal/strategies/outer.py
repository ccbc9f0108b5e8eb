"""Outer optimizers for DiLoCo and streaming DiLoCo (the step on the averaged pseudo-gradient)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.errors import ConfigError


@dataclass(frozen=True)
class OuterSGD:
    """An outer-optimizer factory: SGD with (Nesterov) momentum on the pseudo-gradient.

    ``lr=1, momentum=0`` makes the outer step plain averaging of the replicas
    (local SGD); the DiLoCo paper's ``lr=0.7, momentum=0.9, nesterov=True``
    moves the global copy up to ``lr / (1 - momentum) = 7`` times the averaged
    pseudo-gradient once the momentum has built up, which suits long rounds
    (H of 500) of a large model but overshoots on short rounds of a small one
    (docs/averaging.md, "Tuning the outer step").

    Attributes:
        lr: outer learning rate (> 0).
        momentum: in ``[0, 1)``.
        nesterov: Nesterov momentum (needs ``momentum > 0``).

    Example::

        shoal.DiLoCo(inner_steps=20, outer_optimizer=shoal.OuterSGD(lr=1.0, momentum=0.0, nesterov=False))
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not self.lr > 0:
            raise ConfigError(f"outer lr must be a positive number, got {self.lr!r}")
        if not isinstance(self.momentum, (int, float)) or not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum!r}")
        if self.nesterov and self.momentum == 0.0:
            raise ConfigError("Nesterov momentum needs momentum > 0: pass nesterov=False for plain SGD")

    def __call__(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=float(self.lr), momentum=float(self.momentum), nesterov=self.nesterov)
