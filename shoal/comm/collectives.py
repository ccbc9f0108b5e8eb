"""What every group offers to move tensors: the :class:`Collectives` protocol.

:class:`~shoal.comm.Group` (one fixed ProcessGroup),
:class:`~shoal.membership.elastic.ElasticGroup` and
:class:`~shoal.membership.views.ElasticSubgroup` (a process group per quorum)
all implement it; code that only moves tensors (a host-aware mean's levels,
:mod:`shoal.comm.topology`) is typed against it and so never names a
concrete group class. This module imports nothing of shoal but
:mod:`shoal.comm.handle`, so every layer can use it without an import circle.

Example::

    def mean(group: Collectives, t: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(t, op="avg", tag="mean").wait()
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from shoal.comm.handle import Handle


class Collectives(Protocol):
    """The collectives of a group; each returns a :class:`~shoal.comm.handle.Handle` (see :class:`~shoal.comm.Group`)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def member(self) -> bool: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle: ...

    def all_gather(self, tensor: torch.Tensor, tag: str = "misc") -> Handle: ...

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle: ...

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "misc") -> Handle: ...

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", tag: str = "misc") -> Handle: ...

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum",
                       tag: str = "misc") -> Handle: ...

    def barrier(self, tag: str = "control") -> None: ...

    def all_gather_object(self, obj: Any, tag: str = "control") -> list[Any]: ...

    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "Collectives | None": ...
