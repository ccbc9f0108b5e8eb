"""The benchmark's text corpus, its fixed train/validation split, and batches.

The corpus is the English text of Python's own help topics
(``pydoc_data.topics``, ~460 KB, shipped with every CPython), as UTF-8 bytes.
It is cut into blocks of ``BLOCK`` bytes; a fixed 10% of the blocks, chosen by
a seed that does not depend on the training seed, is the validation set. A
training window never leaves its block, so no training byte is ever a
validation byte.

Batches are a pure function of ``(seed, step)``: step ``t``'s *global* batch is
the same for every strategy and every world size, and rank ``r`` of ``W`` takes
the ``r``-th of ``W`` equal slices. So DDP on 4 workers, ``local`` on one
worker and ``nosync`` see the same samples in the same order.

Example:
    >>> c = ByteCorpus.load(window=65)
    >>> b = c.train_batch(step=0, seed=1, global_batch=8, rank=0, world=2)
    >>> tuple(b.shape), b.dtype
    ((4, 65), torch.int64)
    >>> bool((c.train_batch(0, 1, 8, 0, 2) == b).all())
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from shoal.errors import ConfigError

BLOCK = 2048  # bytes: a few paragraphs, so the split holds out whole passages
VAL_FRACTION = 0.1
SPLIT_SEED = 20261121  # fixed forever: changing it changes every published validation loss


def corpus_bytes() -> bytes:
    """Python's help topics, sorted by topic name, as one UTF-8 byte string."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def split_blocks(n_blocks: int, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED) -> tuple[list[int], list[int]]:
    """Indices of ``(train, validation)`` blocks: disjoint, sorted, together all blocks.

    >>> split_blocks(10, 0.2)[1] == split_blocks(10, 0.2)[1]
    True
    """
    if n_blocks < 2:
        raise ConfigError(f"need at least 2 blocks to split, got {n_blocks}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = min(n_blocks - 1, max(1, round(n_blocks * val_fraction)))
    val = sorted(random.Random(seed).sample(range(n_blocks), n_val))
    val_set = set(val)
    return [i for i in range(n_blocks) if i not in val_set], val


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed for ``(seed, step)``; distinct pairs give distinct streams."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


@dataclass(frozen=True)
class ByteCorpus:
    """Blocks of the corpus as a ``(n_blocks, BLOCK)`` uint8 tensor, split in two.

    ``window`` is the number of bytes per sample (context + 1 for next-byte
    prediction). The final partial block is dropped so every block is whole.
    """

    blocks: torch.Tensor
    train_ids: tuple[int, ...]
    val_ids: tuple[int, ...]
    window: int

    def __post_init__(self) -> None:
        if not 2 <= self.window <= self.blocks.shape[1]:
            raise ConfigError(f"window must be in [2, {self.blocks.shape[1]}] bytes, got {self.window}")

    @classmethod
    def load(cls, window: int) -> "ByteCorpus":
        data = corpus_bytes()
        n = len(data) // BLOCK
        blocks = torch.frombuffer(bytearray(data[: n * BLOCK]), dtype=torch.uint8).view(n, BLOCK)
        train, val = split_blocks(n)
        return cls(blocks, tuple(train), tuple(val), window)

    def train_batch(self, step: int, seed: int, global_batch: int, rank: int, world: int) -> torch.Tensor:
        """Rank ``rank``'s slice of step ``step``'s global batch, as int64 byte ids."""
        if global_batch % world:
            raise ConfigError(f"global batch {global_batch} is not divisible by the {world} workers")
        gen = torch.Generator().manual_seed(_mix(seed, step))
        which = torch.randint(len(self.train_ids), (global_batch,), generator=gen)
        offset = torch.randint(self.blocks.shape[1] - self.window + 1, (global_batch,), generator=gen)
        per = global_batch // world
        sl = slice(rank * per, (rank + 1) * per)
        block = torch.tensor(self.train_ids)[which[sl]]
        cols = offset[sl, None] + torch.arange(self.window)
        return self.blocks[block[:, None], cols].long()

    def samples(self, seed: int, positions: Sequence[int]) -> torch.Tensor:
        """The training windows at ``positions`` of the sample stream ``seed``, as int64 byte ids.

        Window ``p`` of a stream is a pure function of ``(seed, p)``: runs that cut one stream into steps
        differently (a global batch that 4 workers share, then 3 survivors of a kill) read the same
        windows in the same order (:class:`shoal.elastic.ElasticSampler` hands out the positions).

        >>> c = ByteCorpus.load(window=65)
        >>> bool((c.samples(3, [5, 6])[1] == c.samples(3, [6])[0]).all())
        True
        """
        if not positions:
            raise ConfigError("samples() needs at least one stream position")
        rows = []
        for p in positions:
            if p < 0:
                raise ConfigError(f"stream positions are >= 0, got {p}")
            g = torch.Generator().manual_seed(_mix(seed, p))
            block = self.train_ids[int(torch.randint(len(self.train_ids), (1,), generator=g))]
            off = int(torch.randint(self.blocks.shape[1] - self.window + 1, (1,), generator=g))
            rows.append(self.blocks[block, off:off + self.window])
        return torch.stack(rows).long()

    def val_windows(self, limit: int | None = None) -> torch.Tensor:
        """Non-overlapping validation windows, in corpus order; ``limit`` takes an evenly spaced subset.

        The result is fixed for a given ``window`` and ``limit``.
        """
        per_block = self.blocks.shape[1] // self.window
        wins = self.blocks[list(self.val_ids), : per_block * self.window].reshape(-1, self.window)
        if limit is not None and limit < len(wins):
            if limit < 1:
                raise ConfigError(f"validation window limit must be >= 1, got {limit}")
            idx = torch.linspace(0, len(wins) - 1, limit).round().long()
            wins = wins[idx]
        return wins.long()

    def source_offsets(self, split: str) -> set[int]:
        """Byte offsets in the corpus that ``split`` (``"train"``/``"val"``) may read; for tests."""
        ids = self.train_ids if split == "train" else self.val_ids
        return {b * self.blocks.shape[1] + i for b in ids for i in range(self.blocks.shape[1])}
