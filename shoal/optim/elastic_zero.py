"""ZeroRedundancyOptimizer on an :class:`~shoal.comm.elastic.ElasticGroup`: shards that follow the quorum.

One elastic step holds the whole ZeRO step, and one vote ends it::

    forward/backward      DDP on the same group: start_step, gradients averaged
    zero.step()           re-shard if the quorum changed (collective)
                          snapshot this member's shard (+ replica), step it
                          owners broadcast their updated parameters (into flat buffers)
                          vote: commit -> copy the received parameters in, adopt the new layout
                                discard -> restore the snapshot: nothing happened, on every member

Overlapped with that DDP (``DistributedDataParallel(..., optimizer=zero)``)
the same step runs bucket by bucket during backward and ``zero.step()`` is
only the vote; see :mod:`shoal.optim.elastic_overlap`.

The parameter exchange comes *before* the vote, so a step commits only once
every member holds every updated shard; a failure anywhere (gradient
reduction, re-shard, parameter broadcast) discards the whole step
(``FailurePolicy.DISCARD``) and no member is ever left with a half-updated
model. The price: one snapshot of this member's shard (its parameters and
optimizer state, ~1/N of the totals) per step.

Re-sharding: at the first step of every new quorum each member contributes
the optimizer state it holds (its shard; a replica only where no member holds
that shard itself; nothing if it was just healed, its state being stale or
absent), every member receives all of it
(one all-gather of serialised blobs: a transient peak of the whole state per
member), and takes the state of its new shard. State that no member holds
(its owner died and no replica survived) is re-initialised by the optimizer
at its next step, with a warning; ``stats.lost_params`` counts it and
``stats.lost`` says which parameters at which step.

Replicas (``replicate=True``): each member also steps its ring neighbour's
shard (rank ``r`` the shard of ``(r + 1) % N``) with an optimizer of its own,
from the same averaged gradients, so it holds that shard's state too; nothing
extra goes over the wire, it costs the neighbour's share of optimizer memory
(``stats.replica_bytes``) and compute. A step whose recomputed neighbour
parameters differ from the owner's (a non-deterministic optimizer) is counted
in ``stats.replica_drift``. One lost member loses no state; two ring
neighbours lost together lose the first one's.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shoal.comm.elastic import ElasticGroup
from shoal.comm.elastic_sub import ElasticSubgroup
from shoal.comm.group import Handle
from shoal.comm.objects import all_gather_bytes, from_bytes, to_bytes
from shoal.errors import ConfigError, ShoalError
from shoal.optim.zero import (PARAM_TAG, STATE_TAG, _plain_units, _sync_groups, _Unit, assign_bucket_owners,
                              partition_by_size)

if TYPE_CHECKING:
    from shoal.optim.elastic_overlap import ElasticOverlap
    from shoal.optim.zero import ZeroRedundancyOptimizer
    from shoal.reducer import Reducer

Snapshot = list[tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor, Any]]  # (optimizer, param, value, state)


@dataclass
class ElasticZeroStats:
    """Counters of an elastic ZeroRedundancyOptimizer (since construction)."""

    commits: int = 0
    discards: int = 0
    reshards: int = 0            # committed layouts of a new quorum
    reshard_bytes: int = 0       # serialised state received from peers in committed re-shards, in total
    lost_params: int = 0         # parameters whose state was re-initialised, in total
    lost: list[tuple[int, list[int]]] = field(default_factory=list)  # (committed step, global indices)
    replica_bytes: int = 0       # optimizer state held for the ring neighbour, after the last commit
    replica_drift: int = 0       # commits where the recomputed neighbour parameters differed from the owner's


@dataclass
class _Shard:
    """One layout: who owns what in the quorum ``qid``, and the optimizers over this member's part."""

    qid: int | None
    rank: int
    size: int
    owner: dict[torch.Tensor, int]
    units: list[_Unit]
    optim: torch.optim.Optimizer
    replica: torch.optim.Optimizer | None = None
    buckets: list[_Unit | None] | None = None   # overlapped with DDP: each gradient bucket's unit (or None)

    def stepper(self, src: int) -> torch.optim.Optimizer | None:
        """The optimizer of this member that steps the parameters owned by ``src`` (None: it takes no part)."""
        if src == self.rank:
            return self.optim
        if self.replica is not None and src == (self.rank + 1) % self.size:
            return self.replica
        return None


def _tensor_bytes(optim: torch.optim.Optimizer | None) -> int:
    if optim is None:
        return 0
    return sum(v.numel() * v.element_size() for st in optim.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _clone_state(st: Any) -> dict[str, Any] | None:
    if not st:
        return None
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in st.items()}


def snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> Snapshot:
    """Copies of ``params`` and of their state in ``opt``, for :meth:`ElasticShards._restore`."""
    return [(opt, p, p.detach().clone(), _clone_state(opt.state.get(p))) for p in params]


class ElasticShards:
    """The elastic side of a :class:`ZeroRedundancyOptimizer` (see the module docstring)."""

    def __init__(self, zero: "ZeroRedundancyOptimizer", group: ElasticGroup, replicate: bool) -> None:
        self.zero, self.group, self.replicate = zero, group, replicate
        self.stats = ElasticZeroStats()
        self.params = zero._all_params()
        self.index = {p: i for i, p in enumerate(self.params)}
        self.known: set[int] = set()   # parameters that have optimizer state (committed)
        self.dropped = False           # healed: the state held here is stale, contribute none
        self.shard = _Shard(None, zero.rank, zero.world_size, zero._owner, zero._units, zero.optim)
        self._new: tuple[_Shard, list[int], set[int], int] | None = None
        self.overlap: ElasticOverlap | None = None   # set when attached to DistributedDataParallel
        group.register_state("zero/hparams", self._hparams, self._healed)

    # --- overlap with DDP ----------------------------------------------------------
    def check_attach(self, reducer: "Reducer") -> None:
        """Raise ConfigError if ``reducer`` cannot drive the overlapped step (before anything changes)."""
        from shoal.optim.elastic_overlap import check_attach

        check_attach(self.group, reducer)

    def attach(self, reducer: "Reducer") -> None:
        """Step bucket by bucket during backward (``zero._attach`` has laid the buckets out)."""
        from shoal.optim.elastic_overlap import ElasticOverlap

        zero = self.zero
        # No quorum's layout yet: the first bucket of the next step re-shards by bucket.
        self.shard = _Shard(None, zero.rank, zero.world_size, zero._owner, zero._units, zero.optim, None,
                            list(zero._bucket_units))
        self.overlap = ElasticOverlap(self, reducer)

    # --- healing ---------------------------------------------------------------
    def _hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.zero.param_groups]

    def _healed(self, hparams: list[dict[str, Any]]) -> None:
        """This member was healed (new, restarted or behind): hyper-parameters from a peer, state dropped."""
        _sync_groups(hparams, self.zero.param_groups)
        self.dropped, self.known = True, set()
        self.shard.qid = None

    # --- the step ----------------------------------------------------------------
    def step(self) -> bool:
        g = self.group
        g.start_step()   # a no-op after the DDP forward; a step with no collective still needs a quorum
        q = g.quorum
        if q is None:  # pragma: no cover - start_step sets it
            raise ShoalError("no quorum after start_step")
        self._new = None
        if self.shard.qid != q.qid and g.error is None:
            self._new = self.reshard(q.qid)
        shard = self._new[0] if self._new is not None else self.shard
        snap = None
        if g.error is None and shard.qid == q.qid:
            snap = self._snapshot(shard)
            self._step(shard)
            handles = self._broadcast(shard)
            for h in handles:
                h.wait()
        if g.should_commit() and snap is not None:
            self._commit(shard, g.step - 1)
            return True
        if snap is not None:
            self._restore(shard, snap)
        self.stats.discards += 1
        self.zero.zero_grad(set_to_none=True)
        return False

    def _step(self, shard: _Shard) -> None:
        zero = self.zero
        for opt in (shard.optim, shard.replica):
            if opt is not None:
                _sync_groups(zero.param_groups, opt.param_groups)
                opt.step()
        _sync_groups(shard.optim.param_groups, zero.param_groups)

    def _broadcast(self, shard: _Shard) -> list[Handle]:
        handles = []
        for u in shard.units:
            if u.src == shard.rank:
                u.pack()
            handles.append(self.group.broadcast(u.flat, src=u.src, tag=PARAM_TAG))
        return handles

    def _commit(self, shard: _Shard, step: int, stepped: set[int] | None = None) -> None:
        """Apply a voted step: received parameters in, the new layout adopted, counters.

        ``stepped``: global indices of the parameters the step updated (default: those with a gradient).
        """
        neighbour = (shard.rank + 1) % shard.size
        for u in shard.units:
            if u.src == shard.rank:
                continue
            if shard.replica is not None and u.src == neighbour:
                mine = torch.cat([p.detach().reshape(-1) for p in u.params])
                self.stats.replica_drift += int(not torch.equal(mine, u.flat))
            u.unpack()
        if self._new is not None:
            _, lost, known, nbytes = self._new
            self._adopt(shard)
            self.stats.reshards += 1
            self.stats.reshard_bytes += nbytes
            self.known, self.dropped = known, False
            if lost:
                self.stats.lost_params += len(lost)
                self.stats.lost.append((step, lost))
                warnings.warn(f"elastic ZeRO: the optimizer state of {len(lost)} parameter(s) was held only by "
                              f"lost member(s); it is re-initialised at step {step} (e.g. Adam's moments start "
                              "from zero). ZeroRedundancyOptimizer(..., replicate=True) keeps a copy on a ring "
                              "neighbour", RuntimeWarning, stacklevel=4)
        self._new = None
        self.known |= stepped if stepped is not None else {self.index[p] for p in self.params if p.grad is not None}
        self.stats.commits += 1
        self.stats.replica_bytes = _tensor_bytes(shard.replica)

    # --- snapshots -------------------------------------------------------------------
    def _snapshot(self, shard: _Shard) -> Snapshot:
        out: Snapshot = []
        for opt in (shard.optim, shard.replica):
            if opt is not None:
                out += snapshot(opt, [p for grp in opt.param_groups for p in grp["params"]])
        return out

    @staticmethod
    def _restore(shard: _Shard, snap: Snapshot) -> None:
        ElasticShards.restore(snap)

    @staticmethod
    def restore(snap: Snapshot) -> None:
        """Put back the parameters and optimizer state that :func:`snapshot` copied."""
        with torch.no_grad():
            for opt, p, value, st in snap:
                p.copy_(value)
                if st is None:
                    opt.state.pop(p, None)
                else:
                    opt.state[p] = st

    # --- re-sharding -------------------------------------------------------------------
    def held_state(self, replica: bool = False) -> dict[int, dict[str, Any]]:
        """This member's optimizer state (its shard, or with ``replica=True`` its replica), by global index."""
        opt = self.shard.replica if replica else self.shard.optim
        if opt is None or self.dropped:
            return {}
        return {self.index[p]: st for p, st in opt.state.items() if st}

    def reshard(self, qid: int, via: ElasticGroup | ElasticSubgroup | None = None) -> tuple[_Shard, list[int], set[int], int] | None:
        """Gather the held optimizer state over ``via`` (default: the group) and lay out quorum ``qid``.

        ``via`` must span the quorum in its rank order (the overlapped step uses a
        per-quorum subgroup of its own). None if a collective failed: the step is lost.
        """
        g = via if via is not None else self.group
        own, replica = self.held_state(), self.held_state(replica=True)
        held = own
        if self.replicate:
            # Send a replica only where no member holds the primary (its owner is gone): one copy of each
            # state crosses the wire. replicate is the same on every member, so are these collectives.
            mine = torch.zeros(len(self.params), dtype=torch.uint8, device=g.device)
            if own:
                mine[torch.tensor(sorted(own), dtype=torch.long, device=g.device)] = 1
            masks = torch.empty(len(self.params) * g.size, dtype=torch.uint8, device=g.device)
            g.all_gather_into(masks, mine, tag=STATE_TAG).wait()
            if g.error is not None:
                return None
            primary = masks.view(g.size, -1).amax(0)
            held = {**{i: st for i, st in replica.items() if not primary[i]}, **own}
        payload = to_bytes({"state": held, "known": sorted(self.known)}, g.device)
        blobs = all_gather_bytes(g, payload, STATE_TAG)
        if blobs is None:
            return None
        pool: dict[int, dict[str, Any]] = {}
        known: set[int] = set()
        nbytes = 0
        for r, blob in enumerate(blobs):
            d = from_bytes(blob)
            known.update(int(i) for i in d["known"])
            for i, st in d["state"].items():
                pool.setdefault(int(i), st)
            nbytes += blob.numel() if r != g.rank else 0
        shard = self.layout(qid, g.rank, g.size, pool)
        return shard, sorted(known - set(pool)), known, nbytes

    def layout(self, qid: int | None, rank: int, size: int, pool: dict[int, dict[str, Any]]) -> _Shard:
        """The shard of ``rank`` among ``size`` members, its state (and replica's) taken from ``pool``."""
        zero = self.zero
        buckets: list[_Unit | None] | None = None
        if zero._buckets is not None:   # overlapped with DDP: whole gradient buckets per member
            owner, buckets = self._bucket_layout(size)
            units = [u for u in buckets if u is not None]
        else:
            owners = partition_by_size([[p.numel() * p.element_size() for p in g["params"]]
                                        for g in zero.param_groups], size)
            owner = {p: r for g, rs in zip(zero.param_groups, owners) for p, r in zip(g["params"], rs)}
            units = _plain_units(self.params, owner, size)

        def build(r: int) -> torch.optim.Optimizer:
            groups = [dict(g, params=[p for p in g["params"] if owner[p] == r]) for g in zero.param_groups]
            opt = zero._optimizer_class(groups, **zero.defaults)
            for grp in opt.param_groups:
                for p in grp["params"]:
                    st = pool.get(self.index[p])
                    if st:
                        opt.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.shape == p.shape
                                        else v for k, v in st.items()}
            return opt

        replica = build((rank + 1) % size) if self.replicate and size > 1 else None
        return _Shard(qid, rank, size, owner, units, build(rank), replica, buckets)

    def _bucket_layout(self, size: int) -> tuple[dict[torch.Tensor, int], list[_Unit | None]]:
        """Owner of every parameter and one broadcast unit per gradient bucket, for ``size`` members."""
        slots = self.zero._bucket_slots
        sizes = [sum(p.numel() * p.element_size() for _, p in s) for s in slots]
        bucket_owner = assign_bucket_owners(sizes, size)
        owner = {p: bucket_owner[b] for b, s in enumerate(slots) for _, p in s}
        return owner, [_Unit(bucket_owner[b], [p for _, p in s]) if s else None for b, s in enumerate(slots)]

    def _adopt(self, shard: _Shard) -> None:
        zero = self.zero
        self.shard = shard
        zero.rank, zero.world_size = shard.rank, shard.size
        zero._owner, zero._units, zero.optim = shard.owner, shard.units, shard.optim
        zero.state = shard.optim.state  # type: ignore[assignment]

    def load(self, state_dict: dict[str, Any]) -> None:
        """``load_state_dict`` on an elastic group: hold the whole state; the next step re-shards it."""
        zero = self.zero
        saved = state_dict["param_groups"]
        _sync_groups(saved, zero.param_groups)
        ids = [i for g in saved for i in g["params"]]
        pool = {self.index[p]: copy.deepcopy(state_dict["state"][sid])
                for sid, p in zip(ids, self.params) if sid in state_dict["state"]}
        self._adopt(self.layout(None, 0, 1, pool))
        self.known, self.dropped = set(pool), False

    def check_quorum(self, what: str) -> None:
        q = self.group.quorum
        if q is None or self.shard.qid != q.qid:
            raise ShoalError(f"{what} on an elastic group must follow a committed zero.step() in the current "
                             "quorum (shards are laid out per quorum, at its first step)")


def check_elastic_options(group: Any, replicate: Any) -> bool:
    """Validate ``replicate``; True if ``group`` is elastic."""
    if not isinstance(replicate, bool):
        raise ConfigError(f"replicate must be True or False, got {replicate!r}")
    elastic = isinstance(group, ElasticGroup)
    if replicate and not elastic:
        raise ConfigError("replicate=True keeps a copy of a ring neighbour's optimizer state so that an elastic "
                          "run loses none when a member dies; it needs an ElasticGroup (process_group=group)")
    return elastic
