"""A joiner's download of one background-heal admission, on its own thread, and how it is abandoned.

:class:`~shoal.membership.catchup.CatchUp` starts one :class:`Fetch` per
admission: it waits (an averaging strategy's joiner) until the admitting step
committed, reads the sources' signed records (address, size, sha256, and the
step whose begin state they offer: the admitted one), and
runs a striped :class:`~shoal.membership.stateserve.Download`, paced by the
run's commits if asked (:mod:`shoal.membership.pace`), and for an averaging
strategy held while the joiner is in a round (it asks for ranges during the
inner steps only: the round's collectives would share the link with it). Its result lives on
the object, so a download given up on can never report into a later one.

An averaging strategy's joiner may begin one before its admission, while it
waits for the survivors' next round (``early``, :meth:`CatchUp.prefetch`):
it takes whichever step its sources offer, and the admission keeps it only if
that is the admitted step's state (:meth:`Fetch.want`).

Abandoning one (the quorum heals blocking, the joiner is admitted again, the
catch-up fails) is :meth:`Fetch.stop`: no request goes out after it, the
connections are cut, a wait for a pace slot or for the sources ends, and the
thread is joined (bounded); its pace is *not* released, since nobody uses
what it would fetch. Only ``leave()`` lifts the pace of a download it still
wants (:meth:`CatchUp.finish`).

Example (what ``CatchUp`` does)::

    fetch = Fetch(group, hid=7, members=[0, 2], top=40, after_commit=False, pace=StepPace(0.2))
    fetch.start()
    ...
    fetch.stop(wait=group.timeouts.op)     # the quorum heals blocking: given up, nothing of it is used
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable

from shoal.errors import ShoalError
from shoal.membership.pace import PACED_CHUNK, StepPace
from shoal.membership.stateserve import Download, Source

log = logging.getLogger("shoal.elastic")
__all__ = ["Fetch"]


class Fetch:
    """The download of heal ``hid`` from ``members`` by this joiner, admitted at step ``top``.

    ``result`` is ``(blob, None)`` or ``(None, why)`` once ``done`` is set;
    ``download`` is the :class:`Download` once the sources are known (for
    its statistics). ``before_chunk`` is handed to the download (tests park
    it there), and so is ``seed`` (:mod:`shoal.membership.seed`).
    """

    def __init__(self, group: Any, hid: int, members: list[int], top: int, after_commit: bool,
                 pace: StepPace | None, before_chunk: Callable[[int, int], None] | None = None,
                 early: bool = False, seed: Callable[[], bytes | None] | None = None) -> None:
        self.group, self.hid, self.members, self.top = group, hid, members, top
        # Reads this host's last copy of the state (shoal.membership.seed), on this thread: its matching ranges
        # are kept.
        self.seed = seed
        self.after_commit, self.pace, self.before_chunk = after_commit, pace, before_chunk
        self.early = early   # begun before the admission (CatchUp.prefetch): no admitting step to wait for
        # The step whose begin state it fetches: ``top`` once admitted; an early one takes whichever the sources
        # offer until the admission says which (want()); ``step`` is the one it chose (None: not yet).
        self.wanted: int | None = None if early else top
        self.step: int | None = None
        # Whether its end tells the sources it is done with their snapshot (a source's leave() waits for that
        # word): an early one only once its admission kept it (want), as one dropped there is nobody's.
        self._marks, self._ended = not early, False
        self._deadline = float("inf")   # waiting for the sources' records until then (_sources; want() renews it)
        self.stopped = threading.Event()
        self.released = threading.Event()   # release(): no more holding while in a round (leave())
        self.done = threading.Event()
        self.result: tuple[bytes | None, str | None] = (None, None)
        self.download: Download | None = None
        self._lock = threading.Lock()
        self.store: Any = None
        self.thread = threading.Thread(target=self._run, name="shoal-heal-fetch", daemon=True)

    def start(self) -> None:
        self.store = self.group.client.store.clone()   # its own store connection: off the training thread's
        self.thread.start()

    @property
    def received(self) -> int:
        """Bytes received so far (0 before the sources are known)."""
        dl = self.download
        return dl.received if dl is not None else 0

    def want(self, step: int, sources: list[int]) -> bool:
        """The admission's step and sources: True if this download fetches the state at that step's begin, or
        will (its sources not chosen yet: from now on only those sources' records of that step count), and
        has not failed; False if it chose another step's or failed (then it is stopped by the caller)."""
        with self._lock:
            if self.step is None:
                self.wanted, self.members = step, [m for m in self.members if m in sources]
            ok = (self.step is None or self.step == step) and not (self._ended and self.result[1] is not None)
            late = ok and self._ended   # it ended before: its word is said here
            if ok and self.step is None:   # it may have waited a whole period for an offer: a full wait from here
                self._deadline = time.monotonic() + self.group.timeouts.join
            self._marks = self._marks or ok
        if late:
            self._mark()
        return ok

    def _mark(self) -> None:
        try:   # the sources stop waiting for this joiner when they leave (CatchUp.finish)
            self.store.set(str(self.group.client.key(f"heal/{self.hid}/fetched/{self.group.client.member_id}")), "1")
        except Exception:  # noqa: BLE001 - the coordinator is gone: nobody waits any more
            pass

    def release(self) -> None:
        """Stop holding requests while the joiner is in a round (``leave()``: nobody runs rounds any more)."""
        self.released.set()

    def stop(self, wait: float) -> bool:
        """Abandon the download (see the module docstring); True if its thread ended within ``wait`` s."""
        with self._lock:
            self.stopped.set()
            dl = self.download
        if dl is not None:
            dl.stop()
        self.thread.join(wait)
        if self.thread.is_alive():
            log.warning("the download of heal %d given up on did not stop within %.1f s; it is left to end "
                        "by itself (nothing it fetches is used)", self.hid, wait)
        return not self.thread.is_alive()

    def _run(self) -> None:
        g = self.group
        try:
            if self.after_commit and not self.early:
                self._await_commit()
            sources = self._sources()
            # Finer stripes paced (a slot overshoots by a chunk a source) or held (a round waits for the
            # ranges in flight at its begin, a chunk a source).
            fine = self.pace is not None or self.after_commit
            dl = Download(self.hid, sources, g.client.token, g.client.run_id, g.client.member_id,
                          chunk=min(g.heal_chunk, PACED_CHUNK if fine else 1 << 20), timeout=g.timeouts.op,
                          step=-1 if self.step is None else self.step)
            dl.before_chunk, dl.pace = self.before_chunk, self.pace
            dl.seed = self.seed() if self.seed is not None else None
            if self.after_commit:   # an averaging strategy: no request while this joiner is in a round, whose
                # ... nor once past a new quorum's barrier (its build, heal plan and admission): an early
                # download, begun while the joiner waited there, would queue their small messages behind its bytes.
                dl.hold = lambda: bool(g._in_step or getattr(g, "_entering", False)) and not self.released.is_set()
            with self._lock:   # stop() sees this download, or this thread sees stop()
                self.download = dl
                if self.stopped.is_set():
                    dl.stop()
            dl.run()    # in this thread
            self.result = (dl.blob, dl.error)
        except Exception as e:  # noqa: BLE001 - reported to the training thread, which fails the step
            self.result = (None, f"{type(e).__name__}: {e}")
        with self._lock:
            self._ended, marks = True, self._marks
        if marks:
            self._mark()
        self.done.set()

    def _await_commit(self) -> None:
        """Wait until the step that admitted this joiner committed (a replayer's ``after_commit``: DiLoCo).

        An averaging strategy may admit a joiner in its outer round (a quorum
        re-formed right before it); its collectives then use the link that a
        download would share. Inner steps need none: the download starts
        after the round, when the link is idle. Bounded by ``Timeouts.join``.
        """
        g = self.group
        deadline = time.monotonic() + g.timeouts.join
        while g.step <= self.top and not self.stopped.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _sources(self) -> list[Source]:
        """The sources' published (address, size, sha256), waiting until all or, 2 s after the first, some."""
        g, store = self.group, self.store
        first = None
        with self._lock:
            self._deadline = time.monotonic() + g.timeouts.join
        found: dict[int, tuple[int, Source]] = {}   # member -> (the step its snapshot is of, where)
        while time.monotonic() < self._deadline and not self.stopped.is_set():
            for m in self.members:
                if m in found and (self.wanted is None or found[m][0] == self.wanted):
                    continue   # read again a record of another step: its source re-offers (CatchUp._serve)
                k = str(g.client.key(f"heal/{self.hid}/src/{m}"))
                if store.check([k]):
                    rec = g.client.book.open(store.get(k), writer=m, kind="heal source")
                    if rec is not None and isinstance(rec.get("step"), int):   # a record naming no step: unusable
                        digests = rec.get("digests")
                        found[m] = (rec["step"], Source(m, str(rec["addr"]), int(rec["size"]), str(rec["sha"]),
                                                        tuple(str(d) for d in digests) if isinstance(digests, list)
                                                        else ()))
            with self._lock:   # the choice and want() exclude each other: an admission's step is never missed
                usable = {m: v for m, v in found.items() if self.wanted is None or v[0] == self.wanted}
                first = (first or time.monotonic()) if usable else None
                if first is not None and (len(usable) == len(self.members) or time.monotonic() - first > 2.0):
                    self.step, sha = Counter((st, s.sha) for st, s in usable.values()).most_common(1)[0][0]
                    return [s for st, s in usable.values() if (st, s.sha) == (self.step, sha)]
            # Before its admission a joiner may wait a whole period for an offer: a lighter poll of the store.
            time.sleep(0.1 if self.wanted is None else 0.01)
        if self.stopped.is_set():
            raise ShoalError(f"the download of heal {self.hid} was given up on")
        raise ShoalError(f"no source of heal {self.hid} published its snapshot of step {self.wanted} within "
                         f"{g.timeouts.join} s")
