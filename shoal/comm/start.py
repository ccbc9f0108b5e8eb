"""The differences between groups that code above the transport may read, and the start of training.

Code above :mod:`shoal.comm` asks a group's step interface (``begin_step``,
``commit``, ``error``, ``report_error``, ``start_state``) instead of asking
what kind of group it is. :class:`Traits` names the few real differences,
read only where a feature must refuse a kind of group:

``members_change``
    Members may join or leave between steps (an elastic group). A quorum's
    size is known only within a step; a newcomer is healed from a peer.
``work_in_flight``
    Collectives may stay in flight across steps. False on an elastic group:
    no reduction may outlive the step's vote.

Example::

    if group.traits.members_change:
        raise ConfigError("this feature needs a fixed set of members")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from shoal.errors import ModelMismatchError


@dataclass(frozen=True)
class Traits:
    """What may differ between groups (see the module docstring)."""

    members_change: bool = False
    work_in_flight: bool = True


STATIC = Traits()
ELASTIC = Traits(members_change=True, work_in_flight=False)


class _Collective(Protocol):
    def all_gather_object(self, obj: Any, tag: str = "control") -> list[Any]: ...

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, tag: str = "misc",
                            cache: dict[torch.dtype, torch.Tensor] | None = None) -> Any: ...


def check_same_model(group: _Collective, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`ModelMismatchError` on every rank if any rank's parameters differ.

    Every rank receives every rank's list, so all reach the same verdict and
    none is left waiting in a later collective.
    """
    mine = [(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named_params]
    everyone = group.all_gather_object(mine, tag="ddp/control")
    ref = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == ref:
            continue
        for k in range(max(len(ref), len(theirs))):
            a = ref[k] if k < len(ref) else None
            b = theirs[k] if k < len(theirs) else None
            if a != b:
                def show(x: Any) -> str:
                    return "nothing" if x is None else f"{x[0]!r} shape {list(x[1])} dtype {x[2]}"
                raise ModelMismatchError(
                    f"rank 0 and rank {rank} hold different models: parameter #{k} is {show(a)} on rank 0 "
                    f"but {show(b)} on rank {rank} ({len(ref)} vs {len(theirs)} trainable parameters). "
                    "Every rank must build the same model before wrapping it."
                )


def broadcast_module(module: nn.Module, group: _Collective, tag: str, buffers: bool = True) -> None:
    """Overwrite ``module``'s parameters (and ``buffers``) with rank 0's (one flat broadcast per dtype)."""
    group.broadcast_coalesced(list(module.parameters()) + (list(module.buffers()) if buffers else []), src=0,
                              tag=tag)
