"""SparseLoCo-style compression: chunked top-k, low-bit values, error feedback.

Made for DiLoCo's pseudo-gradients (an outer step every H inner steps moves
one large, slowly changing vector), usable anywhere a codec goes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from shoal.codecs import positions
from shoal.codecs.base import BufferPool, LossyCodec, check_inputs, flatten_into, sub_tag, unflatten_from
from shoal.codecs.feedback import ErrorFeedback
from shoal.codecs.largest import topk_indices
from shoal.comm.group import Group
from shoal.errors import ConfigError

_BITS = (1, 2, 4, 8)
_MAX_CHUNK = 2**16


class QuantizedTopK(LossyCodec):
    """Top-k per chunk, the kept values quantised to ``bits`` bits; all-gathered.

    The inputs (flattened together, fp32) are cut into chunks of ``chunk``
    elements (the last one zero-padded; one chunk of all the elements when
    there are fewer). Each chunk keeps its ``k = min(c, max(1, ceil(ratio *
    c)))`` largest magnitudes (``c`` the chunk length): their positions in
    the chunk, Elias-Fano coded (:mod:`shoal.codecs.positions`: about
    ``log2(c / k) + 2`` bits each), and ``bits``-bit codes: one sign bit and
    ``bits - 1`` bits of magnitude on a uniform grid of ``M = 2 ** (bits - 1)``
    levels from the smallest kept magnitude ``lo`` to the largest ``hi`` of
    the chunk (two fp32 per chunk; at ``bits=1`` the one level is the mean
    kept magnitude). Every rank all-gathers every rank's bytes, decodes them
    and adds them in rank order, so all ranks end with the same bits; the
    mean divides by the group size.

    One rank's payload (``wire_bytes``): ``n (8 + P + ceil(k' bits / 8))``
    bytes rounded up to 4, for ``n`` chunks, ``P = ceil((k l + k + ((c - 1)
    >> l) + 1) / 8)`` bytes of positions with ``l = floor(log2(c / k))``, and
    ``k'`` = ``k`` rounded up to whole bytes of codes. At ``ratio=0.02,
    bits=2, chunk=4096`` that is 0.65 % of fp32 (153x smaller); at
    ``ratio=0.01``, 0.38 % (260x). A call sends ``N - 1`` payloads per rank
    (ring all-gather).

    NaN/Inf: ``topk`` of magnitudes ranks them first, so a bad element is
    always kept; it makes its chunk's ``lo``/``hi`` non-finite, which decodes
    the chunk to NaN/Inf on every rank (docs/codecs.md's policy).

    Use it inside error feedback (:class:`SparseLoCo` is that): without it,
    what is never in a chunk's top k is never sent. Meter tag ``<tag>/sparse``.

    Example::

        codec = ErrorFeedback(QuantizedTopK(ratio=0.02, bits=2))
        codec.mean(pseudo_grads, names, group, tag="diloco/pseudograd")
    """

    def __init__(self, ratio: float = 0.02, bits: int = 2, chunk: int = 4096) -> None:
        super().__init__()
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise ConfigError(f"ratio must be in (0, 1] (the fraction of each chunk sent), got {ratio!r}")
        if bits not in _BITS or isinstance(bits, bool):
            raise ConfigError(f"bits must be one of {_BITS} (codes are packed whole into bytes), got {bits!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= _MAX_CHUNK:
            raise ConfigError(f"chunk must be an integer in [1, {_MAX_CHUNK}] (elements per top-k), got {chunk!r}")
        self.ratio, self.bits, self.chunk = float(ratio), bits, chunk
        self._pool = BufferPool()

    def layout(self, numel: int) -> tuple[int, int, int, int]:
        """``(chunks, chunk length, k per chunk, k rounded up to whole bytes of codes)`` for ``numel``.

        >>> QuantizedTopK(0.02, 2, 4096).layout(10000)
        (3, 4096, 82, 84)
        """
        c = min(self.chunk, max(numel, 1))
        k = min(c, max(1, math.ceil(self.ratio * c)))
        per_byte = 8 // self.bits
        return -(-numel // c), c, k, -(-k // per_byte) * per_byte

    def wire_bytes(self, numel: int) -> int:
        """Bytes one rank hands to the all-gather for a call of ``numel`` elements.

        >>> QuantizedTopK(0.02, 2, 4096).wire_bytes(10000)
        324
        """
        n, c, k, kp = self.layout(numel)
        return -(-n * (8 + positions.layout(c, k)[2] + kp * self.bits // 8) // 4) * 4

    @torch.no_grad()
    def mean_with_residual(self, tensors: Sequence[torch.Tensor], names: Sequence[str], group: Group, tag: str,
                           residuals: Sequence[torch.Tensor] | None) -> None:
        check_inputs(tensors, names, "QuantizedTopK")
        if not tensors:
            return
        device = tensors[0].device
        numel = sum(t.numel() for t in tensors)
        n, c, k, _ = self.layout(numel)
        flat = self._pool.get("flat", n * c, torch.float32, device)
        flatten_into(tensors, flat[:numel])
        flat[numel:].zero_()
        mine = self._pool.get("wire", self.wire_bytes(numel), torch.uint8, device)
        idx, code = self._encode(flat.view(n, c), k, mine)
        if residuals is not None:
            # What this rank's contribution lost: the input minus what its own bytes decode to (the positions
            # and codes those bytes hold, taken from the encoder rather than decoded back).
            own = self._pool.get("own", n * c, torch.float32, device)
            own.zero_()
            own.view(n, c).scatter_add_(1, idx, self._values(code, self._views(mine, n, c, k)[0]))
            unflatten_from(torch.sub(flat, own, out=own)[:numel], residuals)
        gathered = self._pool.get("gathered", mine.numel() * group.size, torch.uint8, device)
        group.all_gather_into(gathered, mine, tag=sub_tag(tag, "sparse")).wait()
        flat.zero_()
        for row in gathered.view(group.size, -1):   # in rank order: every rank adds alike
            self._decode_add(row, n, c, k, flat.view(n, c))
        flat.div_(group.size)
        unflatten_from(flat[:numel], tensors)
        self._count(tensors, mine.numel())

    def _views(self, buf: torch.Tensor, n: int, c: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scales ``[n, 2]`` fp32, coded positions ``[n, P]`` uint8, packed codes ``[n, k' bits / 8]`` uint8)."""
        kp = -(-k // (8 // self.bits)) * (8 // self.bits)
        pb = positions.layout(c, k)[2]
        scales = buf[: 8 * n].view(torch.float32).view(n, 2)
        pos = buf[8 * n: 8 * n + n * pb].view(n, pb)
        codes = buf[8 * n + n * pb: 8 * n + n * pb + n * kp * self.bits // 8].view(n, -1)
        return scales, pos, codes

    def _encode(self, chunks: torch.Tensor, k: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``chunks``' bytes into ``out``; return the kept positions and their codes (``[n, k]`` each)."""
        n, c = chunks.shape
        scales, pos, codes = self._views(out, n, c, k)
        # The k largest magnitudes (NaN/Inf rank first), in increasing position (Elias-Fano); the codes follow.
        idx = torch.sort(topk_indices(chunks.abs(), k), dim=1).values
        vals = torch.gather(chunks, 1, idx)
        mag = vals.abs()
        levels = 2 ** (self.bits - 1)
        if levels == 1:
            lo = hi = mag.mean(dim=1, keepdim=True)
            level = torch.zeros_like(mag)
        else:
            lo, hi = mag.amin(dim=1, keepdim=True), mag.amax(dim=1, keepdim=True)
            span = hi - lo
            safe = torch.where(span > 0, span, torch.ones_like(span))
            level = torch.round((mag - lo) / safe * (levels - 1)).clamp_(0, levels - 1)
        scales[:, :1].copy_(lo)
        scales[:, 1:].copy_(hi)
        positions.encode(idx, c, pos)
        code = level.to(torch.uint8) | (vals < 0).to(torch.uint8) << (self.bits - 1)
        self._pack(code, codes)
        out[8 * n + pos.numel() + codes.numel():].zero_()
        return idx, code

    def _pack(self, code: torch.Tensor, out: torch.Tensor) -> None:
        n, k = code.shape
        per = 8 // self.bits
        padded = torch.zeros(n, out.shape[1] * per, dtype=torch.uint8, device=code.device)
        padded[:, :k] = code
        groups = padded.view(n, -1, per)
        out.zero_()
        for j in range(per):
            out.bitwise_or_(groups[:, :, j] << (self.bits * j))

    def _decode_add(self, buf: torch.Tensor, n: int, c: int, k: int, into: torch.Tensor) -> None:
        """Add what ``buf`` (one rank's bytes) decodes to into ``into`` (``[n, c]`` fp32)."""
        scales, pos, codes = self._views(buf, n, c, k)
        per, mask = 8 // self.bits, (1 << self.bits) - 1
        code = torch.stack([(codes >> (self.bits * j)) & mask for j in range(per)], dim=2).view(n, -1)[:, :k]
        # One rank's positions in a chunk are distinct: the scatter is deterministic, CUDA too.
        into.scatter_add_(1, positions.decode(pos, c, k), self._values(code, scales))

    def _values(self, code: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The values ``[n, k]`` codes (``[n, k]`` uint8) stand for, on their chunks' ``[lo, hi]`` grids."""
        levels = 2 ** (self.bits - 1)
        level = (code & (levels - 1)).to(torch.float32)
        lo, hi = scales[:, :1], scales[:, 1:]
        mag = lo + (hi - lo) * (level / max(levels - 1, 1))
        return torch.where((code >> (self.bits - 1)).bool(), -mag, mag)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": self.ratio, "bits": self.bits, "chunk": self.chunk}


class SparseLoCo(ErrorFeedback):
    """SparseLoCo's pseudo-gradient codec: error feedback around :class:`QuantizedTopK`.

    Each call, rank r adds its residual (decayed by ``decay``) to its input,
    sends the chunked top-k of that sum in ``bits`` bits, and keeps the rest as
    its new residual: ``e <- decay * e + x - C_r(decay * e + x)``. At
    ``decay=1`` nothing is lost: over calls, what rank r's bytes decoded to
    plus its residual equals the sum of its inputs (to float rounding), which
    tests/unit/test_sparse_codec.py checks. ``decay < 1`` is the SparseLoCo
    paper's error-feedback decay (the residual then also plays the outer
    momentum's part: pair it with ``OuterSGD(lr=1.0, momentum=0.0,
    nesterov=False)``). Residuals, non-finite handling, checkpoints, elastic
    rollback and newcomers' zeroed residuals are :class:`ErrorFeedback`'s.

    Args:
        ratio: fraction of each chunk sent (1 to 3 % in the paper).
        bits: bits per kept value (1, 2, 4 or 8; 2 in the paper).
        chunk: elements per top-k chunk (at most 65536).
        decay: residual decay in ``(0, 1]``.

    Example::

        shoal.DiLoCo(inner_steps=50, codec=shoal.codecs.SparseLoCo(ratio=0.02, bits=2))
    """

    def __init__(self, ratio: float = 0.02, bits: int = 2, chunk: int = 4096, decay: float = 1.0) -> None:
        super().__init__(QuantizedTopK(ratio, bits, chunk), decay=decay)
