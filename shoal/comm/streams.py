"""CUDA streams and events for work that shoal runs on a background thread, and eager NCCL set-up.

A background thread (DDP's codec thread, ZeRO's bucket-done thread, DASO's
and DiLoCo's background sync, a delayed collaborative step) that touches CUDA
tensors runs its kernels on a stream of its own, ordered against the
training stream by events in both directions:

- :meth:`SideStream.ready` (training thread) records an event on the
  training thread's current stream: what the background work reads has been
  written once that event is reached;
- :meth:`SideStream.run` (background thread) makes the side stream wait for
  that event, runs the work on the side stream and records a "done" event;
- :meth:`SideStream.join` (training thread) makes the training thread's
  current stream wait for the "done" event before it reads what the
  background work wrote.

No host synchronisation is involved: only stream-side waits. On the CPU
every method is a no-op that costs nothing, so callers need no branches.

:func:`connect` creates a new NCCL subgroup's communicator at once, on the
calling thread. NCCL creates communicators lazily, at a group's first
collective; a subgroup first used from a background thread would then be
created at different moments (and in a different order relative to other
groups) on different ranks, which hangs NCCL's creation.

Example::

    side = SideStream(flat.device)
    ready = side.ready()                          # training thread
    fut = pool.submit(side.run, ready, lambda: codec.mean([flat], ["x"], group, "tag"))
    _, done = fut.result()
    side.join(done)                               # training thread reads flat after this
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class SideStream:
    """One background thread's CUDA stream (none on the CPU); see the module docstring.

    Args:
        device: the device of the tensors the background work touches.

    >>> s = SideStream(torch.device("cpu"))
    >>> s.join(s.run(s.ready(), lambda: None)[1])   # no-ops on the CPU
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream: Any = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    def ready(self) -> Any:
        """An event on the calling thread's current stream (None on the CPU): inputs are written."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run(self, ready: Any, fn: Callable[[], T]) -> tuple[T, Any]:
        """Run ``fn`` on the side stream after ``ready``; return ``(fn's result, done event)``."""
        if self.stream is None:
            return fn(), None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            result = fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        return result, done

    def join(self, done: Any) -> None:
        """Make the calling thread's current stream wait for ``done`` (no-op for None)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)


def connect(group: Any) -> None:
    """Create an NCCL group's communicator now, on this thread (no-op on other backends).

    Every member must call it, in the same order relative to its other
    groups' creation: right after creating the group, on the training thread.
    A one-element all-reduce on the group's device does it (blocking for the
    host only while NCCL builds the communicator).

    Example::

        sub = group.split([[0, 1], [2, 3]])
        connect(sub)
    """
    if group is None or "nccl" not in str(getattr(group, "backend", "")) or group.size == 1:
        return
    probe = torch.zeros(1, device=group.device)
    dist.all_reduce(probe, group=group.pg)   # not metered: set-up, not training traffic
