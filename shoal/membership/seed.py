"""A copy of the run's state kept on this host for the next life of this worker slot (``SHOAL_STATE_CACHE``).

A worker that is killed and restarted on the same host (a crash, an OOM
kill, a SIGKILL of the chaos bench) has its background heal download the
run's state again: for DiLoCo on 20 mbit that is 26 MB and 10 s or more, the
largest part of what a restart costs (docs/BENCHMARKS.md). Most of those
bytes are often on the host already: the state the worker held when it died.
With ``SHOAL_STATE_CACHE=<file>`` (one file per worker slot; ``shoal run
--state-cache DIR`` and ``shoal.bench.chaos --state-cache`` set it) a member
of an averaging strategy writes what a background heal would send it (the
global copies and the outer optimizer's state) to that file after each round
that changed them, from a background thread. Its next life hands the file's
bytes to its download as a *seed*
(:class:`~shoal.membership.stateserve.Download`): each source publishes a
digest per range of its snapshot, and the ranges whose digest the seed
matches are taken from the seed, not the network. What the joiner loads is
still checked against the sha256 the sources published, so a stale, foreign
or damaged file costs only the bytes it could not save; nothing of it is
ever trusted. A lost host loses its file, and its replacement downloads all.

Where the run's state moved on since the file was written, the ranges that
changed are fetched: DiLoCo changes all of them at each round, streaming
DiLoCo the ranges of the fragments it synchronised. Step-synchronous
strategies (DDP, ZeRO) change every range at every step: no file is written.

The file holds one model's worth of state per worker slot (in RAM if it is
on ``/dev/shm``); a write that fails (a full disk) is logged once and the
cache is switched off for this life.

Example::

    seed = StateSeed.from_env()            # None without SHOAL_STATE_CACHE
    if seed is not None:
        seed.save(clone_tree(states))      # after a round: written on a background thread
        old = seed.read()                  # the next life: the bytes, or None
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from shoal.comm.streams import SideStream
from shoal.errors import ConfigError
from shoal.membership.stateserve import serialise_snapshot, side_after

log = logging.getLogger("shoal.elastic")
ENV = "SHOAL_STATE_CACHE"
__all__ = ["ENV", "StateSeed"]


class StateSeed:
    """The file ``path`` that holds this worker slot's last copy of the run's state (see the module docstring)."""

    def __init__(self, path: str) -> None:
        if not path or os.path.isdir(path):
            raise ConfigError(f"{ENV} must name a file (one per worker slot), got {path!r}")
        self.path = path
        self.broken: str | None = None      # why writing was switched off (None: it works)
        self.writes = 0                     # files written this life
        self._lock = threading.Lock()
        self._next: tuple[Any, SideStream, Any] | None = None   # the newest tree not written yet
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls) -> "StateSeed | None":
        path = os.environ.get(ENV, "")
        return cls(path) if path else None

    def read(self) -> bytes | None:
        """The bytes the last life wrote, or None (no file; one that cannot be read is logged)."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("could not read the state cache %s (%s): the heal downloads everything", self.path, e)
            return None

    def save(self, tree: Any) -> None:
        """Write ``tree`` (a :func:`~shoal.membership.stateserve.clone_tree` copy, taken at a step boundary on the
        training thread) to the file from a background thread; a newer tree replaces one still waiting."""
        if self.broken is not None:
            return
        side, ready = side_after(tree)
        with self._lock:
            self._next = (tree, side, ready)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="shoal-state-cache", daemon=True)
                self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the writes asked for so far; True if none is left (tests wait so before a kill)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _write(self) -> None:
        while True:
            with self._lock:
                job, self._next = self._next, None
                if job is None or self.broken is not None:
                    self._thread = None
                    return
            tree, side, ready = job
            tmp = f"{self.path}.{os.getpid()}.tmp"   # the launcher removes what a kill leaves
            try:
                data = serialise_snapshot(tree, side, ready)
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)   # the file is the old copy or the new one, never half of one
                self.writes += 1
            except Exception as e:  # noqa: BLE001 - a full disk, a read-only folder: no cache, training goes on
                self.broken = f"{type(e).__name__}: {e}"
                log.warning("could not write the state cache %s (%s); it is off for this worker's life", self.path, e)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
