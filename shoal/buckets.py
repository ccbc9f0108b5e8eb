"""Gradient buckets: which parameters share one, and each bucket's flat buffer.

:func:`assign_buckets` lays parameters out in the order their gradients
become ready; a :class:`_Bucket` holds one flat buffer per bucket with a view
per parameter (the views become the parameters' ``.grad``), and
:class:`GradBucket` is what a communication hook sees (torch's
``dist.GradBucket`` interface). :mod:`shoal.reducer` drives them through
backward.

Example::

    assign_buckets([torch.zeros(10)] * 3, cap_bytes=80)   # [[2, 1], [0]]
"""

from __future__ import annotations

import sys
from concurrent.futures import Future as ThreadFuture
from typing import Any, Sequence

import torch
from torch import nn
from torch._utils import _unflatten_dense_tensors

from shoal.comm.flat import flat_views
from shoal.comm.group import Handle

FIRST_BUCKET_BYTES = 1024 * 1024


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``params`` per bucket, in the order buckets become ready.

    Walks parameters in reverse order, keeping one open bucket per
    (dtype, device); a bucket closes once it reaches its cap (a parameter
    larger than the cap gets a bucket to itself). The first bucket of each
    kind is capped at ``first_cap_bytes`` (default: ``min(1 MiB, cap)``, as
    torch does) so that communication starts early in backward.

    >>> ps = [torch.zeros(10), torch.zeros(10), torch.zeros(10)]
    >>> assign_buckets(ps, cap_bytes=80)
    [[2, 1], [0]]
    """
    first = min(FIRST_BUCKET_BYTES, cap_bytes) if first_cap_bytes is None else first_cap_bytes
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed_kinds: set[tuple[torch.dtype, torch.device]] = set()
    done: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        idx, size = open_.get(key, ([], 0))
        idx.append(i)
        size += p.numel() * p.element_size()
        if size >= (cap_bytes if key in closed_kinds else first):
            done.append(idx)
            open_.pop(key, None)
            closed_kinds.add(key)
        else:
            open_[key] = (idx, size)
    done.extend(idx for idx, _ in open_.values())
    # Ready order: the bucket holding the latest-registered parameter first.
    done.sort(key=lambda b: -b[0])
    return done


class GradBucket:
    """What a communication hook sees: torch's ``dist.GradBucket`` interface.

    ``gradients()`` are views into ``buffer()`` in parameter shapes, so a hook
    may write into either. ``set_buffer`` replaces the tensor ``buffer()``
    returns (torch's compression wrappers use it to hand a cast copy on).
    """

    def __init__(self, index: int, buffer: torch.Tensor, grads: list[torch.Tensor],
                 params: Sequence[torch.Tensor], names: list[str], last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._grads = grads
        self._params = list(params)
        self._names = names
        self._last = last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def parameter_names(self) -> list[str]:
        """shoal extension: the parameters' names (stable keys for hook state)."""
        return self._names

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor


class _Bucket:
    """A bucket's fixed layout and its per-step state."""

    def __init__(self, index: int, members: list[int], params: Sequence[nn.Parameter],
                 names: Sequence[str], last: bool) -> None:
        self.index = index
        self.members = members
        self.params = [params[i] for i in members]
        self.names = [names[i] for i in members]
        self.last = last
        first = self.params[0]
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views = flat_views(self.buffer, self.params)
        self.pending = len(members)
        self.work: Handle | torch.futures.Future | ThreadFuture | None = None
        self.comm_done: Any = None   # CUDA: the codec thread's event once its mean is written
        self.attached: list[int] = []  # slots whose .grad was None and got their view this backward
        self.stray: list[int] = []     # slots whose .grad was another tensor, copied in at launch
        self.handed_off = False        # a .grad may view the buffer: check before reusing it
        self.kept = False              # take_back found .grad that are still views (kept by zero_grad)
        self._base_refs = _buffer_refs(self.buffer, self.views)

    def fresh_buffer(self) -> None:
        """A new zeroed buffer (the old one now belongs to the ``.grad`` that view it)."""
        self.buffer = torch.zeros_like(self.buffer)
        # The views made in C++: no Python work per parameter beyond the list.
        self.views = list(_unflatten_dense_tensors(self.buffer, self.params))
        self.handed_off = self.kept = False
        self._base_refs = _buffer_refs(self.buffer, self.views)

    def take_back(self) -> bool:
        """Whether the handed-off buffer may serve this backward again: host reference counts of
        its storage and views equal those taken when the views were made, bar views that are
        still their parameter's ``.grad`` (reduced into in place, as torch does to a kept
        ``.grad``). A dropped ``.grad`` the user still holds, or a view of one, keeps it handed
        off. A fresh buffer per step costs page faults at its first write (~250 per step for
        the overhead bench's MLP), which made shoal's DDP slower than torch's on a CPU."""
        base = self._base_refs
        now = _buffer_refs(self.buffer, self.views) if base is not None else None
        if base is None or now is None or now[0] != base[0]:
            return False
        if any(n != b and p.grad is not v for p, v, n, b in zip(self.params, self.views, now[1], base[1])):
            return False
        # Views still .grad stay handed off after this backward too (a later set_to_none must
        # not let the next backward zero a .grad someone kept): see Reducer._write_grads.
        self.kept = any(p.grad is v for p, v in zip(self.params, self.views))
        self.handed_off = False
        return True

    def grad_bucket(self) -> GradBucket:
        return GradBucket(self.index, self.buffer, self.views, self.params, self.names, self.last)


def _storage_uses(buffer: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(buffer.untyped_storage()._cdata))


def _buffer_refs(buffer: torch.Tensor, views: list[torch.Tensor]) -> tuple[int, list[tuple[int, int]]] | None:
    """Reference counts of a bucket buffer and its views: the storage's uses, then each view's
    C++ and Python references. Taken the same way right after the views are made (no one else
    sees them) and when the buffer may be taken back. None where this torch lacks the
    counters: the buffer is then never taken back."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return None
    return _storage_uses(buffer), [(v._use_count(), sys.getrefcount(v)) for v in views]  # type: ignore[attr-defined]
