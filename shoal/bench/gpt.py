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

from dataclasses import dataclass

import torch  # noqa: F401 - the doctest uses it

from shoal.bench.tasks import ByteGPT, LMConfig
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


class GPT(ByteGPT):
    """Decoder-only transformer: ``(batch, t)`` token ids to ``(batch, t, vocab)`` logits, ``t <= context``.

    :class:`~shoal.bench.tasks.ByteGPT` with ``size.vocab`` tokens and an untied head.
    """

    def __init__(self, size: GPTSize) -> None:
        cfg = LMConfig(d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads, context=size.context)
        super().__init__(cfg, vocab=size.vocab, tied=False)
        self.size = size
