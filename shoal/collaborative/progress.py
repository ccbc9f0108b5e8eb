"""Progress of a collaborative run, shared through the coordinator's store.

Keys under ``<run_id>/``:

- ``samples/<epoch>``: an atomic counter that every peer adds its batch to at
  each step. The value ``add`` returns is the swarm's exact sample count for
  that epoch, so the target is detected without estimates and with one store
  round trip per step.
- ``epoch``: the highest epoch any peer reached (raised with compare-and-set, never lowered).
- ``progress/<member>``: one JSON record per peer (epoch, samples this epoch,
  samples/s moving average, wall time, role), rewritten at most every
  ``interval`` seconds and at each epoch change.

Example::

    tracker = ProgressTracker(store, "run1", member_id=3, target=4096)
    tracker.on_step(64, epoch=0)
    view = tracker.swarm(members=[1, 2, 3], epoch=0)
    print(view.num_peers, view.samples, view.eta_seconds)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Sequence


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
        epoch: the highest epoch any peer reached.
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


class ProgressTracker:
    """This peer's progress reports and the swarm's view (see the module docstring)."""

    def __init__(self, store: Any, run_id: str, member_id: int, target: int, interval: float = 0.5,
                 role: str = "peer") -> None:
        self.store, self.run_id, self.member_id, self.target = store, run_id, member_id, target
        self.interval, self.role = interval, role
        self.ema = ThroughputEMA()
        self._published = 0.0
        self._epoch_published = -1

    def key(self, k: str) -> str:
        return f"{self.run_id}/{k}"

    def add_samples(self, epoch: int, n: int) -> int:
        """Add ``n`` samples to ``epoch``; the swarm's total for it (exact)."""
        return int(self.store.add(self.key(f"samples/{epoch}"), n))

    def global_epoch(self) -> int:
        k = self.key("epoch")
        if not self.store.check([k]):
            return 0
        return int(_s(self.store.get(k)))

    def raise_epoch(self, epoch: int) -> None:
        """Make the global epoch at least ``epoch`` (compare-and-set: monotone under races)."""
        k = self.key("epoch")
        while True:
            exists = self.store.check([k])
            cur = int(_s(self.store.get(k))) if exists else 0
            if cur >= epoch:
                return
            after = int(_s(self.store.compare_set(k, str(cur) if exists else "", str(epoch))))
            if after >= epoch:
                return

    def on_step(self, samples: int, epoch: int, local_samples: int, force: bool = False) -> None:
        """Record a step; publish this peer's record if ``interval`` passed or the epoch changed."""
        self.ema.update(samples)
        now = time.time()
        if force or epoch != self._epoch_published or now - self._published >= self.interval:
            rec = {"epoch": epoch, "samples": local_samples, "sps": round(self.ema.rate, 3), "t": now,
                   "role": self.role}
            self.store.set(self.key(f"progress/{self.member_id}"), json.dumps(rec))
            self._published, self._epoch_published = now, epoch

    def records(self, members: Sequence[int]) -> dict[int, dict[str, Any]]:
        """The latest record of each member that has published one."""
        keys = [self.key(f"progress/{m}") for m in members]
        have = [m for m, k in zip(members, keys) if self.store.check([k])]
        if not have:
            return {}
        raw = self.store.multi_get([self.key(f"progress/{m}") for m in have])
        out: dict[int, dict[str, Any]] = {}
        for m, r in zip(have, raw):
            try:
                out[m] = json.loads(_s(r))
            except ValueError:
                continue   # a malformed record is ignored, not trusted
        return out

    def swarm(self, members: Sequence[int]) -> SwarmProgress:
        """The global view over ``members`` (the coordinator's live peers)."""
        epoch = self.global_epoch()
        samples = int(self.store.add(self.key(f"samples/{epoch}"), 0))
        recs = self.records(members)
        now = time.time()
        sps = sum(float(r.get("sps", 0.0)) for r in recs.values()
                  if isinstance(r.get("sps"), (int, float)) and now - float(r.get("t", 0)) < 60)
        left = max(self.target - samples, 0)
        eta = 0.0 if left == 0 else (left / sps if sps > 0 else float("inf"))
        return SwarmProgress(epoch, samples, self.target, len(members), sps, eta)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
