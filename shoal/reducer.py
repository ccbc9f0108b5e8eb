"""Gradient buckets reduced during backward, overlapping communication.

Parameters are grouped into buckets in reverse registration order (gradients
of the last layers are produced first) with a size cap, one dtype and device
per bucket. Each bucket owns a flat buffer. When a synchronised backward
starts (its first gradient hook), every parameter without a gradient gets
``.grad`` = its view of the bucket buffer (zeroed once per bucket), so
autograd accumulates gradients straight into the buckets: no copy per
parameter, and the per-parameter hook only counts. When a bucket's last
gradient arrives, a gradient that is some other tensor (kept from an earlier
step, accumulated under ``no_sync()``, replaced by ``create_graph``) is copied
into its slice in one batched copy, the bucket is divided by the world size
once (exact all-reduce only: a codec or comm hook gets the raw local sum) and
its reduction is launched at once, while backward goes on. Buckets launch
strictly in index order on every rank, so collectives pair up across ranks
even if gradients arrive in another order. At the end of backward (an
autograd engine callback) whatever is still in flight is waited for and the
averaged gradients are in ``.grad``. With ``gradient_as_bucket_view=False``
the bucket then hands its buffer over to those ``.grad``, so ``.grad`` never
aliases a buffer the reducer writes again (torch's semantics) without a copy;
at the next backward it takes the buffer back when reference counts show that
nothing outside the bucket sees it any more (``zero_grad()`` set those
``.grad`` to None and nobody kept them), else it takes a fresh one (on a CPU,
a fresh buffer per step is page-faulted in at every step). Gradients that
were other tensors get the average copied into them (one batched copy per
bucket).

Non-finite gradients (SPEC G5): once every bucket is reduced, one fused check
of the flat bucket buffers (a few tensors) decides whether the averaged
gradient holds a NaN/Inf. Every rank holds the same averaged buffers (the
all-reduce's result; every codec turns a NaN/Inf sent by any rank into a
non-finite mean on every rank, docs/codecs.md), so every rank reaches the same
verdict without another message. On a non-finite verdict the averaged
gradients are still written to ``.grad`` (identical on every rank, so a
``torch.amp.GradScaler`` sees the Inf, skips and lowers its scale), and
:mod:`shoal.nonfinite` drops them just before any optimizer holding these
parameters steps (torch optimizers skip parameters without a gradient, so
``opt.step()`` changes nothing, Adam's step counts included). A
RuntimeWarning is issued and ``nonfinite_skips`` counted. The verdict is read
on the host once, after the last collective of the step.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from shoal.buckets import GradBucket, _Bucket, assign_buckets
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.group import Group, Handle
from shoal.comm.streams import SideStream
from shoal.errors import ConfigError, ShoalError
from shoal.nonfinite import StepVerdict

if TYPE_CHECKING:
    from shoal.codecs.base import Codec

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]

GRAD_TAG = "ddp/grad"


@runtime_checkable
class BucketStepper(Protocol):
    """What ``DistributedDataParallel(..., optimizer=...)`` accepts: an optimizer that steps during backward.

    ``attach_to_reducer(reducer, module)`` is called once, when the DDP is
    built; the optimizer hooks itself in through the reducer's extension
    points (``on_bucket_reduced``, ``on_nonfinite``) and the module's hooks.
    :class:`shoal.ZeroRedundancyOptimizer` is one; the reducer knows no
    optimizer.

    Example::

        class Printer:
            def attach_to_reducer(self, reducer, module):
                reducer.on_bucket_reduced = lambda bucket: print(bucket.index())
    """

    def attach_to_reducer(self, reducer: "Reducer", module: nn.Module) -> None: ...


class Reducer:
    """Owns buckets and hooks for one wrapped module (used by DistributedDataParallel).

    Args:
        named_params: ``(name, parameter)`` pairs that require grad, registration order.
        group: the metered group gradients are averaged over.
        bucket_cap_bytes: bucket size cap.
        find_unused_parameters: look for parameters outside the forward's graph.
        gradient_as_bucket_view: leave ``.grad`` as views into the bucket buffers.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], group: Group,
                 bucket_cap_bytes: int, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        layout = assign_buckets(self.params, bucket_cap_bytes)
        self.buckets = [
            _Bucket(i, members, self.params, self.names, i == len(layout) - 1)
            for i, members in enumerate(layout)
        ]
        self._where: list[tuple[_Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for b in self.buckets:
            for slot, i in enumerate(b.members):
                self._where[i] = (b, slot)
        self.comm_hook: CommHook | None = None
        self.hook_state: Any = None
        self.codec: Codec | None = None
        self._comm_thread: ThreadPoolExecutor | None = None
        self.on_step_done: Callable[[], None] | None = None
        self.on_bucket_reduced: Callable[[GradBucket], None] | None = None
        # Called (on the training thread, before .grad is cleared) when a backward's averaged
        # gradients are not finite: ZeroRedundancyOptimizer undoes the buckets it stepped.
        self.on_nonfinite: Callable[[], None] | None = None
        self.skip_nonfinite = True
        self.verdict = StepVerdict(self.params)  # honoured at the next optimizer step
        self._done_thread: ThreadPoolExecutor | None = None
        self._done_tasks: list[ThreadFuture] = []
        # CUDA: the codec and bucket-done threads each run on a stream of their own, ordered
        # against backward's stream by events both ways (no-ops on the CPU).
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
        self._comm_side = SideStream(device)
        self._done_side = SideStream(device)
        self._armed = False        # a synchronised backward is expected
        self._started = False      # its first hook has fired
        self._unused: list[int] = []
        self._ready = [False] * len(self.params)
        self._used = bytearray(len(self.params))  # plain Python: the hook does no tensor op
        self._next_bucket = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # --- per step -------------------------------------------------------
    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm for the backward of a synchronised forward; ``outputs`` is searched
        for the graph when ``find_unused_parameters`` is on."""
        self._armed = True
        self._started = False
        self.verdict.expire()
        self._ready = [False] * len(self.params)
        self._next_bucket = 0
        self._done_tasks = []
        for b in self.buckets:
            b.pending = len(b.members)
            b.work = None
            b.comm_done = None
            b.attached, b.stray = [], []
        self._unused = []
        if self.find_unused:
            reached = _params_in_graph(outputs)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]

    def disarm(self) -> None:
        """The next backward only accumulates (``no_sync``)."""
        self._armed = False

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        # The hot path, once per parameter per backward: plain Python bookkeeping in one
        # call (autograd has already added the gradient into the bucket view).
        used, bucket = self._used, self._where[i][0]

        def hook(_param: torch.Tensor) -> None:
            used[i] = 1
            if not self._armed:
                return
            if not self._started:
                self._start_backward()
            ready = self._ready
            if ready[i]:
                raise ShoalError(
                    f"parameter {self.names[i]!r} received a gradient twice in one backward; "
                    "shoal's DDP supports one backward per forward (use no_sync() to accumulate)"
                )
            ready[i] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready_buckets()

        return hook

    def _start_backward(self) -> None:
        """The first gradient hook of a synchronised backward."""
        self._started = True
        self._attach_views()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for j in self._unused:  # they will get no hook: do not let them block
            self._mark_ready(j)

    def _attach_views(self) -> None:
        """At the start of a synchronised backward: every parameter whose ``.grad`` is None gets
        its bucket view as ``.grad`` (zeroed once per bucket), so autograd accumulates in place.

        Done at the first gradient hook, not at the forward, so a forward that no backward
        follows leaves ``.grad`` as it was. The parameter whose hook this is already has its
        gradient: it is copied in when its bucket launches, like any other tensor."""
        for b in self.buckets:
            fresh = b.handed_off and not b.take_back()
            if fresh:
                b.fresh_buffer()
            none = [k for k, p in enumerate(b.params) if p.grad is None]
            b.attached = none
            if not none:
                continue
            if not fresh:
                if len(none) == len(b.params):
                    b.buffer.zero_()
                else:
                    torch._foreach_zero_([b.views[k] for k in none])
            for k in none:
                b.params[k].grad = b.views[k]

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = True
        bucket = self._where[i][0]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _gather(self, b: _Bucket) -> None:
        """Bring ``b``'s gradients that are not its views into the buffer (one batched copy),
        then divide by the world size once, as torch DDP does per gradient (the same
        per-element division, so the same bits). A codec or comm hook averages itself."""
        dst, src, zero, stray = [], [], [], []
        for k, (p, view) in enumerate(zip(b.params, b.views)):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:  # cleared during backward: contributes nothing
                zero.append(view)
            elif grad.is_sparse:
                raise ShoalError(f"parameter {b.names[k]!r} has a sparse gradient; shoal's DDP needs dense gradients")
            else:
                stray.append(k)
                dst.append(view)
                src.append(grad)
        b.stray = stray
        with torch.no_grad():
            if zero:
                torch._foreach_zero_(zero)
            if dst:
                torch._foreach_copy_(dst, src)
            if self.group.size > 1:
                self._weigh(b)

    def _weigh(self, b: _Bucket) -> None:
        """Pre-divide the bucket by the contributors (a joiner still catching up contributes zeros)."""
        mine, contributors = self.group.contribution()   # a joiner catching up counts zero (membership.catchup)
        if contributors != self.group.size and (self.codec is not None or self.comm_hook is not None):
            raise ConfigError("a joiner is catching up in the background (SHOAL_HEAL=background), which shoal's "
                              "DDP supports without a codec or comm hook only: their means count every member; "
                              "run with SHOAL_HEAL=blocking (the default) instead")
        if self.codec is not None or self.comm_hook is not None:
            return
        if not mine:
            b.buffer.zero_()
        elif contributors > 1:
            b.buffer.div_(contributors)

    def _launch_ready_buckets(self) -> None:
        # In index order only: a collective must be issued in the same order on every rank.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            b = self.buckets[self._next_bucket]
            self._gather(b)
            if self.codec is not None:
                b.work = self._run_codec(b, self.codec)
            elif self.comm_hook is None:
                b.work = self.group.all_reduce(b.buffer, op="sum", tag=GRAD_TAG)
            else:
                b.work = self.comm_hook(self.hook_state, b.grad_bucket())
                if not isinstance(b.work, (torch.futures.Future, torch._C.Future)):
                    raise ShoalError(
                        f"communication hook returned {type(b.work).__name__}; it must return a "
                        "torch.futures.Future whose value is the bucket's reduced tensor"
                    )
            if self.on_bucket_reduced is not None:
                self._done_tasks.append(self._submit_bucket_done(b, self.on_bucket_reduced))
            self._next_bucket += 1

    def _submit_bucket_done(self, b: _Bucket, callback: Callable[[GradBucket], None]) -> ThreadFuture:
        """Run ``callback`` once ``b`` is reduced: the ``on_bucket_reduced`` extension point.

        ``on_bucket_reduced(bucket)`` is called once per bucket of every
        synchronised backward, in bucket index order, on one dedicated thread
        ("shoal-bucket-done"), as soon as the bucket's reduction is complete:
        ``bucket.gradients()`` then hold the averaged gradients (views into
        ``bucket.buffer()``), while backward of earlier layers may still run.
        The end of backward waits for every callback (re-raising its error)
        before writing ``.grad``, so ``loss.backward()`` returns only when all
        have run. A callback must not touch tensors autograd still needs, and
        a collective it issues must go on a process group other than the
        reducer's: the reducer's collectives are issued from another thread,
        so their interleaving with the callback's would differ between ranks.
        ZeroRedundancyOptimizer uses it to step each bucket's owner at once.

        Example::

            ddp.reducer.on_bucket_reduced = lambda bucket: print(bucket.index())
        """
        if self._done_thread is None:
            self._done_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-bucket-done")

        def done() -> None:
            result = self._wait(b)
            if result is not b.buffer:
                b.buffer.copy_(result.view(-1))
            callback(b.grad_bucket())

        return self._done_thread.submit(self._done_side.run, self._done_side.ready(), done)

    def set_codec(self, codec: Codec) -> None:
        """Average buckets through ``codec`` on a dedicated communication thread.

        One thread, fed in bucket order, keeps every rank's collectives in the
        same order while the codec's rounds overlap the rest of backward.
        """
        self.codec = codec

    def _run_codec(self, b: _Bucket, codec: Codec) -> ThreadFuture:
        if self._comm_thread is None:
            self._comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-comm")
        group, tag = self.group, GRAD_TAG  # the codec appends its own name: ddp/grad/powersgd/p

        def reduce() -> None:
            codec.mean(b.views, b.names, group, tag)

        def on_side(ready: Any) -> torch.Tensor:
            _, b.comm_done = self._comm_side.run(ready, reduce)
            return b.buffer

        return self._comm_thread.submit(on_side, self._comm_side.ready())

    def _finalize(self) -> None:
        """End of backward: wait for in-flight reductions, write ``.grad``."""
        self._armed = False
        if self._next_bucket < len(self.buckets):
            missing = [self.names[i] for i, r in enumerate(self._ready) if not r]
            raise ShoalError(
                f"{len(missing)} parameter(s) got no gradient in this backward, e.g. {missing[:5]}; "
                "their gradients cannot be averaged. If the forward does not use every parameter, "
                "pass find_unused_parameters=True; if they should not train, set requires_grad=False"
            )
        tasks, self._done_tasks = self._done_tasks, []
        for task in tasks:  # on_bucket_reduced callbacks; each has waited for its bucket
            _, done = task.result()
            self._done_side.join(done)   # CUDA: what the callback wrote, before backward's stream reads it
        for b in self.buckets:
            result = self._wait(b)
            if result is not b.buffer:
                b.buffer.copy_(result.view(-1))
        # Only after every bucket is done: no collective may race the comm thread's.
        globally_used = self._global_usage() if self.find_unused else None
        deferred = self.skip_nonfinite and self.on_nonfinite is None and self.group.error is None
        bad = self.skip_nonfinite and not deferred and self._nonfinite()
        if bad:
            self._skip_step()
        for b in self.buckets:
            self._write_grads(b, globally_used)
        if deferred:   # read when an optimizer needs it, or not at all (shoal.nonfinite, "read only when needed")
            self.verdict.defer(nonfinite_flag([b.buffer for b in self.buckets]), self._skip_step,
                               void=lambda: self.group.error is not None)
        elif self.skip_nonfinite:
            self.verdict.set(bad)
        self._used[:] = bytes(len(self._used))  # in place: the hooks hold this bytearray
        if self.on_step_done is not None:
            self.on_step_done()

    @property
    def last_nonfinite(self) -> bool:
        """The verdict of the last synchronised backward, until the optimizer step consumes a
        finite one (reads a deferred verdict now: one host read)."""
        return bool(self.verdict.resolve())

    def _nonfinite(self) -> bool:
        """Whether the averaged gradients hold a NaN/Inf: one fused check, one host read,
        after the step's last collective. Same buffers on every rank, so the same verdict."""
        if self.group.error is not None:
            return False  # an elastic step that already failed: its vote discards it anyway
        return read_flag(nonfinite_flag([b.buffer for b in self.buckets]))

    def _skip_step(self) -> None:
        """Every rank skips this step: the next optimizer step over these parameters drops their
        gradients first (:mod:`shoal.nonfinite`), so it changes nothing."""
        if self.on_nonfinite is not None:
            self.on_nonfinite()
        self.group.meter.add_nonfinite_skip(GRAD_TAG)
        warnings.warn("shoal DDP: the averaged gradients hold NaN/Inf (some rank's gradients are not finite); "
                      "every rank skips this step: the optimizer step drops .grad first, so it changes "
                      "nothing (a GradScaler sees the Inf and skips itself). "
                      "comm_stats().total.nonfinite_skips counts such steps", RuntimeWarning, stacklevel=2)

    def _wait(self, b: _Bucket) -> torch.Tensor:
        if isinstance(b.work, Handle):
            return b.work.wait()
        t0 = time.perf_counter()
        value = b.work.result() if isinstance(b.work, ThreadFuture) else b.work.wait()  # type: ignore[union-attr]
        if isinstance(b.work, ThreadFuture):
            self._comm_side.join(b.comm_done)   # CUDA: this thread's stream reads the codec's result
        self.group.meter.add_wait(GRAD_TAG, time.perf_counter() - t0)
        if isinstance(value, list):  # a raw Work future yields a list of tensors
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != b.buffer.numel():
            raise ShoalError(
                f"communication hook's future for bucket {b.index} gave {type(value).__name__} "
                f"of {getattr(value, 'numel', lambda: '?')()} elements; expected a tensor of {b.buffer.numel()}"
            )
        return value

    def _global_usage(self) -> list[int]:
        # A parameter unused on every rank keeps its .grad untouched, as in torch DDP.
        used = torch.tensor(list(self._used), dtype=torch.int32, device=self.group.device)
        self.group.all_reduce(used, op="max", tag="ddp/control").wait()
        return used.tolist()  # after the step's collectives

    def _write_grads(self, b: _Bucket, globally_used: list[int] | None) -> None:
        """The averaged gradients into ``.grad``: the views given at the start already hold them;
        other gradients get the view (``gradient_as_bucket_view``) or a copy of it."""
        stray = b.stray
        if globally_used is not None:
            # Unused on every rank: .grad stays what it was before this backward.
            stray = [k for k in stray if globally_used[b.members[k]]]
            for k in b.attached:
                if not globally_used[b.members[k]]:
                    b.params[k].grad = None
        if stray:
            if self.as_view:
                for k in stray:
                    b.params[k].grad = b.views[k]
            else:
                dst, src = [], []
                with torch.no_grad():
                    for k in stray:
                        grad = b.params[k].grad
                        if grad is None:  # cleared since its bucket launched
                            b.params[k].grad = b.views[k].clone()
                        else:
                            dst.append(grad)
                            src.append(b.views[k])
                    if dst:
                        torch._foreach_copy_(dst, src)
        if not self.as_view:
            # Hand the buffer to the .grad that view it (attached now, or kept from an earlier
            # step): the next backward reuses it only if take_back finds nobody else sees it.
            b.handed_off = bool(b.attached) or b.kept

    def remove_hooks(self) -> None:
        self.verdict.expire()   # a model unwrapped after a skipped step must not skip the next one
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._comm_thread is not None:
            self._comm_thread.shutdown(wait=False)
        if self._done_thread is not None:
            self._done_thread.shutdown(wait=False)


def _params_in_graph(outputs: Any) -> set[int]:
    """ids of leaf tensors reachable from the autograd graph of ``outputs``."""
    found: set[int] = set()
    stack: list[Any] = []
    for t in _tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found.add(id(t))
    seen: dict[int, Any] = {}  # keeps nodes alive so their ids stay unique
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        var = getattr(fn, "variable", None)
        if var is not None:
            found.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_in(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for k in obj.__dataclass_fields__ for t in _tensors_in(getattr(obj, k))]
    return []
