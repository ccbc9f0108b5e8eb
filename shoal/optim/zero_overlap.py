"""ZeroRedundancyOptimizer overlapped with DDP: each gradient bucket stepped as soon as it is reduced.

``shoal.DistributedDataParallel(model, process_group=group, optimizer=zero)``
attaches :class:`Overlap` to the DDP's reducer through its extension point
(:class:`shoal.reducer.BucketStepper`). Whole gradient buckets are the
shards; the step, on a static group and an elastic one alike::

    forward               DDP: open_step(group) (elastic: adopt the quorum, heal newcomers)
    backward, bucket 0    open the step: re-shard if the membership changed (elastic)
    backward, bucket b    owner (and its replica holder): record the bucket's parameters and state
                          in the journal (if one is open), step them; owner broadcasts them into
                          the bucket's flat buffer
    end of the step       wait for every broadcast, vote_step(group) (shoal.steps):
                          commit  -> received parameters copied in, new layout adopted
                          discard -> the journal restored, gradients cleared: nothing happened

Where the step ends: on an elastic group ``zero.step()`` after backward ends it
(the verdict is then ``zero.last_step_committed``; ``step()`` returns the loss or None, as torch's does). A static group's verdict is known in advance
(commit), so ``zero.step()`` leaves it open and the broadcasts overlap the
loop's work until the next forward. Either way, the next step's begin (a DDP
forward, also a validation forward, ``ElasticSampler.next_batch``, through the
group's ``before_begin_step`` hook), the module's forward pre-hook,
``wait_for_params()`` or the DDP module's ``state_dict()`` ends an open step
first; a ``zero.step()`` after that steps nothing (its verdict in ``last_step_committed``).

Non-finite gradients (the reducer's verdict, the same on every member): the
step's buckets must leave no trace: the journal is restored and the received
values stay out, though the group commits (a failure elsewhere still
discards). On a static group a journal is kept for this only under
``skip_nonfinite`` (the default): one copy of the member's buckets per step.

Why a subgroup for the broadcasts (and the re-shard): the callbacks run on
the reducer's bucket-done thread while gradient reductions are issued from
backward (or the codec's thread); on one process group their order would
differ between members. ``group.subgroup(whole_quorum, ...)`` spans the whole
membership: on an elastic group it is rebuilt for every quorum and fails with
its parent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shoal.comm.group import Group, Handle
from shoal.comm.objects import failed
from shoal.comm.rules import whole_quorum
from shoal.errors import ShoalError
from shoal.optim.zero_layout import PARAM_TAG, Journal, Shard, step_subset, sync_groups
from shoal.optim.zero_shards import Shards
from shoal.reducer import GradBucket, Reducer


@dataclass
class _Open:
    """The overlapped step in flight: from the first bucket to its end."""

    shard: Shard | None                  # the layout it steps (None: the re-shard failed, the step is lost)
    handles: list[Handle] = field(default_factory=list)
    stepped: set[int] = field(default_factory=set)   # global indices of the parameters stepped (by anyone)
    done: int = 0                        # bucket callbacks run
    nonfinite: bool = False              # the reducer found the averaged gradients NaN/Inf


class Overlap:
    """The overlapped step of a ZeRO (see the module docstring); made by ``zero.attach_to_reducer``."""

    def __init__(self, shards: Shards, group: Group, reducer: Reducer, module: nn.Module) -> None:
        self.shards, self.group = shards, group
        self.nbuckets = len(reducer.buckets)
        # Broadcasts and re-shard: issued from the bucket-done thread, so on a stream of their own.
        bcast = group.subgroup(whole_quorum, "zero/overlap")
        if not isinstance(bcast, Group):  # pragma: no cover - whole_quorum spans every member
            raise ShoalError("the parameter broadcast subgroup left this member out")
        self.bcast = bcast
        self.undoable = reducer.skip_nonfinite   # a non-finite verdict may undo the buckets stepped
        self._open: _Open | None = None
        self._ran = False                  # an overlapped backward ran since the last claim
        self.verdict: bool | None = None   # of the last step that ended
        reducer.on_bucket_reduced = self.on_bucket
        reducer.on_nonfinite = self.on_nonfinite
        group.before_begin_step(self._end_before_begin)
        # Hooks return None: a forward pre-hook's return value would replace the forward's input.
        module.register_forward_pre_hook(lambda _m, _args: self._end_before_begin())
        module.register_state_dict_pre_hook(lambda *_: self._end_before_begin())

    @property
    def pending(self) -> bool:
        """Whether a backward stepped buckets whose step has not ended yet."""
        return self._open is not None

    # --- during backward (the bucket-done thread) ---------------------------------------
    def on_bucket(self, bucket: GradBucket) -> None:
        """The reducer's callback: bucket 0 opens the step (re-shard first); each owner steps its bucket."""
        b = bucket.index()
        if b == 0:
            self._open = self._begin()
        st = self._open
        if st is None:  # pragma: no cover - bucket 0 always comes first
            raise ShoalError("a gradient bucket finished before bucket 0 opened the step")
        st.done += 1
        shard, shards = st.shard, self.shards
        if shard is None or shard.buckets is None or failed(self.group):
            return   # the step is lost: the verdict discards it, the journal undoes what was stepped
        unit = shard.buckets[b]
        if unit is not None:
            opt = shard.stepper(unit.src)
            if opt is not None:
                slots = shards.slots[b] if shards.slots is not None else []
                grads = bucket.gradients()
                with torch.no_grad():
                    for k, p in slots:
                        if p.grad is None:
                            p.grad = grads[k].clone()
                        elif p.grad.data_ptr() != grads[k].data_ptr():
                            p.grad.copy_(grads[k])
                shards.record(opt, [p for _, p in slots])
                step_subset(opt, shards.subsets[b])
            if unit.src == shard.rank:
                unit.pack()
            st.handles.append(self.bcast.broadcast(unit.flat, src=unit.src, tag=PARAM_TAG))
            st.stepped |= shards.bucket_ids[b]
        if bucket.is_last():
            sync_groups(shard.optim.param_groups, shards.param_groups)

    def on_nonfinite(self) -> None:
        """The reducer's verdict (the same on every member, from the same averaged gradients): the
        buckets stepped in this backward must not count."""
        if self._open is not None:
            self._open.nonfinite = True

    def _begin(self) -> _Open:
        if self._open is not None:
            raise ShoalError("a second backward before the step ended: with DistributedDataParallel(..., "
                             "optimizer=zero) call zero.step() after each backward")
        self._ran, self.verdict = True, None
        shard = self.shards.open(self.bcast)
        if shard is not None and self.undoable and self.shards.journal is None:
            self.shards.journal = Journal()   # a static group keeps none: only for a non-finite undo
        return _Open(shard)

    # --- the end (the training thread) -------------------------------------------------------
    def _end_before_begin(self) -> None:
        self.end_step()   # the loop skipped zero.step(): the next step begins after this one's verdict

    def claim(self, end: bool) -> bool | None:
        """For ``zero.step()``: None when no overlapped backward ran since the last claim; else the
        step's verdict, ending it first if ``end`` (a static group's is True before it ends)."""
        ran, self._ran = self._ran, False
        if not ran:
            return None
        if not end:
            return True
        self.end_step()
        return self.verdict

    def end_step(self) -> bool | None:
        """Wait for the broadcasts, take the verdict, apply or undo; None when no step is open."""
        st, self._open = self._open, None
        if st is None:
            return None
        if st.done != self.nbuckets and not failed(self.group):   # pragma: no cover - backward raised mid-way
            self.group.report_error(ShoalError(f"only {st.done} of {self.nbuckets} gradient buckets were stepped"))
        self.verdict = self.shards.end(st.shard, st.handles, st.stepped, st.nonfinite)
        return self.verdict
