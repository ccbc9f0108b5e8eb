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

Beside it, in ``<file>.own``, the member keeps what is its own and never
sent: DiLoCo's inner optimizer state, written with each copy. Its next life
loads it after the heal instead of starting that optimizer empty (a fresh
Adam's first steps are about the learning rate in every coordinate: several
times a warm one's, docs/BENCHMARKS.md), if the file is this run's and every
tensor fits its parameter; otherwise the optimizer starts empty, as without
a cache. Nobody else can check these bytes, and nobody else uses them: they
shape only this worker's own steps from there on.

A DiLoCo member also writes, every ``SHOAL_STATE_CACHE_EVERY`` inner steps
(default :data:`EVERY`; 0: never), its progress since the copy to
``<file>.inner``: its model's parameters and its inner optimizer's state,
the number of inner steps since the copy, and a digest of the copy's bytes,
only once that copy is written (a newer copy removes the file first). A next
life that loads exactly that copy goes on from there
(:func:`resume_progress`) instead of from the copy: a kill then loses at
most the steps since the last progress write, not all those since the round.

The files hold one model's worth of state per worker slot and the slot's
own optimizer state (in RAM if they are on ``/dev/shm``); a write of the copy
that fails (a full disk) is logged once and the cache is switched off for
this life. A write of the own part that fails (room for the copy but not for
the optimizer state beside it) switches off only the own part. Either way,
and whenever a copy is written without an own part, the own file is
removed: the own part on the host is never older than the copy beside it by
more than the round a kill between the two writes can leave.

Example::

    seed = StateSeed.from_env()            # None without SHOAL_STATE_CACHE
    if seed is not None:
        seed.save(clone_tree(states), own=keep_own(replayers, run))   # after a round: written on a background thread
        old = seed.read()                  # the next life: the bytes, or None
        mine = seed.read_own()             # ... and its own part (a tree), or None
    seed.save_progress(gen, keep_progress(replayers, run, steps))   # every EVERY inner steps after copy ``gen``
    resume_progress(seed, replayers, run, old)   # the next life, once it loaded ``old``: the steps it goes on from
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any, Sequence

import torch

from shoal.comm.objects import from_bytes
from shoal.comm.streams import SideStream
from shoal.errors import ConfigError
from shoal.membership.stateserve import host_copy, serialise_snapshot, side_after

log = logging.getLogger("shoal.elastic")
ENV = "SHOAL_STATE_CACHE"
EVERY_ENV = "SHOAL_STATE_CACHE_EVERY"   # inner steps between two writes of the slot's progress (0: none)
EVERY = 4
OWN = ".own"   # the suffix of the file beside it that holds the slot's own state
PROGRESS = ".inner"   # ... and of the one that holds its progress since the copy (its model, its own optimizer)
__all__ = ["ENV", "EVERY", "EVERY_ENV", "OWN", "PROGRESS", "StateSeed", "copy_digest", "keep_own", "keep_progress",
           "restore_own", "resume_progress"]


def copy_digest(data: bytes) -> str:
    """What ties a progress file to the copy it went on from: a BLAKE2b digest of the copy's bytes."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _every() -> int:
    raw = os.environ.get(EVERY_ENV, "")
    if not raw:
        return EVERY
    if not raw.isdigit():
        raise ConfigError(f"{EVERY_ENV} must be a whole number of inner steps >= 0 (0: no progress kept), got {raw!r}")
    return int(raw)


class StateSeed:
    """The file ``path`` that holds this worker slot's last copy of the run's state (see the module docstring)."""

    def __init__(self, path: str) -> None:
        if not path or os.path.isdir(path):
            raise ConfigError(f"{ENV} must name a file (one per worker slot), got {path!r}")
        self.path = path
        self.every = _every()               # inner steps between two writes of the progress (0: none)
        self.broken: str | None = None      # why writing was switched off (None: it works)
        self.own_broken: str | None = None  # why writing the own part was switched off (the copy goes on)
        self.progress_broken: str | None = None   # why writing the progress was switched off (the copy goes on)
        self.writes = 0                     # files written this life
        self.progress_writes = 0            # progress files written this life
        self._lock = threading.Lock()
        self._next: tuple[Any, Any, SideStream, Any, Any, int | None] | None = None   # the newest copy not written yet
        self._progress: tuple[int, Any, SideStream, Any, Any] | None = None   # the newest progress not written yet
        self._written: tuple[int | None, str] | None = None   # the last copy written: its generation and digest
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

    def read_progress(self) -> Any:
        """The progress the last life wrote (a tree of CPU tensors), or None: no such file, or one that cannot be
        read or unpickled (logged)."""
        return self._read_tree(self.path + PROGRESS, "progress", "its inner steps start from the copy")

    def read_own(self) -> Any:
        """The own part the last life wrote beside the copy (a tree of CPU tensors), or None: no such file, or one
        that cannot be read or unpickled (logged)."""
        return self._read_tree(self.path + OWN, "own state", "it starts empty")

    @staticmethod
    def _read_tree(path: str, what: str, then: str) -> Any:
        try:
            with open(path, "rb") as f:
                data = f.read()
            return from_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - unreadable or not a torch.save of a tree: start without it
            log.warning("could not read this worker's %s kept in %s (%s: %s): %s", what, path, type(e).__name__, e,
                        then)
            return None

    def save(self, tree: Any, own: Any = None, gen: int | None = None) -> None:
        """Write ``tree`` (a :func:`~shoal.membership.stateserve.clone_tree` copy, taken at a step boundary on the
        training thread) to the file, and ``own`` (what :func:`keep_own` returned; None: nothing, and an own
        file left by an earlier life is removed) to the file beside it, from a background thread; newer trees
        replace ones still waiting. ``gen`` names this copy for :meth:`save_progress`."""
        if self.broken is not None:
            return
        own_ready = own.pop("ready", None) if isinstance(own, dict) else None   # keep_own's host copy: done when
        side, ready = side_after((tree, own))
        with self._lock:
            self._next = (tree, own, side, ready, own_ready, gen)
            self._start()

    def save_progress(self, gen: int, part: Any) -> None:
        """Write ``part`` (:func:`keep_progress`'s: the model and own optimizer ``steps`` inner steps after copy
        ``gen``) to the progress file, from the background thread, once copy ``gen`` is written; dropped if a
        newer copy was asked for meanwhile (it no longer goes on from the file's copy)."""
        if self.broken is not None or self.progress_broken is not None:
            return
        part_ready = part.pop("ready", None) if isinstance(part, dict) else None
        side, ready = side_after(part)
        with self._lock:
            self._progress = (gen, part, side, ready, part_ready)
            self._start()

    def _start(self) -> None:   # (under self._lock)
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
                progress = None
                if job is None:   # a copy first: a progress goes on from the copy before it
                    progress, self._progress = self._progress, None
                if (job is None and progress is None) or self.broken is not None:
                    self._thread = None
                    return
            if job is None:
                self._write_progress(*progress)  # type: ignore[misc]
                continue
            tree, own, side, ready, own_ready, gen = job
            # The own part first: a copy on disk is never newer than the own part beside it (a kill between the
            # two leaves the new own part with the old copy: a round's difference in the slot's own state).
            if own is None or self.own_broken is not None:
                self._drop_own()   # none kept now: an older life's must not be resumed beside a newer copy
            else:
                if own_ready is not None:
                    own_ready.synchronize()   # the host copy keep_own issued (this thread waits, not training)
                why, _ = self._put(self.path + OWN, own, side, ready)
                if why is not None:
                    self.own_broken = why
                    log.warning("could not write this worker's own state beside the state cache (%s%s: %s); the "
                                "copy goes on without it, and its next life's own optimizer starts empty",
                                self.path, OWN, why)
                    self._drop_own()
            self._written = None   # the progress file on disk goes on from the copy being replaced: gone first
            self._drop(PROGRESS)
            why, data = self._put(self.path, tree, side, ready)
            if why is not None:
                self.broken = why
                log.warning("could not write the state cache %s (%s); it is off for this worker's life", self.path,
                            why)
                self._drop_own()
            else:
                self.writes += 1
                self._written = (gen, copy_digest(data))

    def _write_progress(self, gen: int, part: Any, side: SideStream, ready: Any, part_ready: Any) -> None:
        if self._written is None or self._written[0] != gen or self.progress_broken is not None:
            return   # its copy was not written (or failed): a progress on disk must go on from the copy beside it
        if part_ready is not None:
            part_ready.synchronize()
        part["copy"] = self._written[1]
        why, _ = self._put(self.path + PROGRESS, part, side, ready)
        if why is not None:
            self.progress_broken = why
            log.warning("could not write this worker's progress beside the state cache (%s%s: %s); the copy goes "
                        "on without it, and its next life starts its inner steps from the copy", self.path, PROGRESS,
                        why)
            self._drop(PROGRESS)
        else:
            self.progress_writes += 1

    def _put(self, path: str, part: Any, side: SideStream, ready: Any) -> tuple[str | None, bytes]:
        """Write ``part`` to ``path`` atomically: ``(None, the bytes written)``, or why it failed (the partial file
        removed) and no bytes."""
        tmp = f"{path}.{os.getpid()}.tmp"   # the launcher removes what a kill leaves
        try:
            data = serialise_snapshot(part, side, ready)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)   # the file is the old one or the new one, never half of one
            return None, data
        except Exception as e:  # noqa: BLE001 - a full disk, a read-only folder: no cache, training goes on
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return f"{type(e).__name__}: {e}", b""

    def _drop(self, suffix: str) -> None:
        try:
            os.unlink(self.path + suffix)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s%s (%s)", self.path, suffix, e)

    def _drop_own(self) -> None:
        self._drop(OWN)


def keep_own(replayers: Sequence[Any], run: str) -> Any:
    """What the replayers (:class:`~shoal.membership.replay.Replayer`) keep of a member's own state for its next
    life, tagged with the run (``run``: a key of this run's), or None where none keeps anything yet.

    Copied to the host here, on the training thread at a step boundary, without a host sync and without GPU
    memory (:func:`~shoal.membership.stateserve.host_copy`); ``"ready"``, the copy's event (None on the CPU),
    is for :meth:`StateSeed.save`, which takes it out and has the writer wait for it."""
    kept = [r.keep_own() for r in replayers]
    if all(k is None for k in kept):
        return None
    host, ready = host_copy(kept)
    return {"run": run, "kept": host, "ready": ready}


def restore_own(seed: StateSeed, replayers: Sequence[Any], run: str) -> bool:
    """After a heal loaded the run's state and the replayers reset what is each member's own: load what this
    slot's last life kept of it (:func:`keep_own`, read from the file beside the copy), if the file is this
    run's (``run``) and each part fits; True if some part was loaded. What does not fit is logged and left
    empty, as without a cache."""
    got = seed.read_own()
    if got is None:
        return False
    if not isinstance(got, dict) or got.get("run") != run or not isinstance(got.get("kept"), list) or len(
            got["kept"]) != len(replayers):
        log.warning("the own state kept in %s%s is not this run's: this worker's own optimizer starts empty",
                    seed.path, OWN)
        return False
    loaded = False
    for r, kept in zip(replayers, got["kept"]):
        if kept is None:
            continue
        try:
            why = r.restore_own(kept)
        except Exception as e:  # noqa: BLE001 - a file this run wrote but of a shape the checks did not foresee
            why = f"{type(e).__name__}: {e}"
        if why is None:
            loaded = True
        else:
            log.warning("not resuming the own state kept in %s%s (%s): it starts empty", seed.path, OWN, why)
    if loaded:
        log.info("resumed this worker's own optimizer state from its last life's copy on this host (%s%s)",
                 seed.path, OWN)
    return loaded


def keep_progress(replayers: Sequence[Any], run: str, steps: int) -> Any:
    """What the replayers keep of a member's progress ``steps`` inner steps after the copy last saved (its model
    and own optimizer, :meth:`~shoal.strategies.diloco_heal.OuterReplay.keep_progress`), tagged with the run, for
    :meth:`StateSeed.save_progress`; None where none keeps any (overlapped reductions). Streaming DiLoCo's
    holds each fragment's span too.
    Copied to the host here, without a host sync (``"ready"``: the copy's event, for the writer)."""
    kept = [r.keep_progress() if hasattr(r, "keep_progress") else None for r in replayers]
    if all(k is None for k in kept):
        return None
    host, ready = host_copy(kept)
    return {"run": run, "steps": steps, "kept": host, "ready": ready}


def resume_progress(seed: StateSeed, replayers: Sequence[Any], run: str, copy: bytes) -> int:
    """A restart that just loaded this host's copy (``copy``, its bytes) before its admission: load what its last
    life kept of its progress from that copy on (:func:`keep_progress`), if the file is this run's and goes on
    from exactly these bytes (its digest) and every part fits; the inner steps it resumes (0: none, and nothing
    was changed). Its model then holds the last life's inner steps since that copy, its own optimizer their
    state, and the replayers count those steps as trained since it loaded (the round that admits it takes them,
    weighted by their share of the period)."""
    got = seed.read_progress()
    if got is None:
        return 0
    raw = got.get("steps") if isinstance(got, dict) else None
    steps = raw if isinstance(raw, int) and not isinstance(raw, bool) else 0
    why: str | None
    if not isinstance(got, dict) or got.get("run") != run or not isinstance(got.get("kept"), list) or len(
            got["kept"]) != len(replayers) or steps < 1:
        why = "it is not this run's"
    elif got.get("copy") != copy_digest(copy):
        why = "it goes on from another copy than the one loaded"
    else:
        why = next((w for r, k in zip(replayers, got["kept"]) if k is not None
                    for w in [r.progress_fits(k) if hasattr(r, "progress_fits") else "no part of it is kept"]
                    if w is not None), None)
    if why is not None:
        log.info("not resuming the progress kept in %s%s (%s): the inner steps start from the copy", seed.path,
                 PROGRESS, why)
        return 0
    for r, kept in zip(replayers, got["kept"]):
        if kept is not None:
            why = r.restore_progress(kept, steps)
            if why is not None:   # what the checks did not foresee: the model is back at the copy (optimizer empty)
                log.warning("could not resume the progress kept in %s%s (%s): the inner steps start from the copy",
                            seed.path, PROGRESS, why)
                return 0
    log.info("resumed this worker's last life's %d inner steps since this host's copy (%s%s)", steps, seed.path,
             PROGRESS)
    return steps
