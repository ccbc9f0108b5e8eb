"""ZeroRedundancyOptimizer overlapped with DDP on an :class:`~shoal.comm.elastic.ElasticGroup`.

``shoal.DistributedDataParallel(model, process_group=group, optimizer=zero)``
with an elastic ``group``: each gradient bucket is stepped by its owner as
soon as it is reduced, while backward goes on, and still one vote ends the
whole step::

    forward               DDP: start_step (adopt the quorum, heal newcomers)
    backward, bucket 0    re-shard if the quorum changed (before any bucket is stepped)
    backward, bucket b    owner (and its replica holder): snapshot the bucket's parameters
                          and state, step them; owner broadcasts them into a flat buffer
    zero.step()           wait for every broadcast, vote:
                          commit  -> received parameters copied in, new layout adopted
                          discard -> snapshots restored, gradients cleared: nothing happened

Where the step ends: ``zero.step()`` after backward is the vote and returns
its verdict, as without overlap. A loop that skips it is still safe: the next
``start_step`` (the next DDP forward, also a validation forward, or
``ElasticSampler.next_batch``, through the group's ``before_start_step``
hook), ``wait_for_params()`` or the DDP module's ``state_dict()`` ends the
open step the same way, so a new quorum or a heal never finds a step in
flight; a ``zero.step()`` after such a vote returns that verdict and steps
nothing.

Why a failure anywhere discards the whole step on every member: an owner
updates its bucket in place but keeps a snapshot until the vote; the other
members receive the update into the bucket's flat buffer only, and copy it
into the parameters after a commit. A member votes ``ok`` only once each of
its broadcasts completed, so a commit means every member holds every updated
bucket. A failed gradient reduction, re-shard or broadcast is recorded on the
group (its abort flag makes the others' collectives return at once) and the
vote discards.

Why a subgroup: the callbacks run on the reducer's bucket-done thread while
gradient reductions are issued from backward (or the codec's thread); on one
process group their order would differ between members. The broadcasts and
the re-shard go over an :class:`~shoal.comm.elastic_sub.ElasticSubgroup`
spanning the whole quorum (:func:`~shoal.comm.elastic_sub.whole_quorum`),
rebuilt for each quorum under its store prefix, whose failures are the
parent's and whose process group is abandoned with the parent's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shoal.comm.elastic import ElasticGroup
from shoal.comm.elastic_sub import ElasticSubgroup, whole_quorum
from shoal.comm.group import Handle
from shoal.errors import ConfigError, ShoalError
from shoal.optim.elastic_zero import ElasticShards, Snapshot, _Shard, snapshot
from shoal.optim.zero import PARAM_TAG, _sync_groups

if TYPE_CHECKING:
    from shoal.reducer import GradBucket, Reducer

_NAMES: "weakref.WeakKeyDictionary[ElasticGroup, int]" = weakref.WeakKeyDictionary()


@dataclass
class _Open:
    """The overlapped step in flight: from the first bucket to the vote."""

    shard: _Shard | None                 # the layout it steps (None: the re-shard failed, the step is lost)
    snap: Snapshot = field(default_factory=list)
    handles: list[Handle] = field(default_factory=list)
    stepped: set[int] = field(default_factory=set)   # global indices of the parameters stepped (by anyone)
    done: int = 0                        # bucket callbacks run
    nonfinite: bool = False              # the reducer found the averaged gradients NaN/Inf


def check_attach(group: ElasticGroup, reducer: Reducer) -> None:
    """ConfigError unless ``reducer`` (a DDP's) can drive the overlapped step of a ZeRO on ``group``."""
    if isinstance(group, ElasticSubgroup):
        raise ConfigError("DistributedDataParallel(..., optimizer=zero) needs a whole ElasticGroup, got "
                          f"subgroup {group.name!r}: the parameter broadcasts run on a subgroup of their own")
    if reducer.group is not group:
        raise ConfigError("the optimizer and DistributedDataParallel must use the same ElasticGroup "
                          "(process_group=group on both): gradient buckets are assigned to the quorum's members")


class ElasticOverlap:
    """The overlapped side of an elastic ZeRO (see the module docstring); made by ``zero._attach``."""

    def __init__(self, shards: ElasticShards, reducer: Reducer) -> None:
        group = shards.group
        check_attach(group, reducer)
        n = _NAMES.get(group, 0) + 1
        _NAMES[group] = n
        self.shards, self.group = shards, group
        self.nbuckets = len(reducer.buckets)
        # Broadcasts and re-shard: issued from the bucket-done thread, so on a stream of their own.
        self.bcast = ElasticSubgroup(group, f"zero/overlap/{n}", whole_quorum)
        self._open: _Open | None = None
        # The verdict of the last overlapped step when something other than zero.step() voted it
        # (the next forward, wait_for_params(), a sampler): zero.step() returns it instead of stepping
        # again with the same gradients. Cleared when the next backward opens a step.
        self.unclaimed: bool | None = None
        reducer.on_bucket_reduced = self.on_bucket
        reducer.on_nonfinite = self.on_nonfinite
        group.before_start_step(self._end_before_start)

    @property
    def pending(self) -> bool:
        """Whether a backward stepped buckets that no vote has ended yet."""
        return self._open is not None

    # --- during backward (the bucket-done thread) ---------------------------------------
    def on_bucket(self, bucket: GradBucket) -> None:
        """The reducer's callback: bucket 0 opens the step (re-shard first); each owner steps its bucket."""
        b = bucket.index()
        if b == 0:
            self.unclaimed = None
            self._open = self._begin()
        st = self._open
        if st is None:  # pragma: no cover - bucket 0 always comes first
            raise ShoalError("a gradient bucket finished before bucket 0 opened the step")
        st.done += 1
        shard, zero = st.shard, self.shards.zero
        if shard is None or shard.buckets is None or self.group.error is not None:
            return   # the step is lost: the vote discards it, snapshots undo what was stepped
        unit = shard.buckets[b]
        if unit is not None:
            opt = shard.stepper(unit.src)
            if opt is not None:
                slots = zero._bucket_slots[b]
                grads = bucket.gradients()
                with torch.no_grad():
                    for k, p in slots:
                        if p.grad is None:
                            p.grad = grads[k].clone()
                        elif p.grad.data_ptr() != grads[k].data_ptr():
                            p.grad.copy_(grads[k])
                st.snap += snapshot(opt, [p for _, p in slots])
                _step_subset(opt, zero._bucket_subsets[b])
            if unit.src == shard.rank:
                unit.pack()
            st.handles.append(self.bcast.broadcast(unit.flat, src=unit.src, tag=PARAM_TAG))
            st.stepped |= {self.shards.index[p] for p in unit.params}
        if bucket.is_last():
            _sync_groups(shard.optim.param_groups, zero.param_groups)

    def on_nonfinite(self) -> None:
        """The reducer's verdict (the same on every member, from the same averaged gradients): the
        buckets stepped in this backward must not count. The vote still runs (a failure elsewhere
        still discards); a commit then keeps the layout but none of the step (not a discard)."""
        if self._open is not None:
            self._open.nonfinite = True

    def _begin(self) -> _Open:
        shards, g = self.shards, self.group
        if self._open is not None:
            raise ShoalError("a second backward before the step's vote: with DistributedDataParallel(..., "
                             "optimizer=zero) on an elastic group call zero.step() after each backward")
        q = g.quorum
        if q is None:  # pragma: no cover - the DDP forward started the step
            raise ShoalError("no quorum in backward: the DDP forward starts the elastic step")
        shards._new = None
        if shards.shard.qid != q.qid and g.error is None:
            shards._new = shards.reshard(q.qid, via=self.bcast)
        shard = shards._new[0] if shards._new is not None else shards.shard
        if shard.qid != q.qid:
            return _Open(None)
        for opt in (shard.optim, shard.replica):
            if opt is not None:
                _sync_groups(shards.zero.param_groups, opt.param_groups)
        return _Open(shard)

    # --- the vote (the training thread) -------------------------------------------------------
    def _end_before_start(self) -> None:
        self.end_step()   # the loop skipped zero.step(): the next step starts after this one's verdict

    def claim(self) -> bool | None:
        """For ``zero.step()``: end the open step, or take the verdict another caller already got;
        None when no overlapped backward ran since the last claim."""
        if self._open is not None:
            self.end_step()
        verdict, self.unclaimed = self.unclaimed, None
        return verdict

    def end_step(self) -> bool | None:
        """Wait for the broadcasts, vote, apply or undo; None when no overlapped step is open."""
        st, self._open = self._open, None
        if st is None:
            return None
        g, shards = self.group, self.shards
        commit = False
        try:
            for h in st.handles:
                h.wait()
            if st.done != self.nbuckets and g.error is None:   # pragma: no cover - backward raised mid-way
                g.report_error(ShoalError(f"only {st.done} of {self.nbuckets} gradient buckets were stepped"))
            commit = g.should_commit() and st.shard is not None
        finally:   # on an exception before the verdict too: never keep a half-stepped shard
            if not commit:
                if st.shard is not None:
                    ElasticShards._restore(st.shard, st.snap)
                shards._new = None
        if commit and st.shard is not None and st.nonfinite:
            ElasticShards._restore(st.shard, st.snap)
            for u in st.shard.units:   # received values are the skipped step's: unpacking puts back our own
                if u.src != st.shard.rank:
                    u.pack()
            shards._commit(st.shard, g.step - 1, set())
        elif commit and st.shard is not None:
            shards._commit(st.shard, g.step - 1, st.stepped)
        else:
            shards.stats.discards += 1
            shards.zero.zero_grad(set_to_none=True)
        self.unclaimed = commit
        return commit


def _step_subset(opt: torch.optim.Optimizer, subsets: list[list[torch.Tensor]]) -> None:
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
