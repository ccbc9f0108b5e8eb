"""Top-k sparsification: all-gather of indices and values."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from shoal.codecs import positions
from shoal.codecs.base import BufferPool, LossyCodec, check_inputs, common_dtype, flatten_into, sub_tag, unflatten_from
from shoal.codecs.largest import topk_indices
from shoal.comm.group import Group
from shoal.errors import ConfigError


class TopK(LossyCodec):
    """Send only the ``k = max(1, ceil(ratio * numel))`` largest-magnitude elements.

    The selection is over all tensors of one call together (one ``topk``, one
    collective), so a layer with larger gradients gets more of the budget.
    Each rank sends the values in the tensors' dtype, then their positions
    in increasing order, Elias-Fano coded (:mod:`shoal.codecs.positions`:
    ``l = floor(log2(numel / k))`` low bits each plus a unary high part, about
    ``log2(numel / k) + 2`` bits a position instead of 32), packed in one
    uint8 buffer; every rank scatters-adds all contributions in rank order and
    divides by the group size. Use it wrapped in
    :class:`~shoal.codecs.ErrorFeedback`: without it, what is never in the top
    k is never sent.

    Bytes handed to the collective (:meth:`wire_bytes`): ``k * value bytes +
    ceil((k l + k + ((numel - 1) >> l) + 1) / 8)``, rounded up to 4 (8 for
    fp64 values, which every rank's row must start aligned for): at 1 %
    of fp32, ~5.1 bytes a kept element instead of 8. Meter tag ``<tag>/topk``.

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

    def wire_bytes(self, numel: int, value_bytes: int = 4) -> int:
        """Bytes one rank hands to the all-gather for ``numel`` elements of ``value_bytes`` each.

        >>> TopK(0.01).wire_bytes(1_000_000)   # 40,000 bytes of values + 10,704 of positions (int32: 80,000 in all)
        50704
        """
        k = self.k_for(numel)
        align = max(4, value_bytes)   # every rank's row starts aligned for its values (fp64: 8)
        return -(-(k * value_bytes + positions.layout(numel, k)[2]) // align) * align

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
        flat = self._pool.get("flat", numel, torch.float32, device)
        flatten_into(tensors, flat)
        # The k largest magnitudes (NaN/Inf rank first), in increasing position (Elias-Fano); the values follow.
        idx = torch.sort(topk_indices(flat.abs().view(1, numel), k).view(k)).values
        vsz, pb = vdtype.itemsize, positions.layout(numel, k)[2]
        # Values first: every rank's row starts at a multiple of max(4, value bytes), so its values stay aligned.
        mine = self._pool.get("wire", self.wire_bytes(numel, vsz), torch.uint8, device)
        values = mine[: k * vsz].view(vdtype)
        values.copy_(flat[idx])
        positions.encode(idx.view(1, k), numel, mine[k * vsz: k * vsz + pb].view(1, pb))
        mine[k * vsz + pb:].zero_()
        if residuals is not None:
            # What was not sent, plus the rounding of what was (values in a half dtype).
            res = flat.clone()
            res.index_put_((idx,), flat[idx] - values.to(torch.float32))
            unflatten_from(res, residuals)
        gathered = self._pool.get("gathered", mine.numel() * group.size, torch.uint8, device)
        group.all_gather_into(gathered, mine, tag=sub_tag(tag, "topk")).wait()
        flat.zero_()
        for row in gathered.view(group.size, -1):
            # One rank's indices are distinct, so each index_add_ is deterministic
            # even on CUDA; ranks are added in rank order, so all ranks agree.
            where = positions.decode(row[k * vsz: k * vsz + pb].view(1, pb), numel, k).view(k)
            flat.index_add_(0, where, row[: k * vsz].view(vdtype).to(torch.float32))
        flat.div_(group.size)
        unflatten_from(flat, tensors)
        self._count(tensors, mine.numel())

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": self.ratio}
