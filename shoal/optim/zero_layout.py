"""Who steps which parameters of a ZeroRedundancyOptimizer, and the buffers they travel in.

The pieces every layout is made of, on a static group and on an elastic one
alike (no group, no collective here):

- :func:`partition_by_size` / :func:`assign_bucket_owners`: the owner rank of
  each parameter (plain) or of each gradient bucket (overlapped with DDP),
  balanced by bytes, the same on every rank.
- :class:`Unit`: parameters one owner broadcasts together through one reused
  flat buffer.
- :class:`Shard`: one layout (who owns what among ``size`` members, under a
  membership id) with the optimizers over this member's part.
- :class:`Journal`: copies of what a step changed, so that a step the group
  discards (or a non-finite one) can be undone.

Example::

    owners = partition_by_size([[4 * p.numel() for p in params]], world)[0]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from shoal.comm.asks import members_fixed

PARAM_TAG = "zero/params"
GRAD_TAG = "zero/grad"   # where a skipped non-finite step is counted (meter.add_nonfinite_skip)
STATE_TAG = "zero/state"
# Broadcast buckets in plain mode: large enough to amortise per-call cost,
# small enough that several are in flight at once.
BROADCAST_CAP_BYTES = 16 * 1024 * 1024
# The membership id of a static group: its layout is made once and never goes stale.
STATIC = -1


def nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def membership_id(group: Any) -> int | None:
    """The quorum id of an elastic group's current membership (None before its first quorum);
    :data:`STATIC` on a static group, whose membership never changes.

    A layout made for another id is stale: the next step re-shards.
    """
    if members_fixed(group):
        return STATIC
    q = group.quorum
    return None if q is None else int(q.qid)


def partition_by_size(group_sizes: Sequence[Sequence[int]], world: int) -> list[list[int]]:
    """Owner rank of each parameter, per group: greedy, largest first, to the least loaded rank.

    Groups are taken in order and loads carry over, so appending a group
    never moves an earlier parameter (``add_param_group`` keeps state where
    it is). Ties go to the lower rank, so every rank computes the same map.

    >>> partition_by_size([[10, 30, 20]], 2)
    [[1, 0, 1]]
    >>> partition_by_size([[10, 30, 20], [5]], 2)
    [[1, 0, 1], [0]]
    """
    load = [0] * world
    owners: list[list[int]] = []
    for sizes in group_sizes:
        ranks = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            r = min(range(world), key=lambda r: load[r])
            ranks[i] = r
            load[r] += sizes[i]
        owners.append(ranks)
    return owners


def assign_bucket_owners(bucket_bytes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each gradient bucket: largest first, to the least loaded rank.

    >>> assign_bucket_owners([100, 10, 60, 50], 2)
    [0, 0, 1, 1]
    """
    load = [0] * world
    owners = [0] * len(bucket_bytes)
    for b in sorted(range(len(bucket_bytes)), key=lambda b: -bucket_bytes[b]):
        r = min(range(world), key=lambda r: load[r])
        owners[b] = r
        load[r] += bucket_bytes[b]
    return owners


class Unit:
    """Parameters that one rank broadcasts together through one reused flat buffer."""

    def __init__(self, src: int, params: list[torch.Tensor]) -> None:
        self.src = src
        self.params = params
        first = params[0]
        self.flat = torch.empty(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat.narrow(0, offset, p.numel()).view(p.shape))
            offset += p.numel()

    def pack(self) -> None:
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in self.params], out=self.flat)

    def unpack(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], self.views)


def plain_units(params: Sequence[torch.Tensor], owner: dict[torch.Tensor, int], world: int) -> list[Unit]:
    """Per rank, in parameter order: one unit per (dtype, device), split at the cap."""
    units: list[Unit] = []
    for r in range(world):
        open_: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            if owner[p] != r:
                continue
            members = open_.setdefault((p.dtype, p.device), [])
            members.append(p)
            if sum(nbytes(q) for q in members) >= BROADCAST_CAP_BYTES:
                units.append(Unit(r, members))
                open_.pop((p.dtype, p.device))
        units.extend(Unit(r, members) for members in open_.values())
    return units


def sync_groups(src: Sequence[dict[str, Any]], dst: Sequence[dict[str, Any]]) -> None:
    """Copy hyper-parameters (everything but ``params``) group by group."""
    for s, d in zip(src, dst):
        for key, value in s.items():
            if key != "params":
                d[key] = value


def step_subset(opt: torch.optim.Optimizer, subsets: list[list[torch.Tensor]]) -> None:
    """One ``opt.step()`` restricted to ``subsets`` (per parameter group), with the groups' settings."""
    groups = opt.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g, subset in zip(groups, subsets):
            g["params"] = subset
        opt.step()
    finally:
        for g, ps in zip(groups, saved):
            g["params"] = ps


def _clone_state(st: Any) -> dict[str, Any] | None:
    if not st:
        return None
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in st.items()}


class Journal:
    """Copies of the parameters and optimizer state that a step is about to change, until its verdict.

    Opened per step by the group (registered rollback state: a discarded step
    is restored by the group) or, on a static group, only where a non-finite
    verdict may undo an overlapped step. No journal, no copy.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor, Any]] = []

    def record(self, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        """Keep copies of ``params`` and of their state in ``opt`` (before ``opt`` steps them)."""
        self.entries += [(opt, p, p.detach().clone(), _clone_state(opt.state.get(p))) for p in params]

    def restore(self) -> None:
        """Put back what :meth:`record` copied (the copies become the live state: no second copy)."""
        with torch.no_grad():
            for opt, p, value, st in self.entries:
                p.copy_(value)
                if st is None:
                    opt.state.pop(p, None)
                else:
                    opt.state[p] = st

    def clear(self) -> None:
        self.entries = []


@dataclass
class Shard:
    """One layout: who owns what among ``size`` members of membership ``qid``, and this member's optimizers.

    ``qid``: a quorum id, :data:`STATIC`, or None (a layout no step may use:
    made before the first quorum, or after a heal or a ``load_state_dict``).
    """

    qid: int | None
    rank: int
    size: int
    owner: dict[torch.Tensor, int]
    units: list[Unit]
    optim: torch.optim.Optimizer
    replica: torch.optim.Optimizer | None = None
    buckets: list[Unit | None] | None = None   # overlapped with DDP: each gradient bucket's unit (or None)
    bucket_owner: list[int] | None = None      # overlapped with DDP: each gradient bucket's owner rank

    def stepper(self, src: int) -> torch.optim.Optimizer | None:
        """The optimizer of this member that steps the parameters owned by ``src`` (None: it takes no part)."""
        if src == self.rank:
            return self.optim
        if self.replica is not None and src == (self.rank + 1) % self.size:
            return self.replica
        return None

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optim] if self.replica is None else [self.optim, self.replica]


@dataclass
class ZeroStats:
    """Counters of a ZeroRedundancyOptimizer's steps (since construction); re-shards happen on elastic groups."""

    commits: int = 0
    discards: int = 0
    reshards: int = 0            # committed layouts of a new quorum
    reshard_bytes: int = 0       # serialised state received from peers in committed re-shards, in total
    lost_params: int = 0         # parameters whose state was re-initialised, in total
    lost: list[tuple[int, list[int]]] = field(default_factory=list)  # (committed step, global indices)
    replica_bytes: int = 0       # optimizer state held for the ring neighbour, after the last commit
    replica_drift: int = 0       # commits where the recomputed neighbour parameters differed from the owner's
