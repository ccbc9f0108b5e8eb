"""Progress of a collaborative run, shared through the coordinator's store.

Keys under ``<run_id>/``:

- ``samples/<epoch>``: an atomic counter that every peer adds its batch to at
  each step. The value ``add`` returns is the swarm's exact sample count for
  that epoch, so the target is detected without estimates and with one store
  round trip per step.
- ``progress/<member>``: one record per peer (epoch, whether it holds the
  swarm's state or is fresh, samples this epoch, samples/s moving average,
  wall time, role), rewritten at most every ``interval`` seconds and at each
  epoch change, signed by its writer (:mod:`shoal.collaborative.records`).

The swarm's epoch is not a value anyone can simply write: it is the highest
epoch that a strict majority of the live *settled* peers (those that hold the
swarm's state, not fresh joiners) have reached, read from their signed
records. One peer claiming an epoch far ahead therefore cannot move it as
long as the honest settled peers are a majority, and a forged record (no
valid MAC) is not counted at all. A claim only one settled peer makes (at the
start of a run, everyone else is fresh) is reported with its single witness:
the optimizer does not jump to it on that alone; see "Threat model" in
docs/collaborative.md.

Example::

    tracker = ProgressTracker(store, "run1", member_id=3, target=4096, book=RecordBook(store, "run1", 3, token),
                              settled=lambda: True)
    tracker.on_step(64, epoch=0, local_samples=64)
    view = tracker.swarm(members=[1, 2, 3])
    print(view.num_peers, view.samples, view.eta_seconds)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shoal.collaborative.records import RecordBook


class ThroughputEMA:
    """Samples per second as an exponential moving average of per-step rates.

    The first step only starts the clock; pauses longer than ``max_gap``
    (waiting for an averaging round, loading state) are not counted as
    compute time.

    >>> ema = ThroughputEMA(alpha=0.5)
    >>> ema.update(10, now=0.0); ema.update(10, now=1.0); ema.update(10, now=2.0)
    >>> round(ema.rate, 1)
    10.0
    """

    def __init__(self, alpha: float = 0.1, max_gap: float = 30.0) -> None:
        self.alpha, self.max_gap = alpha, max_gap
        self.rate = 0.0
        self._last: float | None = None

    def update(self, samples: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is not None:
            dt = now - self._last
            if 0 < dt <= self.max_gap:
                r = samples / dt
                self.rate = r if self.rate == 0 else (1 - self.alpha) * self.rate + self.alpha * r
        self._last = now

    def pause(self) -> None:
        """The next step's interval includes a wait, not compute: do not count it."""
        self._last = None


@dataclass(frozen=True)
class SwarmProgress:
    """The global view of a run (what hivemind calls the global progress).

    Attributes:
        epoch: the highest epoch a strict majority of the live settled peers reached.
        samples: samples the swarm accumulated for ``epoch`` so far.
        target: samples per epoch.
        num_peers: peers alive now (computing or auxiliary).
        samples_per_second: sum of the peers' recent throughputs.
        eta_seconds: estimated seconds until the swarm reaches the target.
    """

    epoch: int
    samples: int
    target: int
    num_peers: int
    samples_per_second: float
    eta_seconds: float


def majority_epoch(records: dict[int, dict[str, Any]]) -> tuple[int, int]:
    """The highest epoch a strict majority of the settled records reached, and how many reached it.

    ``(0, 0)`` if no record is settled. The count (the claim's witnesses) tells a lone claim,
    which nobody else confirms, from one that two or more peers make.

    >>> majority_epoch({1: {"epoch": 5, "settled": True}, 2: {"epoch": 10**9, "settled": True}})
    (5, 2)
    >>> majority_epoch({1: {"epoch": 5, "settled": True}, 2: {"epoch": 5, "settled": True},
    ...                 3: {"epoch": 10**9, "settled": True}, 4: {"epoch": 0, "settled": False}})
    (5, 3)
    >>> majority_epoch({1: {"epoch": 10**9, "settled": True}, 2: {"epoch": 0, "settled": False}})
    (1000000000, 1)
    """
    epochs = sorted((int(r["epoch"]) for r in records.values()
                     if r.get("settled") is True and isinstance(r.get("epoch"), int)
                     and not isinstance(r.get("epoch"), bool) and r["epoch"] >= 0), reverse=True)
    if not epochs:
        return 0, 0
    e = epochs[len(epochs) // 2]    # reached by the len//2 + 1 highest: a strict majority
    return e, sum(1 for x in epochs if x >= e)


class ProgressTracker:
    """This peer's progress reports and the swarm's view (see the module docstring)."""

    def __init__(self, store: Any, run_id: str, member_id: int, target: int, book: RecordBook,
                 interval: float = 0.5, role: str = "peer", settled: Callable[[], bool] = lambda: True) -> None:
        self.store, self.run_id, self.member_id, self.target = store, run_id, member_id, target
        self.book, self.interval, self.role = book, interval, role
        self.settled = settled    # whether this peer holds the swarm's state (not a fresh joiner)
        self.ema = ThroughputEMA()
        self._published = 0.0
        self._epoch_published = -1

    def key(self, k: str) -> str:
        return f"{self.run_id}/{k}"

    def add_samples(self, epoch: int, n: int) -> int:
        """Add ``n`` samples to ``epoch``; the swarm's total for it (exact)."""
        return int(self.store.add(self.key(f"samples/{epoch}"), n))

    def global_epoch(self, members: Sequence[int]) -> tuple[int, int]:
        """The swarm's epoch (the highest a strict majority of the settled ``members`` reached) and its witnesses."""
        return majority_epoch(self.records(members))

    def on_step(self, samples: int, epoch: int, local_samples: int, force: bool = False) -> None:
        """Record a step; publish this peer's record if ``interval`` passed or the epoch changed."""
        self.ema.update(samples)
        now = time.time()
        if force or epoch != self._epoch_published or now - self._published >= self.interval:
            rec = {"epoch": epoch, "settled": bool(self.settled()), "samples": local_samples,
                   "sps": round(self.ema.rate, 3), "t": now, "role": self.role}
            self.store.set(self.key(f"progress/{self.member_id}"), self.book.seal(rec))
            self._published, self._epoch_published = now, epoch

    def records(self, members: Sequence[int]) -> dict[int, dict[str, Any]]:
        """The latest verified record of each member that has published one (forged ones are dropped)."""
        keys = [self.key(f"progress/{m}") for m in members]
        have = [m for m, k in zip(members, keys) if self.store.check([k])]
        if not have:
            return {}
        raw = self.store.multi_get([self.key(f"progress/{m}") for m in have])
        out: dict[int, dict[str, Any]] = {}
        for m, r in zip(have, raw):
            rec = self.book.open(r, writer=m, kind="progress")
            if rec is not None:
                out[m] = rec
        return out

    def swarm(self, members: Sequence[int]) -> SwarmProgress:
        """The global view over ``members`` (the coordinator's live peers)."""
        recs = self.records(members)
        epoch, _ = majority_epoch(recs)
        samples = int(self.store.add(self.key(f"samples/{epoch}"), 0))
        now = time.time()
        sps = sum(float(r.get("sps", 0.0)) for r in recs.values()
                  if isinstance(r.get("sps"), (int, float)) and now - float(r.get("t", 0)) < 60)
        left = max(self.target - samples, 0)
        eta = 0.0 if left == 0 else (left / sps if sps > 0 else float("inf"))
        return SwarmProgress(epoch, samples, self.target, len(members), sps, eta)
