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
- every floating-point or complex tensor received must be finite (one fused
  check, :func:`shoal.comm.finite.all_finite`), except at the positions
  where the receiver's own copy holds the very same non-finite value (-inf,
  +inf or NaN). A model's own constants stay allowed (an additive causal
  mask of -inf, a running maximum that starts at -inf: the newcomer built
  them too), while a NaN or Inf sent into a parameter, a gradient or
  optimizer state, which the receiver holds finite (or does not hold yet),
  is refused. A receiver can only be talked into a non-finite value it
  already holds itself.

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
    "state: holds NaN or Inf in state.w where this worker's own copy is finite or absent"
    >>> mask = torch.triu(torch.full((3, 3), float("-inf")), 1)   # the receiver's own buffer
    >>> check_received({"mask": mask.clone()}, {"mask": mask}) is None
    True
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.comm.finite import all_finite, checked

MAX_DEPTH = 16   # deeper than any state_dict; a deeper tree is refused rather than walked


def check_received(received: Any, local: Any, path: str = "state") -> str | None:
    """Why ``received`` must not replace ``local`` (shape, dtype, structure, NaN/Inf), or None if it may."""
    tensors: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    why = _compare(received, local, path, tensors, 0)
    if why is not None:
        return why
    floats = [t for _, t, _ in tensors if checked(t)]
    if not floats or all_finite(floats):   # the usual case: one fused check
        return None
    for where, t, mine in tensors:
        if checked(t) and not all_finite([t]) and not _same_nonfinite(t, mine):
            return f"{path}: holds NaN or Inf in {where} where this worker's own copy is finite or absent"
    return None


def _same_nonfinite(received: torch.Tensor, local: torch.Tensor | None) -> bool:
    """Whether every non-finite element of ``received`` is the same non-finite value in ``local``."""
    if local is None:
        return False
    mine = local.detach().to(received.device)
    same = (received == mine) | (received.isnan() & mine.isnan())   # -inf == -inf; NaN matches NaN
    return bool((received.isfinite() | (same & mine.isfinite().logical_not())).all())


def _compare(received: Any, local: Any, path: str, tensors: list[tuple[str, torch.Tensor, torch.Tensor | None]],
             depth: int) -> str | None:
    if depth > MAX_DEPTH:
        return f"{path}: nested deeper than {MAX_DEPTH} levels"
    if isinstance(local, torch.Tensor):
        if not isinstance(received, torch.Tensor):
            return f"{path}: expected a tensor, got {type(received).__name__}"
        if received.shape != local.shape:
            return f"{path}: shape {tuple(received.shape)} differs from the local {tuple(local.shape)}"
        if received.dtype != local.dtype:
            return f"{path}: dtype {received.dtype} differs from the local {local.dtype}"
        tensors.append((path, received, local))
        return None
    if isinstance(received, torch.Tensor):
        tensors.append((path, received, None))
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
