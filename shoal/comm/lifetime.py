"""Process groups let go of before the interpreter shuts down.

torch destroys a backend's process group (gloo, NCCL) when the last
reference to it goes. If that happens while the interpreter finalizes,
the backend's threads can no longer take the GIL and the process aborts
with ``terminate called without an active exception`` (exit code 134),
after the script has finished and even after it called
``torch.distributed.destroy_process_group()``: that call takes the group
out of torch's registry, but a shoal group (or a wrapper in a reference
cycle that the garbage collector has not reached yet) still holds it.
The launcher then sees a failed worker.

So every shoal object that holds a process group registers here, and an
``atexit`` handler (it runs after the script and its non-daemon threads,
while the interpreter is whole) collects reference cycles, has each holder
drop its process groups, and collects again: the groups are destroyed
then, not during finalization. A holder is not used after that; nothing of
the script runs after its ``atexit`` handlers.

A group let go of while the script runs (an elastic quorum's group after a
failure, or superseded) goes to :data:`REAPER`, which destroys it on its own
thread a moment later. Not sooner than that: its operations may still be stuck
on a silent peer, and its destructor waits for them (until the group's own
timeout), which must not hold the training thread (torch releases the GIL in
a process group's destructor). Not later either: a gloo group whose peer
reset a connection can keep its loop thread spinning on that socket for as
long as the group lives (measured on the emulated cluster: ~0.8 of a core,
taken from the worker's own share of the CPU, its steps 1.5-3x slower).
The exit handler waits for the groups still queued there.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
import weakref
from typing import Any, Protocol

log = logging.getLogger("shoal.elastic")


class Holder(Protocol):
    """An object that holds process groups and can let go of them at exit."""

    def _let_go_at_exit(self) -> None: ...


_HOLDERS: weakref.WeakSet[Holder] = weakref.WeakSet()


def hold(holder: Holder) -> None:
    """Have ``holder`` drop its process groups when the interpreter exits (a weak reference: no leak)."""
    _HOLDERS.add(holder)


class Reaper:
    """Destroys the process groups handed to it on its own thread, ``grace`` seconds after each arrives.

    The grace lets whoever handed a group over drop its own references first
    (the frame that called :meth:`take`, a field set to None just after), so
    that the last reference, and with it the destructor, is this thread's.
    A group still referenced elsewhere then lives on, and is destroyed where its
    last reference goes. :meth:`drain` (at exit) waits for the queue to empty.

    Example (what :class:`~shoal.membership.transport.Link` does with a failed quorum's group)::

        REAPER.take(pg, limit=timeouts.op)   # gone within ~grace s; its stuck operations fail by then + limit
        pg = None
    """

    def __init__(self, grace: float = 1.0) -> None:
        self.grace = grace
        self._queue: queue.Queue[tuple[float, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = 0                  # groups taken and not destroyed yet
        self._limit = 0.0                  # the longest destruction the queue may still take (s)
        self.destroyed = 0                 # groups whose destructor has returned
        self._hurry = threading.Event()    # set at exit: no more grace (every caller has let go by then)

    def take(self, pg: Any, limit: float) -> None:
        """Destroy ``pg`` here soon; its destructor may wait up to ``limit`` s for a stuck operation."""
        with self._lock:
            self._pending += 1
            self._limit = max(self._limit, limit)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="shoal-group-reaper", daemon=True)
                self._thread.start()
        self._queue.put((time.monotonic() + self.grace, pg))

    def pending(self) -> int:
        """Groups handed over and not destroyed yet."""
        with self._lock:
            return self._pending

    def _run(self) -> None:
        while True:
            due, pg = self._queue.get()
            self._hurry.wait(max(0.0, due - time.monotonic()))
            del pg                         # the destructor runs here if this was the last reference
            with self._lock:
                self._pending -= 1
                self.destroyed += 1

    def drain(self) -> None:
        """Wait until every group handed over is destroyed (no grace any more), up to the longest limit per group."""
        self._hurry.set()
        with self._lock:
            pending, limit = self._pending, self._limit
        if not pending:
            return
        budget = pending * limit + 1.0
        deadline = time.monotonic() + budget
        log.debug("waiting for %d process group(s) let go of to be destroyed before exiting", pending)
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.pending():
            log.warning("%d process group(s) were not destroyed within %.0f s; exiting with them alive may abort "
                        "the process (a gloo operation stuck beyond its timeout)", self.pending(), budget)


REAPER = Reaper()


def release_all() -> None:
    """Drop every registered holder's process groups and collect cycles, and wait for the :data:`REAPER`
    (the ``atexit`` handler)."""
    gc.collect()   # wrappers in reference cycles go now, while their groups can still be destroyed
    for holder in list(_HOLDERS):
        holder._let_go_at_exit()
    _HOLDERS.clear()
    gc.collect()
    REAPER.drain()


atexit.register(release_all)
