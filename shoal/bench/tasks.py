"""Benchmark tasks: a model, its data and its loss, built from one config.

A task is what a strategy trains. Every task here runs offline on data that
ships with Python (``lm``) so a benchmark never needs a download.

Example:
    >>> from shoal.bench.tasks import LMConfig, build_task
    >>> task = build_task("lm", LMConfig(d_model=32, n_layers=1, n_heads=2, context=16))
    >>> task.name, task.num_parameters() > 0
    ('lm', True)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shoal.bench.data import ByteCorpus
from shoal.errors import ConfigError


@dataclass(frozen=True)
class LMConfig:
    """Size of the byte-level GPT of the ``lm`` task.

    Defaults were picked by measuring on this project's 2-core CPU machine with
    ``torch.set_num_threads(1)``: 4 layers of width 256 give 3.2 M parameters
    (12.8 MB of fp32 gradients per step), and a per-worker batch of 8 windows of
    128 bytes costs ~0.25 s of forward+backward on one core. At 4 hosts x
    20 mbit a ring all-reduce of those gradients moves ~19 MB per worker per
    step (~8 s), so plain DDP spends most of each step communicating, which is
    the regime shoal exists for (see issue #3). Wider or deeper models make the
    15-minute ``make bench`` reach too few steps to show a loss curve.
    """

    d_model: int = 256  # 4 layers x 12 d^2 = 3.1 M weights: inside the 3-6 M the issue asks
    n_layers: int = 4
    n_heads: int = 4  # head size 64, the usual sweet spot for SDPA kernels
    context: int = 128  # bytes per window: long enough to span words and short phrases
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "context", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"LMConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"LMConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "because every head gets an equal slice of the width"
            )


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.fc_in = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc_in(self.norm2(x))))


class ByteGPT(nn.Module):
    """A small GPT over bytes (vocabulary 256), output head tied to the embedding.

    ``vocab`` and ``tied=False`` (an untied linear head) serve
    :class:`shoal.bench.gpt.GPT`, the same model at benchmark sizes.

    Example:
        >>> m = ByteGPT(LMConfig(d_model=32, n_layers=1, n_heads=2, context=16))
        >>> m(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, cfg: LMConfig, vocab: int = 256, tied: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self._residual_outs = [lin for b in self.blocks if isinstance(b, _Block) for lin in (b.proj, b.fc_out)]
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = None if tied else nn.Linear(cfg.d_model, vocab, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)
        nn.init.normal_(self.pos, std=0.01)
        # Residual outputs scaled down with depth so the stream's variance stays ~constant.
        for out in self._residual_outs:
            nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"input of {t} tokens is longer than the model's context ({self.cfg.context})")
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x @ self.tok.weight.t() if self.head is None else self.head(x)


class LMTask:
    """Next-byte prediction on Python's own documentation text.

    ``loss(model, batch)`` takes a ``(B, context + 1)`` tensor of byte ids and
    returns the mean cross-entropy (nats per byte) of predicting bytes 1..T
    from 0..T-1.
    """

    name = "lm"

    def __init__(self, cfg: LMConfig) -> None:
        self.cfg = cfg
        self.corpus = ByteCorpus.load(window=cfg.context + 1)

    def build_model(self) -> nn.Module:
        return ByteGPT(self.cfg)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.build_model().parameters())

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.cfg)


TASKS = ("lm",)


def build_task(name: str, cfg: LMConfig | None = None) -> LMTask:
    """The task called ``name`` (only ``"lm"`` for now) with its model config."""
    if name == "lm":
        return LMTask(cfg or LMConfig())
    raise ConfigError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
