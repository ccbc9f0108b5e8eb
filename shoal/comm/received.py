"""Checking state received from a peer (an elastic heal) before anything of it is loaded.

A newcomer loads whatever its healing peer sends: model, optimizer, codec and
strategy state. A peer with a different model, a bug or a corrupted memory
must not make it load a tensor of another shape or dtype (``load_state_dict``
would copy with broadcasting or casting, or fail halfway, leaving the worker
half loaded) or NaN/Inf (it would train on them). So the received tree is
compared with the worker's own before the first ``load``:

- where the local state has a tensor, the received one must be a tensor of
  the same shape and dtype;
- where the local state has a dict or a sequence, the received one must be
  one too, and its entries are compared where the local state has them
  (state the newcomer has not created yet, e.g. an optimizer's moments
  before its first step, has nothing to compare with and is only checked
  for finiteness);
- every floating-point tensor received must be finite (one fused check,
  :func:`shoal.comm.finite.all_finite`).

Example:
    >>> import torch
    >>> local = {"w": torch.zeros(2, 3), "opt": {"state": {}}}
    >>> check_received({"w": torch.ones(2, 3), "opt": {"state": {0: torch.ones(3)}}}, local) is None
    True
    >>> check_received({"w": torch.ones(3, 2), "opt": {"state": {}}}, local)
    'state.w: shape (3, 2) differs from the local (2, 3)'
    >>> check_received({"w": torch.ones(2, 3, dtype=torch.float64), "opt": {"state": {}}}, local)
    'state.w: dtype torch.float64 differs from the local torch.float32'
    >>> check_received({"w": torch.full((2, 3), float("nan")), "opt": {"state": {}}}, local)
    'state: holds NaN or Inf in state.w'
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.comm.finite import all_finite

MAX_DEPTH = 16   # deeper than any state_dict; a deeper tree is refused rather than walked


def check_received(received: Any, local: Any, path: str = "state") -> str | None:
    """Why ``received`` must not replace ``local`` (shape, dtype, structure, NaN/Inf), or None if it may."""
    tensors: list[tuple[str, torch.Tensor]] = []
    why = _compare(received, local, path, tensors, 0)
    if why is not None:
        return why
    floats = [t for _, t in tensors if t.is_floating_point()]
    if floats and not all_finite(floats):
        bad = next(p for p, t in tensors if t.is_floating_point() and not all_finite([t]))
        return f"{path}: holds NaN or Inf in {bad}"
    return None


def _compare(received: Any, local: Any, path: str, tensors: list[tuple[str, torch.Tensor]], depth: int) -> str | None:
    if depth > MAX_DEPTH:
        return f"{path}: nested deeper than {MAX_DEPTH} levels"
    if isinstance(received, torch.Tensor):
        tensors.append((path, received))
    if isinstance(local, torch.Tensor):
        if not isinstance(received, torch.Tensor):
            return f"{path}: expected a tensor, got {type(received).__name__}"
        if received.shape != local.shape:
            return f"{path}: shape {tuple(received.shape)} differs from the local {tuple(local.shape)}"
        if received.dtype != local.dtype:
            return f"{path}: dtype {received.dtype} differs from the local {local.dtype}"
        return None
    if isinstance(local, dict) and not isinstance(received, dict):
        return f"{path}: expected a dict, got {type(received).__name__}"
    if isinstance(local, (list, tuple)) and not isinstance(received, (list, tuple)):
        return f"{path}: expected a sequence, got {type(received).__name__}"
    if isinstance(received, dict):
        known = local if isinstance(local, dict) else {}
        items: Any = ((k, v, known.get(k)) for k, v in received.items())
    elif isinstance(received, (list, tuple)):
        mine = list(local) if isinstance(local, (list, tuple)) else []
        if mine and len(mine) != len(received):
            return f"{path}: {len(received)} items where the local state has {len(mine)}"
        items = ((i, v, mine[i] if i < len(mine) else None) for i, v in enumerate(received))
    else:
        return None
    for k, v, ref in items:
        why = _compare(v, ref, f"{path}.{k}", tensors, depth + 1)
        if why is not None:
            return why
    return None
