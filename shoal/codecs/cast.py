"""fp16 / bf16 on the wire."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from shoal.codecs.base import BufferPool, LossyCodec, check_inputs, flatten_into, sub_tag, unflatten_from
from shoal.comm.group import Group
from shoal.errors import ConfigError

_WIRE_DTYPES = (torch.float16, torch.bfloat16)

# (backend, dtype) pairs whose all-reduce the backend refused; we all-gather
# those instead. Every rank runs the same torch build, so every rank refuses
# (and falls back) identically.
_NO_NATIVE_REDUCE: set[tuple[str, torch.dtype]] = set()


class Cast(LossyCodec):
    """Send tensors as fp16 or bf16; average in fp32 where the backend allows.

    Each rank divides by the group size in fp32 *before* casting (so an fp16
    sum cannot overflow where the fp32 mean would not), then one all-reduce
    sums the casts in the wire dtype. Backends that cannot reduce the wire
    dtype (gloo before it learned bf16) get an all-gather of the casts,
    summed locally in fp32 in rank order, so every rank gets the same bits.

    Bytes handed to the collective: ``2 * numel``. Meter tag ``<tag>/fp16``
    or ``<tag>/bf16``. Works on CPU (gloo) and CUDA (NCCL) tensors alike.

    Example::

        codec = Cast(torch.bfloat16)
        codec.mean(grads, names, group, tag="ddp/grad")
    """

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        if dtype not in _WIRE_DTYPES:
            raise ConfigError(f"Cast dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self._pool = BufferPool()

    @property
    def _suffix(self) -> str:
        return "fp16" if self.dtype == torch.float16 else "bf16"

    @torch.no_grad()
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        check_inputs(tensors, names, "Cast")
        if not tensors:
            return
        device = tensors[0].device
        numel = sum(t.numel() for t in tensors)
        scaled = self._pool.get("fp32", numel, torch.float32, device)
        flatten_into(tensors, scaled)
        scaled.div_(group.size)
        wire = self._pool.get("wire", numel, self.dtype, device)
        wire.copy_(scaled)
        if residuals is not None:
            # What this rank contributed, rescaled: size * cast(x / size).
            sent = wire.to(torch.float32).mul_(group.size)
            unflatten_from(scaled.mul(group.size).sub_(sent), residuals)
        self._reduce(wire, scaled, group, sub_tag(tag, self._suffix))
        unflatten_from(scaled, tensors)
        self._count(tensors, numel * wire.element_size())

    def _reduce(self, wire: torch.Tensor, out: torch.Tensor, group: Group, tag: str) -> None:
        """Sum ``wire`` over the group into the fp32 ``out``."""
        key = (group.backend, self.dtype)
        if key not in _NO_NATIVE_REDUCE:
            try:
                group.all_reduce(wire, op="sum", tag=tag).wait()
                out.copy_(wire)
                return
            except RuntimeError as e:
                if "unsupported" not in str(e).lower():  # not a dtype refusal: a real failure
                    raise
                _NO_NATIVE_REDUCE.add(key)
        gathered = self._pool.get("gathered", wire.numel() * group.size, self.dtype, wire.device)
        group.all_gather_into(gathered, wire, tag=tag).wait()
        rows = gathered.view(group.size, -1)
        out.copy_(rows[0])
        for r in range(1, group.size):
            out.add_(rows[r])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dtype": str(self.dtype)}
