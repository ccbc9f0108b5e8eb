"""NonBlocking's engine: per-layer reductions started in backward, settled at the next forward.

:class:`shoal.strategies.NonBlocking` (in ``nonblocking.py``) is the user-facing
strategy; this module holds the machinery it drives:

- :func:`find_layers` cuts a model into *layers* (modules owning trainable
  parameters), each with one flat gradient buffer reduced by one collective;
- :class:`CommStream` gives the communication thread (codecs run there) a
  stream of its own on the tensors' device, ordered by events both ways;
- :class:`Exchange` launches each layer's reduction in backward as soon as its
  gradients exist, and *settles* the step in the first forward pre-hook of
  the next step: wait for every reduction, one fused NaN/Inf check, then apply
  the whole update (or skip it on every rank alike).

Each step's exchange is one typed round of :mod:`shoal.strategies.rounds`
that stays in flight across the optimizer step: :meth:`Exchange.begin` (the
forward) launches it, the backward hooks issue its reductions, and the
runner's :meth:`~shoal.strategies.rounds.Rounds.land` votes it before the
next step begins (or in ``finalize``): wait, vote, apply or drop.

Why the whole step settles at once (rather than each layer in its own
pre-hook): skipping a non-finite step must be all-or-nothing, so no layer may
be updated before every layer's mean is known to be finite. The first layer a
forward runs is normally the last whose reduction was launched (its gradient
comes last in backward), and reductions finish in launch order, so waiting for
all of them there costs nothing in that usual layout. It also makes shared
(tied) parameters safe: everything is updated before anything runs, so no
module reads a parameter that is still to change, and autograd never finds a
saved parameter modified in place. See docs/nonblocking.md.
"""

from __future__ import annotations

import time
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
from torch import nn

from shoal.codecs.base import Codec, common_dtype
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.group import Handle
from shoal.errors import ShoalError
from shoal.strategies.rounds import FailurePolicy, Round, Rounds

TAG = "nonblocking/grad"


class CommStream:
    """A stream of its own for the communication thread, on one device, with events in both directions.

    The training thread calls :meth:`mark_ready` after writing a layer's
    gradients into its buffer (an event on its current stream); the
    communication thread runs the codec inside :meth:`run`, which first makes
    its own stream wait for that event and records a second one when the
    codec's work is queued; the training thread calls :meth:`join` before it
    reads the means, so its stream waits for the second event. No host sync is
    needed for the ordering, and a host sync inside the codec waits for the
    communication stream only, never for training kernels.

    Device-generic through ``torch.get_device_module`` (CUDA, XPU, ...). On
    the CPU, torch's CPU stream API does nothing: events are ``None`` and the
    calls are no-ops, so the CPU path is unchanged. A device with no stream
    API (``meta``) gets no-ops too.

    Example::

        comm = CommStream(buffer.device)
        ready = comm.mark_ready()                            # training thread
        fut = pool.submit(comm.run, ready, lambda: codec.mean([buffer], ["w"], group, "x"))
        comm.join(fut.result())                              # training thread, before reading buffer
    """

    def __init__(self, device: torch.device, module: Any = None) -> None:
        self.device = device
        if module is None:
            try:
                module = torch.get_device_module(device)
            except RuntimeError:  # e.g. "meta": no device module, nothing to order
                module = None
        if module is not None and not all(hasattr(module, a) for a in ("Stream", "stream", "current_stream")):
            module = None
        self.module = module
        self.stream: Any = None
        if module is not None:
            self.stream = module.Stream() if device.type == "cpu" else module.Stream(device=device)

    def mark_ready(self) -> Any:
        """Training thread: an event after the work queued so far on its current stream (``None`` on CPU)."""
        if self.module is None:
            return None
        return self.module.current_stream(self.device).record_event()

    def run(self, ready: Any, fn: Callable[[], None]) -> Any:
        """Communication thread: on its own stream, wait for ``ready``, run ``fn``, return an event after it."""
        if self.module is None:
            fn()
            return None
        with self.module.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            fn()
            return self.stream.record_event()

    def join(self, done: Any) -> None:
        """Training thread: make its current stream wait for ``done`` (from :meth:`run`) before reading."""
        if self.module is not None and done is not None:
            self.module.current_stream(self.device).wait_event(done)


class _Layer:
    """One module's own trainable parameters, their flat buffer and per-step state."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[nn.Parameter], names: list[str]) -> None:
        self.index, self.name, self.module = index, name, module
        self.params, self.names = params, names
        dtype = common_dtype(params)
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer.narrow(0, offset, p.numel()).view(p.shape))
            offset += p.numel()
        self.got = [False] * len(params)
        self.work: Handle | ThreadFuture | None = None
        self.comm: CommStream | None = None  # the communication thread's stream, when a codec runs there
        self.pending = False  # reduced (or reducing) gradients not yet applied

    def reset(self) -> None:
        self.got = [False] * len(self.params)


def find_layers(model: nn.Module) -> list[_Layer]:
    """Layers in the order their gradients are usually ready: reverse registration.

    A parameter shared by several modules (tied weights) belongs to the first
    that registers it; that only decides which buffer reduces it, not when it
    is updated (the whole step's update lands before the next forward runs
    any module).

    Example::

        >>> [layer.name for layer in find_layers(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))]
        ['1', '0']
    """
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    found: list[tuple[str, nn.Module, list[nn.Parameter]]] = []
    for mod_name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            found.append((mod_name, mod, own))
    return [_Layer(i, n, m, ps, [names[id(p)] for p in ps]) for i, (n, m, ps) in enumerate(reversed(found))]


def _hooked_modules(model: nn.Module) -> list[nn.Module]:
    """The model itself and every module holding a trainable parameter directly (tied ones included)."""
    mods = [model] + [m for m in model.modules()
                      if m is not model and any(p.requires_grad for p in m.parameters(recurse=False))]
    return list({id(m): m for m in mods}.values())


class Exchange:
    """Per-layer reductions started in backward and settled in the next forward (see the module docstring).

    Example (what :class:`shoal.strategies.NonBlocking` does)::

        ex = Exchange(find_layers(model), optimizer, Rounds(group, "nonblocking"), codec=None, model=model)
        group.before_begin_step(ex.end_step)
        ex.begin()                  # before a training forward: the step's round (elastic: quorum, heal)
        ex.arm()                    # after a training forward: the next backward launches reductions
        loss.backward()             # each layer's all-reduce starts as soon as its gradients exist
        ex.request_step()           # optimizer.step(): snapshot the hyperparameters
        model(x)                    # first pre-hook: wait, check, apply the whole update (or skip it)
    """

    def __init__(self, layers: list[_Layer], optimizer: torch.optim.Optimizer, rounds: Rounds,
                 codec: Codec | None, model: nn.Module | None = None) -> None:
        self.layers, self.optimizer, self.codec = layers, optimizer, codec
        self.rounds, self.group = rounds, rounds.group
        # The step's exchange: launched by the forward, its reductions issued by backward, voted by end_step.
        self.round = rounds.add(Round("exchange", land=self._wait_pending, apply=self._commit,
                                      discard=self._discard, policy=FailurePolicy.DISCARD))
        self.commits = 0                     # exchanges voted and applied (one vote each, see end_step)
        self.discards = 0                    # exchanges dropped on every member (elastic groups only)
        self.nonfinite_skips = 0             # steps every rank skipped because a mean held NaN/Inf
        self._where = {id(p): (layer, slot) for layer in layers for slot, p in enumerate(layer.params)}
        self._group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._thread: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, CommStream] = {}
        self._armed = False
        self._started = False
        self._next = 0                       # next layer index to launch this backward
        self._step_hparams: list[dict[str, Any]] | None = None  # snapshot taken by optimizer.step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for layer in layers for p in layer.params]
        hooked = _hooked_modules(model) if model is not None else [layer.module for layer in layers]
        self._hooks += [m.register_forward_pre_hook(self._pre_hook) for m in hooked]

    # --- backward: start reductions ------------------------------------------
    def begin(self) -> None:
        """Before a training forward: launch the step's round (its ``begin_step`` first votes the last one).

        Elastic: adopts the latest quorum and heals newcomers before any
        collective. A second training forward in the same step (no backward
        between) stays in that step.
        """
        self.rounds.launch(self.round)

    def arm(self) -> None:
        self._armed, self._started, self._next = True, False, 0
        for layer in self.layers:
            layer.reset()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        layer, slot = self._where[id(p)]
        if layer.pending:
            raise ShoalError(
                f"layer {layer.name!r} got a new gradient while last step's was not applied yet: "
                "NonBlocking needs optimizer.step() between two backward passes (no gradient accumulation)"
            )
        if not self._started:
            self._started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if layer.got[slot]:
            raise ShoalError(f"parameter {layer.names[slot]!r} received a gradient twice in one backward")
        grad, view = p.grad, layer.views[slot]
        if grad is None:  # pragma: no cover - the hook only fires after accumulation
            return
        with torch.no_grad():
            if self.codec is None:
                torch.div(grad, self.group.size, out=view)  # the sum of these is the mean
            else:
                view.copy_(grad)
        p.grad = None  # the local gradient is on its way; .grad is refilled with the mean
        layer.got[slot] = True
        self._launch_ready()

    def _launch_ready(self, end: bool = False) -> None:
        # In index order only, so collectives pair up on every rank.
        while self._next < len(self.layers):
            layer = self.layers[self._next]
            if not all(layer.got) and not end:
                return
            if any(layer.got):
                for slot, got in enumerate(layer.got):
                    if not got:
                        layer.views[slot].zero_()
                layer.work = self._launch(layer)
                layer.pending = True
            self._next += 1

    def _launch(self, layer: _Layer) -> Handle | ThreadFuture:
        if self.codec is None:
            return self.group.all_reduce(layer.buffer, op="sum", tag=TAG)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-nonblocking")
        device = layer.buffer.device
        comm = self._streams.get(device)
        if comm is None:
            comm = self._streams[device] = CommStream(device)
        layer.comm = comm
        codec, group = self.codec, self.group
        ready = comm.mark_ready()  # the gradients copied into layer.buffer so far, on this thread's stream
        return self._thread.submit(comm.run, ready, lambda: codec.mean(layer.views, layer.names, group, TAG))

    def _end_of_backward(self) -> None:
        self._launch_ready(end=True)
        self._armed = False

    # --- step and forward: settle reductions ----------------------------------
    def request_step(self) -> None:
        """``optimizer.step()``: remember the hyperparameters; the update lands in the next forward."""
        if not self.pending():
            # Nothing in flight (finalised before step): the means are in .grad already, the same on every rank.
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            if read_flag(nonfinite_flag(grads)):
                self._count_skip()
                return
            self.optimizer.step()
            return
        self._step_hparams = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _pre_hook(self, _module: nn.Module, _inputs: Any) -> None:
        if self._step_hparams is not None:  # O(1) once settled: nothing to do for the step's other modules
            self.settle()

    def pending(self) -> list[_Layer]:
        return [layer for layer in self.layers if layer.pending]

    def settle(self) -> None:
        """Finish a requested step: wait for every reduction, one fused NaN/Inf check, apply it or skip it.

        The means are identical on every rank (they came out of the same
        collectives), so every rank reaches the same verdict with no extra
        message. Non-finite: parameters and optimizer state stay as they
        were on every rank, and the group's meter counts one skip under
        ``nonblocking/grad``. The group's vote comes first (:meth:`end_step`;
        always "commit" on a static group).
        """
        if self._step_hparams is None:
            return
        if not self.pending():
            self._step_hparams = None
            return
        self._vote()

    def _apply_finite(self, todo: list[_Layer]) -> None:
        """All reductions of ``todo`` are waited: apply the requested step unless some mean is non-finite."""
        if read_flag(nonfinite_flag([layer.buffer for layer in todo])):  # the step's one host sync
            self._drop(todo)
            self._count_skip()
        else:
            self.apply(todo)

    def _count_skip(self) -> None:
        self.nonfinite_skips += 1
        self.group.meter.add_nonfinite_skip(TAG)

    def _drop(self, todo: Sequence[_Layer]) -> None:
        """Forget ``todo``'s means and the step request: parameters and optimizer state stay as they were."""
        for layer in todo:
            layer.pending = False
            for p in layer.params:
                p.grad = None
        self._step_hparams = None

    def end_step(self) -> None:
        """The group's ``before_begin_step`` hook: ends the step of a requested exchange.

        The exchange launched in a backward is that backward's step: the
        runner lands its round (:meth:`Rounds.land`): wait for every layer's
        reduction, vote, then apply it (commit) or drop it (discard, elastic
        groups only: the means and the step request are forgotten, parameters
        and optimizer state stay as they were, on every member alike). Called
        before the next step starts, so a quorum change or heal never finds an
        exchange in flight. A committed exchange whose means hold NaN/Inf is
        skipped on every rank.
        """
        if self._step_hparams is not None and self.pending():
            self._vote()

    def _vote(self) -> None:
        if self.rounds.land() is None:   # pragma: no cover - a backward launches reductions only after begin()
            raise ShoalError("NonBlocking reductions in flight without a launched round: every training forward "
                             "begins the step's round (NonBlockingModule.forward) before backward")

    # --- the round's land / apply / discard (the runner calls them) ------------------------------
    def _wait_pending(self) -> None:
        for layer in self.pending():
            self._wait(layer)

    def _commit(self) -> None:
        self.commits += 1
        todo = self.pending()
        if self._step_hparams is not None:
            self._apply_finite(todo)
        else:   # finalised without a requested step: leave the means in .grad
            self.apply(todo)

    def _discard(self) -> None:
        self.discards += 1
        self._drop(self.pending())

    def apply(self, layers: Sequence[_Layer]) -> None:
        """Wait for ``layers``' reductions, put the means in ``.grad``, step them if a step was requested."""
        stepping = self._step_hparams is not None
        for layer in layers:
            self._wait(layer)
            with torch.no_grad():
                for p, view, got in zip(layer.params, layer.views, layer.got):
                    if not got:
                        p.grad = None
                    elif stepping and view.dtype == p.dtype:
                        p.grad = view  # read by the step below, cleared before the buffer is reused
                    else:
                        p.grad = view.to(p.dtype, copy=True)
            layer.pending = False
        if stepping:
            self._step_only([p for layer in layers for p in layer.params if p.grad is not None])
            for layer in layers:
                for p in layer.params:
                    p.grad = None
        if not self.pending():
            self._step_hparams = None

    def _wait(self, layer: _Layer) -> None:
        if isinstance(layer.work, Handle):
            layer.work.wait()
        elif isinstance(layer.work, ThreadFuture):
            t0 = time.perf_counter()
            done = layer.work.result()
            self.group.meter.add_wait(TAG, time.perf_counter() - t0)
            if layer.comm is not None:
                layer.comm.join(done)  # this thread's stream waits for the codec's work
        layer.work = None

    def _step_only(self, params: list[torch.Tensor]) -> None:
        """One optimizer step restricted to ``params``, with the snapshot's hyperparameters."""
        groups = self.optimizer.param_groups
        saved = [dict(g) for g in groups]
        subset: list[list[torch.Tensor]] = [[] for _ in groups]
        for p in params:
            subset[self._group_of[id(p)]].append(p)
        try:
            for g, snap, ps in zip(groups, self._step_hparams or [], subset):
                g.update(snap)
                g["params"] = ps
            self.optimizer.step()
        finally:
            for g, old in zip(groups, saved):
                g.clear()
                g.update(old)

    def finalize(self) -> None:
        """Settle a requested step, or (none requested) wait and leave the means in ``.grad``."""
        if self._armed and self._started:
            raise ShoalError("cannot finalise during backward")
        if self.pending():
            self._vote()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._thread is not None:
            self._thread.shutdown(wait=True)
