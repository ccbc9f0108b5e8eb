"""Sorted positions in few bits: Elias-Fano coding, batched over rows, on any device.

A sparse codec sends which elements it kept. ``k`` distinct positions out of
``u`` need about ``log2(u / k) + 1.44`` bits each, not the 16 or 32 of an
integer: Elias-Fano gets within ~0.5 bit of that with a size that depends only
on ``(u, k)``, so every row (and every rank's payload) has the same length and
the coding is a handful of tensor operations: no host sync, no Python loop over
elements.

Each row's positions, in increasing order, split into ``l = floor(log2(u / k))``
low bits, stored as they are (``k * l`` bits), and a high part ``p >> l``,
stored in unary: bit ``(p_i >> l) + i`` of a vector of ``k + ((u - 1) >> l) + 1``
bits is set for the ``i``-th position. The two bit strings are packed, low
bits first, least significant bit first, into ``ceil((k l + that length) / 8)``
bytes.

>>> import torch
>>> pos = torch.tensor([[3, 40, 41, 99], [0, 1, 2, 3]])
>>> buf = torch.empty(2, layout(100, 4)[2], dtype=torch.uint8)
>>> encode(pos, 100, buf)
>>> decode(buf, 100, 4).tolist()
[[3, 40, 41, 99], [0, 1, 2, 3]]
>>> layout(4096, 41)      # 41 of 4096: 351 bits, 44 bytes (82 as int16)
(6, 105, 44)
"""

from __future__ import annotations

import torch

from shoal.errors import ConfigError


def layout(universe: int, k: int) -> tuple[int, int, int]:
    """``(low bits per position, length of the unary high part in bits, bytes per row)`` for ``k`` of ``universe``."""
    if not 1 <= k <= universe:
        raise ConfigError(f"Elias-Fano coding needs 1 <= k <= universe, got k={k}, universe={universe}")
    low = (universe // k).bit_length() - 1   # floor(log2(universe / k))
    high = k + ((universe - 1) >> low) + 1
    return low, high, -(-(k * low + high) // 8)


def encode(positions: torch.Tensor, universe: int, out: torch.Tensor) -> None:
    """Write each row of ``positions`` (``[n, k]`` integers, increasing along a row, in ``[0, universe)``)
    into ``out`` (``[n, bytes per row]`` uint8)."""
    n, k = positions.shape
    low, high, nbytes = layout(universe, k)
    if tuple(out.shape) != (n, nbytes) or out.dtype != torch.uint8:
        raise ValueError(f"out must be uint8 of shape {(n, nbytes)}, got {out.dtype} {tuple(out.shape)}")
    device = positions.device
    pos = positions.to(torch.int64)
    bits = torch.zeros(n, nbytes * 8, dtype=torch.uint8, device=device)
    if low:
        wide = _low_dtype(low)   # the [n, k, l] bit expansion in 4 bytes an entry where the low bits fit
        shifts = torch.arange(low, dtype=wide, device=device)
        lows = (pos & ((1 << low) - 1)).to(wide).unsqueeze(2)
        bits[:, : k * low] = (lows >> shifts & 1).view(n, k * low).to(torch.uint8)
    ones = torch.ones(n, k, dtype=torch.uint8, device=device)
    bits[:, k * low: k * low + high].scatter_(1, (pos >> low) + torch.arange(k, device=device), ones)
    weights = 1 << torch.arange(8, dtype=torch.uint8, device=device)
    out.copy_((bits.view(n, nbytes, 8) * weights).sum(dim=2, dtype=torch.uint8))   # disjoint bits: no carries


def decode(buf: torch.Tensor, universe: int, k: int) -> torch.Tensor:
    """The ``[n, k]`` int64 positions that :func:`encode` wrote into ``buf`` (``[n, bytes per row]`` uint8).

    Trusts the bytes: each row's unary part must hold exactly ``k`` set bits,
    as :func:`encode` writes them.
    """
    n = buf.shape[0]
    low, high, nbytes = layout(universe, k)
    device = buf.device
    bits = (buf.view(n, nbytes, 1) >> torch.arange(8, dtype=torch.uint8, device=device) & 1).view(n, nbytes * 8)
    # The i-th set bit of the unary part (a running count of i + 1 there) goes to slot i; clear bits to slot k.
    unary = bits[:, k * low: k * low + high]
    slot = torch.where(unary.bool(), unary.cumsum(dim=1) - 1, k)
    cols = torch.empty(n, k + 1, dtype=torch.int64, device=device)
    cols.scatter_(1, slot, torch.arange(high, device=device).expand(n, high))
    pos = (cols[:, :k] - torch.arange(k, device=device)) << low
    if low:
        wide = _low_dtype(low)
        weights = 1 << torch.arange(low, dtype=wide, device=device)
        pos |= (bits[:, : k * low].view(n, k, low).to(wide) * weights).sum(dim=2)
    return pos


def _low_dtype(low: int) -> torch.dtype:
    """int32 while ``low`` bits fit in it (the usual case), int64 beyond (a universe of 2**31 k and more)."""
    return torch.int32 if low <= 30 else torch.int64
