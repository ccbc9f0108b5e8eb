"""The exact mean: one all-reduce of all tensors in one flat buffer."""

from __future__ import annotations

from typing import Sequence

import torch

from shoal.codecs.base import BufferPool, Codec, check_inputs, common_dtype, flatten_into, sub_tag, unflatten_from
from shoal.comm.group import Group


class Identity(Codec):
    """No compression: the tensors are flattened into one buffer and all-reduced once.

    Bytes handed to the collective per step: ``4 * numel`` for fp32 tensors
    (``2 * numel`` for bf16/fp16; mixed dtypes travel as fp32). The meter tag
    is ``<tag>/identity``.

    Example::

        Identity().mean([w.grad, b.grad], ["w", "b"], group, tag="ddp/grad")
    """

    lossy = False

    def __init__(self) -> None:
        super().__init__()
        self._pool = BufferPool()

    @torch.no_grad()
    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], group: Group, tag: str) -> None:
        check_inputs(tensors, names, "Identity")
        if not tensors:
            return
        numel = sum(t.numel() for t in tensors)
        flat = self._pool.get("flat", numel, common_dtype(tensors), tensors[0].device)
        flatten_into(tensors, flat)
        group.all_reduce(flat, op="avg", tag=sub_tag(tag, "identity")).wait()
        unflatten_from(flat, tensors)
        self._count(tensors, flat.numel() * flat.element_size())
