"""8-bit blockwise quantization with a per-block absmax scale."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from shoal.codecs.base import BufferPool, LossyCodec, check_inputs, flatten_into, sub_tag, unflatten_from
from shoal.comm.group import Group
from shoal.errors import ConfigError


def quantize_blocks(flat: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """Quantize fp32 ``flat`` (numel a multiple of block_size) into the uint8 ``out``.

    ``out`` holds ``nblocks`` fp32 scales first (so their view is aligned),
    then ``nblocks * block_size`` int8 codes: ``x ~= code * scale`` with
    ``scale = absmax(block) / 127``.

    >>> x = torch.tensor([127.0, -64.0, 0.0, 12.7])
    >>> buf = torch.empty(2 * 4 + 4, dtype=torch.uint8)
    >>> quantize_blocks(x, 2, buf); dequantize_blocks(buf, 2).tolist()[:3]
    [127.0, -64.0, 0.0]
    """
    blocks = flat.view(-1, block_size)
    nblocks = blocks.shape[0]
    scales = out[: 4 * nblocks].view(torch.float32)
    codes = out[4 * nblocks : nblocks * (4 + block_size)].view(torch.int8).view(nblocks, block_size)
    torch.amax(blocks.abs(), dim=1, out=scales)
    scales.div_(127.0)
    # An all-zero block has scale 0: divide by 1 instead, its codes are 0 anyway.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes.copy_(torch.round(blocks / safe.unsqueeze(1)).clamp_(-127, 127))


def dequantize_blocks(buf: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: a new flat fp32 tensor."""
    nblocks = buf.numel() // (4 + block_size)  # a few alignment bytes may trail
    scales = buf[: 4 * nblocks].view(torch.float32)
    codes = buf[4 * nblocks : nblocks * (4 + block_size)].view(torch.int8).view(nblocks, block_size)
    return (codes.to(torch.float32) * scales.unsqueeze(1)).view(-1)


class Int8Blockwise(LossyCodec):
    """8-bit codes with one fp32 absmax scale per block; one all-gather per call.

    Each rank quantizes its tensors (flattened, zero-padded to whole blocks),
    all ranks all-gather the codes and scales in one uint8 buffer, and each
    rank dequantizes and averages all contributions in fp32, in rank order, so
    every rank ends with the same bits. Per element the error is at most
    ``scale / 254`` of each contribution, hence within ``mean(scale_r) / 127``
    of the true mean.

    Why all-gather rather than quantized reduce-scatter + all-gather
    (measured by scripts/measure_int8.py, see docs/codecs.md): at 2 ranks both
    send the same bytes and all-gather has 1.4x lower RMS error (one
    quantization instead of two) in one network round instead of two; at 3+
    ranks reduce-scatter sends fewer bytes (2(N-1)/N vs N-1 times the codes)
    but needs an all-to-all, which :class:`~shoal.comm.Group` does not offer yet.

    Bytes handed to the collective: ``ceil(numel / B) * (B + 4)`` (rounded up to 4), i.e.
    ``4B / (B + 4)`` times fewer than fp32 (3.94x for the default B = 256).
    Meter tag ``<tag>/int8``.

    Example::

        codec = Int8Blockwise(block_size=256)
        codec.mean(grads, names, group, tag="ddp/grad")
    """

    def __init__(self, block_size: int = 256) -> None:
        super().__init__()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self._pool = BufferPool()

    def wire_bytes(self, numel: int) -> int:
        """Bytes this rank contributes for ``numel`` elements (one all-gather)."""
        nblocks = -(-numel // self.block_size)
        # Rounded up to 4 bytes so every rank's fp32 scales stay aligned in the gathered buffer.
        return -(-nblocks * (4 + self.block_size) // 4) * 4

    @torch.no_grad()
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        check_inputs(tensors, names, "Int8Blockwise")
        if not tensors:
            return
        device = tensors[0].device
        numel = sum(t.numel() for t in tensors)
        nblocks = -(-numel // self.block_size)
        flat = self._pool.get("flat", nblocks * self.block_size, torch.float32, device)
        flatten_into(tensors, flat[:numel])
        flat[numel:].zero_()
        mine = self._pool.get("wire", self.wire_bytes(numel), torch.uint8, device)
        quantize_blocks(flat, self.block_size, mine)
        if residuals is not None:
            unflatten_from(flat.sub(dequantize_blocks(mine, self.block_size)), residuals)
        gathered = self._pool.get("gathered", mine.numel() * group.size, torch.uint8, device)
        group.all_gather_into(gathered, mine, tag=sub_tag(tag, "int8")).wait()
        rows = gathered.view(group.size, -1)
        flat.copy_(dequantize_blocks(rows[0], self.block_size))
        for r in range(1, group.size):
            flat.add_(dequantize_blocks(rows[r], self.block_size))
        flat.div_(group.size)
        unflatten_from(flat, tensors)
        self._count(tensors, mine.numel())

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "block_size": self.block_size}
