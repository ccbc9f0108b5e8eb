"""A decoder-only GPT with an untied output head, sized for step-time benchmarks.

The model of ``python -m shoal.bench.overhead --tasks gpt``: token and
position embeddings, pre-norm blocks of causal self-attention and an MLP (the
blocks of :class:`shoal.bench.tasks.ByteGPT`), a final LayerNorm and an
untied linear head. Sizes come from :data:`GPT_SIZES`; the default, ``34m``,
is the model of the H100 measurement that filed issue #13.

Example:
    >>> from shoal.bench.gpt import GPT, GPT_SIZES
    >>> m = GPT(GPT_SIZES["tiny"])
    >>> m(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
    >>> sum(p.numel() for p in m.parameters()) == GPT_SIZES["tiny"].num_parameters()
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shoal.bench.tasks import LMConfig, _Block
from shoal.errors import ConfigError


@dataclass(frozen=True)
class GPTSize:
    """Shape of a :class:`GPT`: width, depth, heads, vocabulary and longest context."""

    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    context: int

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "vocab", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTSize.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"GPTSize.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}): "
                              "every head gets an equal slice of the width")

    def num_parameters(self) -> int:
        """Parameter count, from the shapes alone (no model is built)."""
        d = self.d_model
        block = 12 * d * d + 13 * d  # qkv, proj, 2-layer MLP (4d), with biases; two LayerNorms
        return self.n_layers * block + 2 * self.vocab * d + self.context * d + 2 * d


GPT_SIZES: dict[str, GPTSize] = {
    "tiny": GPTSize(d_model=64, n_layers=2, n_heads=2, vocab=256, context=32),  # 134,912: tests on a CPU
    "34m": GPTSize(d_model=512, n_layers=8, n_heads=8, vocab=8192, context=256),  # 33,739,776
    "118m": GPTSize(d_model=768, n_layers=12, n_heads=12, vocab=21504, context=256),  # 118,282,752
}


class GPT(nn.Module):
    """Decoder-only transformer: ``(batch, t)`` token ids to ``(batch, t, vocab)`` logits, ``t <= context``."""

    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.size = size
        cfg = LMConfig(d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads, context=size.context)
        self.tok = nn.Embedding(size.vocab, size.d_model)
        self.pos = nn.Parameter(torch.zeros(size.context, size.d_model))
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(size.n_layers))
        self.norm = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)
        nn.init.normal_(self.pos, std=0.01)
        for b in self.blocks:  # residual outputs scaled down with depth
            if isinstance(b, _Block):
                for out in (b.proj, b.fc_out):
                    nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * size.n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.size.context:
            raise ValueError(f"input of {t} tokens is longer than the model's context ({self.size.context})")
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
