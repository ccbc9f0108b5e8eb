"""Exact accounting of what each rank puts on the wire.

For every collective the meter records two things:

* ``payload_bytes``: the bytes this rank handed to the collective (its input
  tensor's ``numel * element_size``). This is exact and independent of how the
  backend moves the data.
* ``bytes_sent`` / ``bytes_received``: the bytes this rank sends and receives
  under the collective's textbook algorithm (:func:`wire_bytes`), e.g.
  ``2(N-1)/N * S`` for a ring all-reduce of ``S`` bytes over ``N`` ranks.
  Interface counters (``shoal run`` on an emulated cluster) measure what the
  backend really sent; the two agree within the backend's framing overhead.

Counters are kept per *tag*, a slash-separated name such as ``"ddp/grad"`` or
``"ddp/buffers"``, so traffic can be split by kind and by codec.

Example:
    >>> m = Meter()
    >>> m.record("ddp/grad", "all_reduce", payload=400, group_size=4, rank=0)
    >>> m.counters().bytes_sent
    600
    >>> m.counters("ddp").payload_bytes
    400
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields

# Ops whose wire cost the meter knows. Anything else is a programming error.
_OPS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "reduce", "reduce_scatter", "barrier", "send", "recv")


def _binomial_children(rel_rank: int, n: int) -> int:
    """Number of children of ``rel_rank`` in a binomial broadcast tree of n."""
    count = 0
    step = 1
    # A rank r receives from r - 2^k where 2^k is r's highest bit, and sends to
    # r + 2^j for every 2^j above its highest bit (while < n).
    while step <= rel_rank:
        step <<= 1
    while rel_rank + step < n:
        count += 1
        step <<= 1
    return count


def wire_bytes(op: str, payload: int, group_size: int, rank: int = 0, root: int = 0) -> tuple[int, int]:
    """Bytes ``(sent, received)`` by ``rank`` for one collective.

    ``payload`` is the size in bytes of this rank's input: the tensor reduced
    (all_reduce, reduce_scatter's full input), the tensor contributed
    (all_gather), the tensor broadcast, or all_to_all's whole input (``N``
    equal chunks, chunk ``r`` for rank ``r``). Models: ring all-reduce
    (reduce-scatter + all-gather), ring all-gather and reduce-scatter, direct
    pairwise exchange for all-to-all (each rank sends the ``N - 1`` chunks
    that are not its own and receives as many), and a binomial tree for
    broadcast and reduce.

    >>> wire_bytes("all_reduce", 1000, 4)
    (1500, 1500)
    >>> wire_bytes("all_gather", 1000, 4)
    (3000, 3000)
    >>> wire_bytes("all_to_all", 1000, 4)
    (750, 750)
    """
    if op not in _OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {_OPS}")
    n = group_size
    if n <= 1 or op == "barrier":
        return 0, 0
    if op in ("send", "recv"):      # point to point: the payload leaves or arrives once
        return (payload, 0) if op == "send" else (0, payload)
    if op == "all_reduce":
        b = 2 * (n - 1) * payload // n
        return b, b
    if op == "all_gather":
        b = (n - 1) * payload
        return b, b
    if op in ("reduce_scatter", "all_to_all"):
        b = (n - 1) * payload // n
        return b, b
    rel = (rank - root) % n
    down = _binomial_children(rel, n) * payload
    up = 0 if rel == 0 else payload
    # broadcast flows root -> leaves; reduce flows leaves -> root.
    return (down, up) if op == "broadcast" else (up, down)


@dataclass(frozen=True)
class CommCounters:
    """Totals of communication for one tag, one step, or a whole run.

    ``wait_seconds`` is the time the training thread spent blocked on
    communication (exposed communication), not the time the network was busy.
    ``nonfinite_skips`` counts steps that every rank skipped together because
    some rank's gradients (or the mean it received) held NaN/Inf (SPEC G5).
    """

    ops: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    nonfinite_skips: int = 0

    def __add__(self, other: "CommCounters") -> "CommCounters":
        return CommCounters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "CommCounters") -> "CommCounters":
        return CommCounters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class CommStats:
    """Communication of the last step and since the start (or last reset).

    Example:
        >>> s = CommStats(last=CommCounters(ops=1), total=CommCounters(ops=5))
        >>> s.total.ops
        5
    """

    last: CommCounters
    total: CommCounters

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {"last": self.last.as_dict(), "total": self.total.as_dict()}


class Meter:
    """Thread-safe per-tag counters of collectives (see module docstring).

    Future callbacks of collectives may run on backend threads, so every update
    takes a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tag: dict[str, CommCounters] = {}

    def record(self, tag: str, op: str, payload: int, group_size: int, rank: int = 0, root: int = 0) -> None:
        """Count one collective of ``payload`` bytes issued by this rank."""
        sent, received = wire_bytes(op, payload, group_size, rank, root)
        self._add(tag, CommCounters(1, payload, sent, received, 0.0))

    def add_wait(self, tag: str, seconds: float) -> None:
        """Count ``seconds`` the caller blocked on communication under ``tag``."""
        self._add(tag, CommCounters(wait_seconds=seconds))

    def add_nonfinite_skip(self, tag: str) -> None:
        """Count one step skipped under ``tag`` because of NaN/Inf gradients."""
        self._add(tag, CommCounters(nonfinite_skips=1))

    def _add(self, tag: str, delta: CommCounters) -> None:
        with self._lock:
            self._by_tag[tag] = self._by_tag.get(tag, CommCounters()) + delta

    def counters(self, prefix: str = "") -> CommCounters:
        """Sum over tags equal to ``prefix`` or below it (``"ddp"`` matches ``"ddp/grad"``)."""
        total = CommCounters()
        with self._lock:
            for tag, c in self._by_tag.items():
                if not prefix or tag == prefix or tag.startswith(prefix + "/"):
                    total = total + c
        return total

    def by_tag(self) -> dict[str, CommCounters]:
        """A copy of the per-tag counters."""
        with self._lock:
            return dict(self._by_tag)

    def reset(self) -> None:
        with self._lock:
            self._by_tag.clear()


class StepMeter:
    """Turns a meter's running totals into per-step and cumulative stats.

    Call :meth:`mark_step` once per training step; :meth:`stats` then reports
    the counters of the last complete step and the totals since construction.

    Example:
        >>> m = Meter(); sm = StepMeter(m, "ddp")
        >>> m.record("ddp/grad", "all_reduce", 100, 2)
        >>> sm.mark_step(); sm.stats().last.bytes_sent
        100
    """

    def __init__(self, meter: Meter, prefix: str) -> None:
        self.meter = meter
        self.prefix = prefix
        self._start = meter.counters(prefix)
        self._at_last_mark = self._start
        self._last = CommCounters()

    def mark_step(self) -> None:
        now = self.meter.counters(self.prefix)
        self._last = now - self._at_last_mark
        self._at_last_mark = now

    def stats(self) -> CommStats:
        return CommStats(last=self._last, total=self.meter.counters(self.prefix) - self._start)
