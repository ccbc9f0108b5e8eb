"""The shards of a ZeroRedundancyOptimizer and the step that ends with the group's verdict.

One step, on a static group and on an elastic one alike::

    open_step(group)          (the DDP forward) elastic: adopt a quorum, heal; the group opens
                              this optimizer's Journal (registered rollback state)
    open()                    re-shard if the layout is for another membership (collective)
    step + broadcast          each member steps its shard (+ replica), recording in the journal
                              what it changes; owners broadcast their parameters into flat buffers
    end()                     wait for the broadcasts, vote_step(group) (group.commit()):
                                commit  -> received parameters copied in, a new layout adopted
                                discard -> the group restored the journal; gradients cleared

On a static group the layout is made once (:data:`~shoal.optim.zero_layout.STATIC`),
``begin_step`` opens no journal (so nothing is copied) and ``commit`` is always
True: the same code runs, none of its elastic cost does. A static group opens
a journal of its own only where a non-finite verdict may undo buckets stepped
during an overlapped backward.

Re-sharding (elastic): at the first step of every new quorum each member
contributes the optimizer state it holds (its shard; a replica only where no
member holds that shard itself; nothing if it was just healed, its state being
stale or absent), every member receives all of it (one all-gather of
serialised blobs: a transient peak of the whole state per member), and takes
the state of its new shard. State that no member holds (its owner died and no
replica survived) is re-initialised by the optimizer at its next step, with a
warning; ``stats.lost_params`` counts it and ``stats.lost`` says which
parameters at which step.

Replicas (``replicate=True``, elastic): each member also steps its ring
neighbour's shard (rank ``r`` the shard of ``(r + 1) % N``) with an optimizer
of its own, from the same averaged gradients, so it holds that shard's state
too; nothing extra goes over the wire. A step whose recomputed neighbour
parameters differ from the owner's is counted in ``stats.replica_drift``.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Sequence

import torch

from shoal.comm.group import Group, Handle
from shoal.comm.objects import all_gather_bytes, failed, from_bytes, to_bytes
from shoal.errors import ShoalError
from shoal.optim.zero_layout import (PARAM_TAG, STATE_TAG, Journal, Shard, Unit, ZeroStats, assign_bucket_owners,
                                     membership_id, nbytes, partition_by_size, plain_units, sync_groups)
from shoal.steps import vote_step


@dataclass
class Resharded:
    """A layout for a new membership, adopted if its step commits."""

    shard: Shard
    lost: list[int]      # global indices whose state no member held
    known: set[int]      # global indices that had state somewhere
    nbytes: int          # serialised state received from peers


def _tensor_bytes(optim: torch.optim.Optimizer | None) -> int:
    if optim is None:
        return 0
    return sum(v.numel() * v.element_size() for st in optim.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _nothing() -> None:
    return None


def _ignore(_: Any) -> None:
    return None


class Shards:
    """Who owns what in the current membership, this member's optimizers, and the step's verdict.

    Args:
        param_groups: the ZeroRedundancyOptimizer's parameter groups (the live list).
        optimizer_class, defaults: what to build over each shard.
        group: the group the shards span (static or elastic).
        replicate: also keep the ring neighbour's shard (elastic groups).

    Example::

        shards = Shards(zero.param_groups, torch.optim.Adam, {"lr": 1e-3}, group, replicate=False)
        shard = shards.open(group)
    """

    def __init__(self, param_groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                 defaults: dict[str, Any], group: Group, replicate: bool) -> None:
        self.param_groups, self.group, self.replicate = param_groups, group, replicate
        self.optimizer_class, self.defaults = optimizer_class, defaults
        self.stats = ZeroStats()
        self.params: list[torch.Tensor] = []
        self.index: dict[torch.Tensor, int] = {}
        self._reindex()
        self.known: set[int] = set()   # parameters that have optimizer state (committed)
        self.dropped = False           # healed: the state held here is stale, contribute none
        self.slots: list[list[tuple[int, torch.Tensor]]] | None = None   # per gradient bucket, once attached
        self.subsets: list[list[list[torch.Tensor]]] = []                 # per bucket, per parameter group
        self.bucket_ids: list[set[int]] = []                             # per bucket: global indices
        self.journal: Journal | None = None
        self.pending: Resharded | None = None
        self.shard = self.layout(membership_id(group), group.rank, group.size, {})
        name = group.unique_name("zero")
        group.register_state(f"{name}/hparams", self._hparams, self._healed)
        group.register_state(f"{name}/step", _nothing, self._rollback, rollback=True, heal_load=_ignore,
                             snapshot=self._open_journal)

    def _reindex(self) -> None:
        self.params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        self.index = {p: i for i, p in enumerate(self.params)}

    # --- the group's registered state -------------------------------------------------
    def _hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _healed(self, hparams: list[dict[str, Any]]) -> None:
        """This member was healed (new, restarted or behind): hyper-parameters from a peer, state dropped."""
        sync_groups(hparams, self.param_groups)
        self.dropped, self.known = True, set()
        self.shard.qid = None

    def _open_journal(self) -> Journal:
        """The group's per-step rollback snapshot: empty, filled by the step as it changes things."""
        self.journal = Journal()
        return self.journal

    @staticmethod
    def _rollback(journal: Journal) -> None:
        journal.restore()

    # --- layouts -------------------------------------------------------------------------
    def _assign(self, size: int, bucket_owner: list[int] | None = None
                ) -> tuple[dict[torch.Tensor, int], list[Unit], list[Unit | None] | None, list[int] | None]:
        """Owner of every parameter and the broadcast units among ``size`` members."""
        if self.slots is None:
            owners = partition_by_size([[nbytes(p) for p in g["params"]] for g in self.param_groups], size)
            owner = {p: r for g, rs in zip(self.param_groups, owners) for p, r in zip(g["params"], rs)}
            return owner, plain_units(self.params, owner, size), None, None
        if bucket_owner is None:   # whole gradient buckets per member, largest first
            bucket_owner = assign_bucket_owners([sum(nbytes(p) for _, p in s) for s in self.slots], size)
        owner = {p: bucket_owner[b] for b, s in enumerate(self.slots) for _, p in s}
        buckets = [Unit(bucket_owner[b], [p for _, p in s]) if s else None for b, s in enumerate(self.slots)]
        return owner, [u for u in buckets if u is not None], buckets, bucket_owner

    def _build(self, owner: dict[torch.Tensor, int], r: int, pool: dict[int, dict[str, Any]]
               ) -> torch.optim.Optimizer:
        groups = [dict(g, params=[p for p in g["params"] if owner[p] == r]) for g in self.param_groups]
        opt = self.optimizer_class(groups, **self.defaults)
        for grp in opt.param_groups:
            for p in grp["params"]:
                st = pool.get(self.index[p])
                if st:
                    opt.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.shape == p.shape
                                    else v for k, v in st.items()}
        return opt

    def layout(self, qid: int | None, rank: int, size: int, pool: dict[int, dict[str, Any]]) -> Shard:
        """The shard of ``rank`` among ``size`` members, its state (and its replica's) taken from ``pool``."""
        owner, units, buckets, bucket_owner = self._assign(size)
        replica = self._build(owner, (rank + 1) % size, pool) if self.replicate and size > 1 else None
        return Shard(qid, rank, size, owner, units, self._build(owner, rank, pool), replica, buckets, bucket_owner)

    def attach(self, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
        """Lay the shards out by gradient bucket (overlapped with DDP); no state is held yet."""
        self._set_buckets(buckets)
        s = self.shard
        self.shard = self.layout(s.qid, s.rank, s.size, {})

    def _set_buckets(self, buckets: Sequence[Sequence[torch.Tensor]]) -> None:
        """Per gradient bucket: the slots of the parameters managed here, per-group subsets, indices."""
        managed = set(self.params)
        self.slots = [[(k, p) for k, p in enumerate(members) if p in managed] for members in buckets]
        self.subsets, self.bucket_ids = [], []
        for slots in self.slots:
            mine = {p for _, p in slots}
            self.subsets.append([[p for p in g["params"] if p in mine] for g in self.param_groups])
            self.bucket_ids.append({self.index[p] for p in mine})

    def add_group(self, buckets: Sequence[Sequence[torch.Tensor]] | None) -> None:
        """The optimizer gained its last parameter group: earlier parameters keep their owner (static)."""
        self._reindex()
        s = self.shard
        if buckets is not None:
            self._set_buckets(buckets)
        s.owner, s.units, s.buckets, s.bucket_owner = self._assign(s.size, s.bucket_owner)
        last = self.param_groups[-1]
        s.optim.add_param_group(dict(last, params=[p for p in last["params"] if s.owner[p] == s.rank]))
        sync_groups(s.optim.param_groups[-1:], self.param_groups[-1:])

    # --- the step -------------------------------------------------------------------------
    def open(self, via: Group) -> Shard | None:
        """The layout of the current membership, re-sharded over ``via`` if stale (collective then),
        with the hyper-parameters copied in; None if the step is already lost."""
        qid = membership_id(self.group)
        if qid is None:  # pragma: no cover - begin_step adopts a quorum
            raise ShoalError("no quorum in this step: the DDP forward (or group.begin_step()) begins it")
        self.pending = None
        shard = self.shard
        if shard.qid != qid:
            if failed(self.group):
                return None
            self.pending = self.reshard(qid, via)
            if self.pending is None:
                return None
            shard = self.pending.shard
        for opt in shard.optimizers():
            sync_groups(self.param_groups, opt.param_groups)
        return shard

    def record(self, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        """Keep what ``opt`` is about to change in ``params``, if a journal is open (none: no copy)."""
        if self.journal is not None:
            self.journal.record(opt, params)

    def step(self, shard: Shard, closure: Callable[[], float] | None, kwargs: dict[str, Any]) -> Any:
        """Step the whole shard (and replica) at once: the plain, non-overlapped step."""
        if self.journal is not None:
            for opt in shard.optimizers():
                self.journal.record(opt, [p for grp in opt.param_groups for p in grp["params"]])
        loss = shard.optim.step(closure, **kwargs) if closure is not None else shard.optim.step(**kwargs)
        if shard.replica is not None:
            shard.replica.step()
        sync_groups(shard.optim.param_groups, self.param_groups)
        return loss

    def broadcast(self, shard: Shard, via: Group) -> list[Handle]:
        handles = []
        for u in shard.units:
            if u.src == shard.rank:
                u.pack()
            handles.append(via.broadcast(u.flat, src=u.src, tag=PARAM_TAG))
        return handles

    def end(self, shard: Shard | None, handles: Sequence[Handle], stepped: set[int] | None,
            nonfinite: bool = False) -> bool:
        """Wait for ``handles``, take the group's verdict and apply it (see the module docstring).

        ``stepped``: global indices the step updated (None: those with a gradient). ``nonfinite``:
        the step must leave no trace (undone from the journal) though the group commits.
        """
        commit = False
        try:
            for h in handles:
                h.wait()
            commit = vote_step(self.group) and shard is not None
        finally:   # on an exception before the verdict too: never keep a half-stepped shard
            if not commit and self.journal is not None:
                self.journal.restore()   # (after a discard the group restored it already: the same values)
        if commit and shard is not None:
            if nonfinite and self.journal is not None:
                self.journal.restore()
            self._apply(shard, set() if nonfinite else stepped, received=not nonfinite)
        else:
            self.pending = None
            self.stats.discards += 1
            for p in self.params:
                p.grad = None
        if self.journal is not None:
            self.journal.clear()   # the group may hold it until the next step: keep no copies that long
            self.journal = None
        return commit

    def _apply(self, shard: Shard, stepped: set[int] | None, received: bool) -> None:
        """A committed step: received parameters in, the new layout adopted, counters."""
        if received:
            neighbour = (shard.rank + 1) % shard.size
            for u in shard.units:
                if u.src == shard.rank:
                    continue
                if shard.replica is not None and u.src == neighbour:
                    mine = torch.cat([p.detach().reshape(-1) for p in u.params])
                    self.stats.replica_drift += int(not torch.equal(mine, u.flat))
                u.unpack()
        new, self.pending = self.pending, None
        if new is not None:
            self._adopt_new(new)
        if len(self.known) < len(self.params):   # complete after the first full step: no work per step then
            self.known |= stepped if stepped is not None else {self.index[p] for p in self.params
                                                                if p.grad is not None}
        self.stats.commits += 1
        self.stats.replica_bytes = _tensor_bytes(shard.replica)

    def _adopt_new(self, new: Resharded) -> None:
        self.shard = new.shard
        self.stats.reshards += 1
        self.stats.reshard_bytes += new.nbytes
        self.known, self.dropped = new.known, False
        if new.lost:
            step = self.group.step - 1
            self.stats.lost_params += len(new.lost)
            self.stats.lost.append((step, new.lost))
            warnings.warn(f"elastic ZeRO: the optimizer state of {len(new.lost)} parameter(s) was held only by "
                          f"lost member(s); it is re-initialised at step {step} (e.g. Adam's moments start "
                          "from zero). ZeroRedundancyOptimizer(..., replicate=True) keeps a copy on a ring "
                          "neighbour", RuntimeWarning, stacklevel=5)

    # --- re-sharding -------------------------------------------------------------------------
    def held_state(self, replica: bool = False) -> dict[int, dict[str, Any]]:
        """This member's optimizer state (its shard, or with ``replica=True`` its replica), by global index."""
        opt = self.shard.replica if replica else self.shard.optim
        if opt is None or self.dropped:
            return {}
        return {self.index[p]: st for p, st in opt.state.items() if st}

    def reshard(self, qid: int, via: Group) -> Resharded | None:
        """Gather the held optimizer state over ``via`` and lay out membership ``qid``.

        ``via`` must span the membership in its rank order (the overlapped step uses a
        subgroup of its own). None if a collective failed: the step is lost.
        """
        g = via
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
            if failed(g):
                return None
            primary = masks.view(g.size, -1).amax(0)
            held = {**{i: st for i, st in replica.items() if not primary[i]}, **own}
        payload = to_bytes({"state": held, "known": sorted(self.known)}, g.device)
        blobs = all_gather_bytes(g, payload, STATE_TAG)
        if blobs is None:
            return None
        pool: dict[int, dict[str, Any]] = {}
        known: set[int] = set()
        received = 0
        for r, blob in enumerate(blobs):
            d = from_bytes(blob)
            known.update(int(i) for i in d["known"])
            for i, st in d["state"].items():
                pool.setdefault(int(i), st)
            received += blob.numel() if r != g.rank else 0
        shard = self.layout(qid, g.rank, g.size, pool)
        return Resharded(shard, sorted(known - set(pool)), known, received)

    def load_whole(self, state_dict: dict[str, Any]) -> None:
        """Hold a whole-optimizer state in a layout no step uses: the next step re-shards it (elastic)."""
        saved = state_dict["param_groups"]
        sync_groups(saved, self.param_groups)
        ids = [i for g in saved for i in g["params"]]
        pool = {self.index[p]: copy.deepcopy(state_dict["state"][sid])
                for sid, p in zip(ids, self.params) if sid in state_dict["state"]}
        self.shard = self.layout(None, 0, 1, pool)
        self.known, self.dropped = set(pool), False

    def check_current(self, what: str) -> None:
        """ShoalError unless the layout is the current membership's (always, on a static group)."""
        qid = membership_id(self.group)
        if qid is None or self.shard.qid != qid:
            raise ShoalError(f"{what} on an elastic group must follow a committed zero.step() in the current "
                             "quorum (shards are laid out per quorum, at its first step)")
