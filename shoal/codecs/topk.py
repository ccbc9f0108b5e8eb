"""Top-k sparsification: all-gather of indices and values."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from shoal.codecs.base import BufferPool, LossyCodec, check_inputs, common_dtype, flatten_into, sub_tag, unflatten_from
from shoal.comm.group import Group
from shoal.errors import ConfigError


class TopK(LossyCodec):
    """Send only the ``k = max(1, ceil(ratio * numel))`` largest-magnitude elements.

    The selection is over all tensors of one call together (one ``topk``, one
    collective), so a layer with larger gradients gets more of the budget.
    Each rank sends int32 indices (int64 beyond 2**31 elements) and values in
    the tensors' dtype, packed in one uint8 buffer; every rank scatters-adds
    all contributions in rank order and divides by the group size. Use it
    wrapped in :class:`~shoal.codecs.ErrorFeedback`: without it, what is never
    in the top k is never sent.

    Bytes handed to the collective: ``k * (4 + value bytes)`` (8k for fp32), rounded up to 4.
    Meter tag ``<tag>/topk``.

    Example::

        codec = ErrorFeedback(TopK(ratio=0.01))
        codec.mean(grads, names, group, tag="ddp/grad")
    """

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise ConfigError(f"ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._pool = BufferPool()

    def k_for(self, numel: int) -> int:
        """How many elements a call with ``numel`` elements sends."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    @torch.no_grad()
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        check_inputs(tensors, names, "TopK")
        if not tensors:
            return
        device, vdtype = tensors[0].device, common_dtype(tensors)
        numel = sum(t.numel() for t in tensors)
        k = self.k_for(numel)
        idtype = torch.int32 if numel < 2**31 else torch.int64
        flat = self._pool.get("flat", numel, torch.float32, device)
        flatten_into(tensors, flat)
        _, idx = torch.topk(flat.abs(), k, sorted=False)
        isz, vsz = idtype.itemsize, vdtype.itemsize
        # Rows padded to the index size keep every rank's indices aligned when gathered.
        nbytes = -(-k * (isz + vsz) // isz) * isz
        mine = self._pool.get("wire", nbytes, torch.uint8, device)
        mine[: k * isz].view(idtype).copy_(idx)
        mine[k * isz : k * (isz + vsz)].view(vdtype).copy_(flat[idx])
        if residuals is not None:
            # What was not sent, plus the rounding of what was (values in a half dtype).
            res = flat.clone()
            res.index_put_((idx,), flat[idx] - mine[k * isz : k * (isz + vsz)].view(vdtype).to(torch.float32))
            unflatten_from(res, residuals)
        gathered = self._pool.get("gathered", mine.numel() * group.size, torch.uint8, device)
        group.all_gather_into(gathered, mine, tag=sub_tag(tag, "topk")).wait()
        flat.zero_()
        for row in gathered.view(group.size, -1):
            # One rank's indices are distinct, so each index_add_ is deterministic
            # even on CUDA; ranks are added in rank order, so all ranks agree.
            flat.index_add_(0, row[: k * isz].view(idtype).long(), row[k * isz : k * (isz + vsz)].view(vdtype).to(torch.float32))
        flat.div_(group.size)
        unflatten_from(flat, tensors)
        self._count(tensors, mine.numel())

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": self.ratio}
