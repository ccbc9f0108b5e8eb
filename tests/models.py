"""Small models and a training loop shared by the distributed tests."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    """An MLP with optional BatchNorm and a branch some ranks skip."""

    def __init__(self, bn: bool = False, extra: bool = False, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.bn = nn.BatchNorm1d(width) if bn else None
        self.fc2 = nn.Linear(width, width)
        self.extra = nn.Linear(width, width) if extra else None
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        h = F.relu(self.fc2(h))
        if use_extra and self.extra is not None:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(kind)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = 30, micro: int = 1,
          use_extra: Callable[[int, int], bool] = lambda rank, step: False,
          dtype: torch.dtype = torch.float32, seed: int = 1000) -> None:
    """Different data on each rank (seeded by rank), same on every call."""
    g = torch.Generator().manual_seed(seed + rank)
    for step in range(steps):
        for m in range(micro):
            x = torch.randn(8, 16, generator=g).to(dtype)
            y = torch.randn(8, 4, generator=g).to(dtype)
            ctx = model.no_sync() if m < micro - 1 else nullcontext()
            with ctx:
                loss = F.mse_loss(model(x, use_extra=use_extra(rank, step)), y)
                loss.backward()
        opt.step()
        opt.zero_grad()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference over parameters and float buffers."""
    pa = dict(a.named_parameters()) | {k: v for k, v in a.named_buffers() if v.is_floating_point()}
    pb = dict(b.named_parameters()) | {k: v for k, v in b.named_buffers() if v.is_floating_point()}
    assert pa.keys() == pb.keys()
    return max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
