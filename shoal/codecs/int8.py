"""8-bit blockwise quantization with a per-block absmax scale.

Two ways to average the codes, chosen per call by bytes sent (see
:meth:`Int8Blockwise.method_for`): one all-gather of every rank's codes, or a
quantized reduce-scatter (all-to-all of code chunks, each rank averages one
chunk and requantizes it) followed by an all-gather of the averaged chunks.
"""

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


def dequantize_blocks(buf: torch.Tensor, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: into ``out`` (flat fp32) if given, else a new tensor."""
    nblocks = buf.numel() // (4 + block_size)  # a few alignment bytes may trail
    scales = buf[: 4 * nblocks].view(torch.float32)
    codes = buf[4 * nblocks : nblocks * (4 + block_size)].view(torch.int8).view(nblocks, block_size)
    if out is None:
        return (codes.to(torch.float32) * scales.unsqueeze(1)).view(-1)
    torch.mul(codes, scales.unsqueeze(1), out=out.view(nblocks, block_size))
    return out


def _round4(nbytes: int) -> int:
    """Round up to a multiple of 4 so fp32 scales stay aligned in gathered buffers."""
    return -(-nbytes // 4) * 4


class Int8Blockwise(LossyCodec):
    """8-bit codes with one fp32 absmax scale per block (``scale = absmax / 127``).

    Each rank flattens its tensors (zero-padded to whole blocks) and
    quantizes them; then, per call, whichever of two methods sends fewer bytes
    per rank (:meth:`method_for`, ties go to all-gather):

    * ``all_gather``: all ranks all-gather every rank's codes and scales and
      each dequantizes and averages all contributions in fp32, in rank order.
      One quantization: error at most ``mean_r(scale_r) / 2`` per element.
      Sends ``(N - 1) * P`` bytes per rank, ``P = wire_bytes(numel)``.
    * ``reduce_scatter``: the blocks are cut into ``N`` chunks of ``c =
      ceil(nblocks / N)`` blocks; an all-to-all sends chunk ``j`` (codes and
      scales) to rank ``j``, which dequantizes the ``N`` contributions, averages
      them in fp32 in rank order, requantizes the average and all-gathers it.
      Two quantizations: error at most ``mean_r(scale_r) / 2 + scale_m / 2 <=
      mean_r(scale_r)`` per element, ``scale_m`` the requantized block's scale.
      Sends ``2 (N - 1) * C`` bytes per rank, ``C = chunk_bytes(numel, N)``
      (about ``P / N``).

    So all-gather at ``N <= 2`` (same bytes, one quantization, one round) and
    for calls of 1 or 2 blocks (4 at ``N = 3``); reduce-scatter otherwise,
    ``N / 2`` times fewer bytes, ``4B / (B + 4)`` (3.94x at B = 256) fewer than
    fp32's ring all-reduce at any ``N``. Either way every rank dequantizes the
    same gathered bytes, so all ranks end with the same bits, and a NaN/Inf
    input makes its block's scale non-finite, hence the mean non-finite on every
    rank (docs/codecs.md's policy).

    Error feedback (:meth:`mean_with_residual`): the residual is this rank's
    own quantization error (what its contribution lost), under both methods;
    the reduce-scatter's requantization error belongs to the average, not to
    any one rank's input, and is *not* fed back.

    Args:
        block_size: elements per scale (default 256).
        method: ``"auto"`` (fewest bytes), ``"all_gather"`` or
            ``"reduce_scatter"`` (forced, e.g. for the lower error of one
            quantization at 3+ ranks).

    Meter tags: ``<tag>/int8`` (all-gather method); ``<tag>/int8/scatter``
    (the all-to-all) and ``<tag>/int8/gather`` (reduce-scatter method).

    Example::

        codec = Int8Blockwise(block_size=256)
        codec.mean(grads, names, group, tag="ddp/grad")
    """

    METHODS = ("auto", "all_gather", "reduce_scatter")

    def __init__(self, block_size: int = 256, method: str = "auto") -> None:
        super().__init__()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if method not in self.METHODS:
            raise ConfigError(f"method must be one of {self.METHODS}, got {method!r}")
        self.block_size = block_size
        self.method = method
        self._pool = BufferPool()

    def wire_bytes(self, numel: int) -> int:
        """Bytes of one rank's codes and scales for ``numel`` elements (all-gather payload ``P``)."""
        nblocks = -(-numel // self.block_size)
        return _round4(nblocks * (4 + self.block_size))

    def chunk_bytes(self, numel: int, world: int) -> int:
        """Bytes ``C`` of one reduce-scatter chunk: ``ceil(nblocks / world)`` blocks, rounded up to 4."""
        nblocks = -(-numel // self.block_size)
        return _round4(-(-nblocks // world) * (4 + self.block_size))

    def method_for(self, numel: int, world: int) -> str:
        """The method a call of ``numel`` elements over ``world`` ranks uses.

        ``"auto"`` picks reduce-scatter iff it sends strictly fewer bytes per
        rank: ``2 (N-1) C < (N-1) P``, i.e. ``2 C < P``; never at ``N <= 2``.

        >>> Int8Blockwise().method_for(10**6, 2), Int8Blockwise().method_for(10**6, 3)
        ('all_gather', 'reduce_scatter')
        """
        if self.method != "auto":
            return self.method
        if world > 2 and 2 * self.chunk_bytes(numel, world) < self.wire_bytes(numel):
            return "reduce_scatter"
        return "all_gather"

    def sent_bytes(self, numel: int, world: int) -> int:
        """Bytes one rank sends per call under the meter's model (received: the same)."""
        if self.method_for(numel, world) == "reduce_scatter":
            return 2 * (world - 1) * self.chunk_bytes(numel, world)
        return (world - 1) * self.wire_bytes(numel)

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
        numel = sum(t.numel() for t in tensors)
        if self.method_for(numel, group.size) == "reduce_scatter":
            payload = self._reduce_scatter(tensors, numel, group, tag, residuals)
        else:
            payload = self._all_gather(tensors, numel, group, tag, residuals)
        self._count(tensors, payload)

    def _flat(self, tensors: Sequence[torch.Tensor], numel: int, padded: int) -> torch.Tensor:
        """The inputs as one fp32 buffer of ``padded`` elements, zeros after ``numel``."""
        flat = self._pool.get("flat", padded, torch.float32, tensors[0].device)
        flatten_into(tensors, flat[:numel])
        flat[numel:].zero_()
        return flat

    def _all_gather(self, tensors: Sequence[torch.Tensor], numel: int, group: Group, tag: str,
                    residuals: Sequence[torch.Tensor] | None) -> int:
        """One all-gather of every rank's codes; returns the bytes handed to it."""
        device = tensors[0].device
        flat = self._flat(tensors, numel, -(-numel // self.block_size) * self.block_size)
        mine = self._pool.get("wire", self.wire_bytes(numel), torch.uint8, device)
        quantize_blocks(flat, self.block_size, mine)
        if residuals is not None:
            unflatten_from(flat.sub(dequantize_blocks(mine, self.block_size)), residuals)
        gathered = self._pool.get("gathered", mine.numel() * group.size, torch.uint8, device)
        group.all_gather_into(gathered, mine, tag=sub_tag(tag, "int8")).wait()
        _average_rows(gathered.view(group.size, -1), self.block_size, flat)
        unflatten_from(flat, tensors)
        return mine.numel()

    def _reduce_scatter(self, tensors: Sequence[torch.Tensor], numel: int, group: Group, tag: str,
                        residuals: Sequence[torch.Tensor] | None) -> int:
        """All-to-all of code chunks, average and requantize one, all-gather; returns bytes handed over."""
        device, n, b = tensors[0].device, group.size, self.block_size
        cbytes = self.chunk_bytes(numel, n)
        celems = -(-(-(-numel // b)) // n) * b  # elements per chunk: ceil(nblocks / N) blocks
        flat = self._flat(tensors, numel, n * celems)
        chunks = flat.view(n, celems)
        send = self._pool.get("send", n * cbytes, torch.uint8, device).view(n, cbytes)
        for j in range(n):
            quantize_blocks(chunks[j], b, send[j])
        if residuals is not None:
            lost = self._pool.get("lost", n * celems, torch.float32, device)
            for j in range(n):
                dequantize_blocks(send[j], b, lost[j * celems : (j + 1) * celems])
            unflatten_from(torch.sub(flat, lost, out=lost)[:numel], residuals)
        recv = self._pool.get("recv", n * cbytes, torch.uint8, device)
        group.all_to_all(recv, send.view(-1), tag=sub_tag(tag, "int8/scatter")).wait()
        part = self._pool.get("part", celems, torch.float32, device)
        _average_rows(recv.view(n, cbytes), b, part)
        mine = self._pool.get("mine", cbytes, torch.uint8, device)
        quantize_blocks(part, b, mine)  # the second quantization (not fed back)
        gathered = self._pool.get("gathered_rs", n * cbytes, torch.uint8, device)
        group.all_gather_into(gathered, mine, tag=sub_tag(tag, "int8/gather")).wait()
        rows = gathered.view(n, cbytes)
        for j in range(n):
            dequantize_blocks(rows[j], b, chunks[j])
        unflatten_from(flat, tensors)
        return n * cbytes + cbytes

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "block_size": self.block_size}


def _average_rows(rows: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """``out`` = mean over rows of the dequantized rows, summed in fp32 in row (rank) order."""
    dequantize_blocks(rows[0], block_size, out)
    for r in range(1, rows.shape[0]):
        out.add_(dequantize_blocks(rows[r], block_size))
    out.div_(rows.shape[0])
