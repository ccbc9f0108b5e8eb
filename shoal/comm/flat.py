"""Flat buffers: one contiguous tensor seen as many shaped tensors.

Hot paths (gradient buckets, codecs, pseudo-gradients) keep one flat buffer
per kind of data so that a collective moves it in one call; these are the
views through which the rest of the code sees it.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch

Shape = Union[torch.Size, Sequence[int]]


def flat_views(flat: torch.Tensor, like: Sequence[Union[torch.Tensor, Shape]]) -> list[torch.Tensor]:
    """Consecutive views of 1-D ``flat`` shaped like ``like`` (tensors or shapes), in order.

    >>> flat = torch.arange(6.0)
    >>> [v.tolist() for v in flat_views(flat, [torch.zeros(2), (2, 2)])]
    [[0.0, 1.0], [[2.0, 3.0], [4.0, 5.0]]]
    """
    out, offset = [], 0
    for item in like:
        shape = item.shape if isinstance(item, torch.Tensor) else torch.Size(item)
        n = math.prod(shape)
        out.append(flat.narrow(0, offset, n).view(shape))
        offset += n
    return out
