"""One fused finiteness check: is any of these tensors NaN/Inf?

Every strategy skips a step on every rank when any rank's gradients are not
finite (SPEC G5). The check must not sync the host per tensor (on CUDA each
``bool(t.isfinite().all())`` stalls the stream) and must not sit between two
collectives of one sequence (a background thread that syncs there deadlocks
with a training stream waiting on it). So the check is split in two:

- :func:`nonfinite_flag` queues the work and returns a 0-dim float32 tensor on
  the tensors' device, ``0.0`` when every element is finite, ``> 0``
  otherwise. Nothing waits on it.
- :func:`read_flag` turns that tensor into a Python bool: the one host sync,
  to be done after the step's collectives (or not at all, when the flag is
  instead all-reduced or folded into an elastic vote first).

Example::

    >>> import torch
    >>> flag = nonfinite_flag([torch.ones(3), torch.tensor([1.0, float("nan")])])
    >>> read_flag(flag)
    True
    >>> read_flag(nonfinite_flag([torch.ones(3)]))
    False
"""

from __future__ import annotations

from typing import Sequence

import torch


def nonfinite_flag(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """A 0-dim float32 tensor, ``> 0`` iff some element of ``tensors`` is NaN or +-Inf.

    One fused L2 norm per dtype and device (``torch._foreach_norm``,
    accumulated in fp32): a NaN/Inf element makes it NaN/Inf. The L2 norm is
    memory-bound and vectorised on every device (the inf-norm was 18x slower
    on CPU: 13.8 ms against 0.75 ms for 5.2M fp32 values, one thread); fp32
    accumulation keeps fp16 tensors, whose own range ends at 65504, from
    overflowing. Only a tensor whose L2 norm exceeds fp32's range (~3.4e38,
    i.e. elements around 1e19) is reported non-finite although finite: far
    beyond any gradient a run could still train on. The result lives
    on ``device`` (default: the first tensor's device; CPU for no tensors).
    Integer tensors are always finite and are ignored.
    """
    floats = [t for t in tensors if t.is_floating_point() and t.numel() > 0]
    if device is None:
        device = tensors[0].device if len(tensors) else torch.device("cpu")
    if not floats:
        return torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in floats:
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    parts = []
    for (dev, _dtype), same in groups.items():
        norms = torch._foreach_norm(same, 2.0, dtype=torch.float32)
        bad = torch.stack(norms).isfinite().logical_not().sum(dtype=torch.float32)
        parts.append(bad if dev == device else bad.to(device, non_blocking=True))
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def read_flag(flag: torch.Tensor) -> bool:
    """``True`` when ``flag`` (from :func:`nonfinite_flag`, maybe reduced) says non-finite.

    The single host sync of the check: call it after the collectives that the
    flag travels with, never between two of them.
    """
    return bool(flag.item() != 0.0)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """``True`` when every element of ``tensors`` is finite (fused check plus one sync)."""
    return not read_flag(nonfinite_flag(tensors))
