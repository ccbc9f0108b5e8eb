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
    if kind == "adamw-fused":   # skips on the device, given found_inf (shoal.nonfinite)
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "sgd-fused":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
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


class _TinyBlock(nn.Module):
    """Pre-norm causal self-attention plus a one-layer MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias gets a zero gradient: Adam would amplify its noise
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm(x)).split(d, dim=-1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + torch.tanh(self.mlp(x))


class TiedGPT(nn.Module):
    """A tiny GPT whose output head shares the token embedding matrix, with every kind of shared weight.

    - ``head`` is registered before ``tok``: it owns the shared matrix although
      the embedding uses it first in the forward (the usual LM tying, made
      order-sensitive);
    - ``inp.weight`` is ``out.weight``: ``inp`` runs first and saves it for
      backward, ``out`` (which registered it) runs later;
    - ``block`` runs twice per forward: one module, its parameters used twice.
    """

    def __init__(self, vocab: int = 16, d: int = 8, heads: int = 2, context: int = 6) -> None:
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)
        self.tok = nn.Embedding(vocab, d)
        self.tok.weight = self.head.weight
        self.pos = nn.Parameter(torch.randn(context, d) * 0.1)
        self.out = nn.Linear(d, d)
        self.inp = nn.Linear(d, d)
        self.inp.weight = self.out.weight
        self.block = _TinyBlock(d, heads)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = torch.tanh(self.inp(x))
        x = self.block(self.block(x))
        return self.head(self.out(x))
