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
failure, or superseded) goes to :data:`REAPER`, which destroys it on a thread
of its own a moment later. Not sooner than that: its operations may still be stuck
on a silent peer, and its destructor waits for them (until the group's own
timeout), which must not hold the training thread (torch releases the GIL in
a process group's destructor). Not later either: a gloo group whose peer
reset a connection can keep its loop thread spinning on that socket for as
long as the group lives (measured on the emulated cluster: up to ~0.8 of a
core, ~0.3 on the chaos bench, taken from the worker's own share of the CPU,
its steps 1.5-3x slower).
The exit handler waits for the groups still handed over.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
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
    """Destroys the process groups handed to it, each on a thread of its own, ``grace`` seconds after it arrives.

    The grace lets whoever handed a group over drop its own references first
    (the frame that called :meth:`take`, a field set to None just after), so
    that the last reference, and with it the destructor, is the reaper's. A
    group still referenced elsewhere after the grace is waited for (up to its
    ``limit``) and then let go of: it is destroyed where its last reference
    goes, and not counted in :attr:`destroyed`. One thread per group, so that a
    destructor waiting for a stuck operation never holds up the next group (a
    failed group whose connection was reset spins gloo's loop until it goes).
    :meth:`drain` (at exit) waits for every group still handed over.

    Example (what :class:`~shoal.membership.transport.Link` does with a failed quorum's group)::

        REAPER.take(pg, limit=timeouts.op)   # destroyed after ~grace s; its destructor may wait up to limit s
        pg = None
    """

    def __init__(self, grace: float = 1.0) -> None:
        self.grace = grace
        self._reset()
        os.register_at_fork(after_in_child=self._reset)   # a forked child has none of the parent's threads

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0                  # groups taken and not let go of yet
        self._limit = 0.0                  # the longest limit handed over (s): bounds drain's wait
        self.destroyed = 0                 # groups whose last reference was the reaper's, destructor returned
        self._hurry = threading.Event()    # set at exit: no more grace (every caller has let go by then)

    def take(self, pg: Any, limit: float) -> None:
        """Destroy ``pg`` soon, off this thread; its destructor may wait up to ``limit`` s for a stuck operation."""
        with self._lock:
            self._pending += 1
            self._limit = max(self._limit, limit)
        box = [pg]
        del pg
        threading.Thread(target=self._destroy, args=(box, limit), name="shoal-group-reaper", daemon=True).start()

    def pending(self) -> int:
        """Groups handed over and not let go of yet."""
        with self._lock:
            return self._pending

    def _destroy(self, box: list[Any], limit: float) -> None:
        pg = box.pop()
        self._hurry.wait(self.grace)
        deadline = time.monotonic() + limit
        while sys.getrefcount(pg) > 2 and time.monotonic() < deadline:   # 2: ``pg`` and the call's argument
            time.sleep(0.05)
        last = sys.getrefcount(pg) <= 2
        if not last:
            log.debug("a process group let go of is still held elsewhere after %.0f s: it goes with that reference",
                      limit)
        del pg                             # the destructor runs here if this was the last reference
        with self._lock:
            self._pending -= 1
            self.destroyed += last

    def drain(self) -> None:
        """Wait until every group handed over is let go of (no grace any more), up to the longest limit."""
        self._hurry.set()
        with self._lock:
            pending, limit = self._pending, self._limit
        if not pending:
            return
        budget = limit + 1.0               # the groups' threads run side by side
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
