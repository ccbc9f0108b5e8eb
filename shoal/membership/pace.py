"""Pacing a joiner's background download by the run's committed steps (``SHOAL_HEAL_PACE``).

On a slow link a step-synchronous run (DDP) keeps every member's link busy
for most of each step, the joiner's included: it takes part in every
all-reduce as a zero-weight member. A download that runs flat out through
that link lengthens the survivors' steps for as long as it lasts (4 hosts x
20 mbit, ``lm``: ~12 s per join, docs/BENCHMARKS.md); a flat rate per
source (``SHOAL_HEAL_RATE``) does not follow how many sources serve it or
how many joiners share them.

:class:`StepPace` paces the download from the joiner's side, where every
source's bytes meet (its own link): after each step the run commits, the
joiner may request chunks, striped over every live source at full speed,
for a *slot* of ``fraction`` of a step (the median interval between the
commits it has seen, the first measured from its admission), and then
waits for the next commit. The slot starts at the commit, when the next
step's forward pass leaves the link idlest. So:

* the download gets ``fraction`` of each step's time on the link, so it
  lengthens a survivor's step by about that much, not by the whole transfer
  (aimed at, not a bound: on 4 hosts x 20 mbit at ``fraction=0.3``, slots of
  ~3 s spilled from the forward pass into the all-reduce and steps grew by
  +2.3 s median, +4.1 s max; docs/BENCHMARKS.md);
* the slots of every joiner open at the same commits, so a source's upload
  is busy for about one slot a step however many joiners it serves (they
  share it), and each of ``k`` sources sends ~1/k of a joiner's bytes (the
  chunks are striped): the bytes a joiner gets per step follow the number of
  sources and joiners by themselves, no source ever sends for longer;
* no slot opens at a commit after which the group adopts a new quorum
  (another joiner admitted, or a member outside this step's quorum dropped;
  a member of it dropped fails the step: no commit): the quorum's gloo connect
  and the step that admits a joiner have the link to themselves, so a
  download in progress does not add to another join's admission;
* a step that fails (a member of its quorum lost) closes the open slot at
  its first recorded failure (:meth:`StepPace.pause`), and none opens until
  the retried step commits: the survivors' recovery and retried step have
  the link to themselves too, so a download adds nothing to what a kill
  costs (4 hosts x 20 mbit, ``lm``: the one kill that cost more than 2 s
  beyond the step in flight, 2.17 s, struck while a joiner downloaded; its
  survivors' gloo connect took 1.1 s, against 0.4 s median, and the retried
  step ran 0.8 s longer than the median step; with this pause and joiners
  computing one sample a step, ``ElasticSampler(joiner_batch=1)``, every
  kill of the next run stayed within it: docs/BENCHMARKS.md);
* the download takes about ``S * j / (fraction * step * link rate * min(k, j))``
  steps (the state's size ``S``): bounded, and on a fast link one or two steps.

Pure bookkeeping plus one condition variable: :meth:`committed` and
:meth:`slot_left` take the time as an argument (tests pass made-up times),
:meth:`wait` blocks a download thread until a slot is open.

Example (a joiner at 10 s a step with ``SHOAL_HEAL_PACE=0.2``)::

    pace = StepPace(0.2)
    pace.admitted(now=0.0)
    pace.committed(now=10.0)                         # a 2 s slot: downloads until 12.0
    pace.slot_left(now=11.0)                          # 1.0
    pace.slot_left(now=12.5)                          # 0.0: wait() blocks until the next commit
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from typing import Callable

from shoal.errors import ConfigError
from shoal.rates import parse_rate

__all__ = ["StepPace", "heal_pace", "heal_rate", "parse_pace"]
WINDOW = 5       # commit intervals in the step's median
PACED_CHUNK = 256 << 10   # bytes a paced request asks for: a slot's overshoot is at most one chunk a source


def heal_rate() -> float | None:
    """``SHOAL_HEAL_RATE`` (a tc rate such as ``4mbit``): what a source sends joiners at most, a second.

    Unset or empty: no limit. A flat cap; :func:`heal_pace` follows the run's
    steps instead (docs/elastic.md, "Pacing the download")."""
    rate = os.environ.get("SHOAL_HEAL_RATE", "").strip()
    if not rate:
        return None
    try:
        return parse_rate(rate)
    except ConfigError as e:
        raise ConfigError(f"SHOAL_HEAL_RATE: {e}") from None


def heal_pace() -> float | None:
    """``SHOAL_HEAL_PACE``: the fraction of each committed step a joiner may download for (0 < f <= 1).

    Unset, empty or ``off``: no pace (the download runs flat out).

    Example::

        os.environ["SHOAL_HEAL_PACE"] = "0.2"
        heal_pace()   # 0.2
    """
    return parse_pace(os.environ.get("SHOAL_HEAL_PACE", ""))


def parse_pace(raw: str) -> float | None:
    """A heal pace as :func:`heal_pace` reads it from ``SHOAL_HEAL_PACE`` (ConfigError if it is none)."""
    raw = raw.strip()
    if raw in ("", "off"):
        return None
    try:
        f = float(raw)
    except ValueError:
        f = float("nan")
    if not 0.0 < f <= 1.0:
        raise ConfigError(f"SHOAL_HEAL_PACE must be a fraction of a step in (0, 1] (e.g. 0.2) or 'off', "
                          f"got {raw!r}")
    return f


class StepPace:
    """The download slots of one joiner (see the module docstring).

    Args:
        fraction: the share of each step the joiner may download for, in (0, 1].
        clock: the time source of :meth:`wait` (the other methods take the time as an argument).
    """

    def __init__(self, fraction: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"a heal pace is a fraction of a step in (0, 1], got {fraction!r}")
        self.fraction, self.clock = fraction, clock
        self._last: float | None = None
        self._intervals: deque[float] = deque(maxlen=WINDOW)
        self._open_until = float("-inf")
        self._free = False
        self.slots = 0                   # slots opened (commits seen while downloading)
        self.pauses = 0                  # failed steps that paused the download (pause)
        self._paused = False             # paused since this step began
        self._cv = threading.Condition()

    def admitted(self, now: float) -> None:
        """The joiner was admitted at ``now``: the first commit after it measures the first step."""
        with self._cv:
            self._last = now

    def step(self) -> float | None:
        """The median interval between the commits seen so far (None before the first)."""
        return statistics.median(self._intervals) if self._intervals else None

    def committed(self, now: float, open_slot: bool = True) -> float:
        """A step committed at ``now``: open the next slot; returns its length in seconds.

        ``open_slot=False``: the step is measured but no slot opens (the next step forms a new quorum,
        whose admission should not share the link with a download); 0.0."""
        with self._cv:
            if self._last is not None and now > self._last:
                self._intervals.append(now - self._last)
            self._last = now
            if not open_slot:
                self._open_until = min(self._open_until, now)
                return 0.0
            step = self.step()
            slot = self.fraction * step if step is not None else 0.0
            self._open_until = now + slot
            self.slots += 1
            self._cv.notify_all()
            return slot

    def pause(self, now: float) -> None:
        """The step in flight failed at ``now`` (a member lost): close the open slot; none opens until the
        retried step commits. The recovery (the failed collectives' votes, the survivors' new quorum and its
        gloo connect) and the retried step then have the link to themselves, as an admission has; a chunk
        already asked for (one a source, :data:`PACED_CHUNK`) still comes. The retried step's commit measures
        from here (one recovery and one step): a failure's gap does not enter the step's median as a step.
        Once per failed step: a second call before the next step begins (:meth:`step_begun`; the discard verdict
        of the failure already recorded) changes nothing."""
        with self._cv:
            if self._paused:   # the same failure told twice (its first record, then its discard verdict)
                return
            self._paused = True
            self._open_until = min(self._open_until, now)
            if self._last is not None:
                self._last = now
            self.pauses += 1

    def step_begun(self) -> None:
        """A step began (the retried one, or the next): a failure of it pauses the download again."""
        with self._cv:
            self._paused = False

    def release(self) -> None:
        """No pace from now on (the worker leaves and waits for its download, or the download was given up)."""
        with self._cv:
            self._free = True
            self._cv.notify_all()

    def slot_left(self, now: float) -> float:
        """Seconds left in the open slot at ``now`` (0.0: wait for the next commit; inf: released)."""
        if self._free:
            return float("inf")
        return max(0.0, self._open_until - now)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a slot is open by ``clock`` (or the pace is released); False if ``timeout`` (real
        seconds) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.slot_left(self.clock()) <= 0.0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)   # a commit or a release opens a slot, and both notify
            return True
