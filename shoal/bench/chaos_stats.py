"""Per-kill and per-join figures of the chaos bench (:mod:`shoal.bench.chaos`), computed from its step logs.

Pure functions over what the workers log (no clock of their own, so they are
unit-tested on made-up logs). A worker's log is a list of entries: one
``{"event": "joined", "t", "started", "pid", ...}`` when it is ready to join,
then one ``{"t", "dt", "step", "discards", ...}`` per optimizer step, where
``discards`` counts the rounds the step had to re-run (0: the step's work
stands as it was done). A *committed* step below is one with ``discards == 0``.

- **stall per kill**: for every worker alive at the kill (a survivor), the
  gap between its last committed step before the kill and its first
  committed step after it, minus the run's median step; the kill's figure is
  the largest over its survivors (DDP's survivors stall together). It is
  the step in flight, its detection, the new quorum and the retried step.
- **stall per join**: for the restarted incarnation's admission, every
  survivor's longest gap between committed steps that ends between the
  newcomer being ready to join (its ``joined`` entry) and its first committed
  step (plus one median step, as the survivors log the same step a little
  apart), and that starts after the survivor's recovery from the kill (that gap
  is the kill's); minus the median step; the largest over the survivors.
  ``first_commit_s``: the newcomer's process start to its first committed step.
- **goodput**: committed samples per second of training (the run's start to
  the last worker's ``done`` entry: a worker's leave, or a restart that came
  too late to be admitted, is not training); the chaos run's
  divided by the fault-free run's (same model, steps and seed) is the
  fraction of throughput that survives the faults. Work a killed worker did
  since its last averaging round (``lost`` local steps) does not count.

Example::

    >>> logs = {(0, 0): [{"event": "joined", "t": 0.0, "started": 0.0, "pid": 1},
    ...                  {"t": 1.0, "dt": 1.0, "discards": 0}, {"t": 2.0, "dt": 1.0, "discards": 0},
    ...                  {"t": 6.0, "dt": 4.0, "discards": 1}, {"t": 7.0, "dt": 1.0, "discards": 0}]}
    >>> kill_stalls(logs, [{"t": 2.5, "rank": 1, "life": 0, "survivors": [1]}], median=1.0)[0]["stall_s"]
    4.0
    >>> goodput(logs, samples_per_step=8, wall=8.0)   # 3 committed steps of 8 samples in 8 s
    3.0
"""

from __future__ import annotations

import statistics
from typing import Any

Logs = dict[tuple[int, int], list[dict[str, Any]]]   # (rank, life) -> that incarnation's log


def committed_times(log: list[dict[str, Any]]) -> list[float]:
    """When the incarnation logged each committed step (see the module docstring), in order."""
    return sorted(e["t"] for e in log if "dt" in e and not e["discards"])


def median_step(logs: Logs) -> float:
    """The median duration of a committed step over the whole run (0.0 without any)."""
    dts = [e["dt"] for lg in logs.values() for e in lg if "dt" in e and not e["discards"]]
    return statistics.median(dts) if dts else 0.0


def _by_pid(logs: Logs) -> dict[int, list[float]]:
    out = {}
    for lg in logs.values():
        pid = next((e["pid"] for e in lg if e.get("event") == "joined"), None)
        if pid is not None:
            out[pid] = committed_times(lg)
    return out


def _first_after(ts: list[float], t: float) -> float | None:
    return next((x for x in ts if x > t), None)


def kill_stalls(logs: Logs, kills: list[dict[str, Any]], median: float) -> list[dict[str, Any]]:
    """Per kill: ``stall_s`` (largest over the survivors) and the survivors measured (``n``)."""
    times, out = _by_pid(logs), []
    for k in kills:
        gaps = []
        for pid in k["survivors"]:
            ts = times.get(pid, [])
            before = [x for x in ts if x <= k["t"]]
            after = _first_after(ts, k["t"])
            if before and after is not None:
                gaps.append(after - before[-1])
        out.append({"rank": k["rank"], "life": k["life"], "n": len(gaps),
                    "stall_s": round(max(gaps) - median, 3) if gaps else None})
    return out


def join_stalls(logs: Logs, kills: list[dict[str, Any]], median: float) -> list[dict[str, Any]]:
    """Per restarted incarnation that committed a step: ``stall_s`` (survivors' largest) and ``first_commit_s``."""
    times, out = _by_pid(logs), []
    for k in kills:
        new = logs.get((k["rank"], k["life"] + 1), [])
        joined = next((e for e in new if e.get("event") == "joined"), None)
        mine = committed_times(new)
        if joined is None or not mine:
            continue
        ready, first = joined["t"], mine[0]
        gaps = []
        for pid in k["survivors"]:
            ts = times.get(pid, [])
            recovered = _first_after(ts, k["t"])   # the end of the kill's gap
            if recovered is None:
                continue
            gaps += [b - a for a, b in zip(ts, ts[1:]) if a >= recovered and ready <= b <= first + median]
        out.append({"rank": k["rank"], "life": k["life"] + 1, "first_commit_s": round(first - joined["started"], 3),
                    "stall_s": round(max(gaps) - median, 3) if gaps else None})
    return out


def goodput(logs: Logs, samples_per_step: int, wall: float, lost: int = 0) -> float:
    """Committed samples per second: every incarnation's committed steps, less ``lost`` local steps."""
    n = sum(len(committed_times(lg)) for lg in logs.values()) - lost
    return samples_per_step * n / wall if wall > 0 else 0.0


def trained_s(logs: Logs, began: float, wall: float) -> float:
    """Seconds from ``began`` (the run's start, wall clock) to the last ``done`` entry; ``wall`` if none."""
    ends = [e["t"] for lg in logs.values() for e in lg if e.get("event") == "done"]
    return max(ends) - began if ends else wall


def spread(values: list[float | None]) -> dict[str, float | int]:
    """``{"n", "median", "max"}`` of the values that are not None (``{"n": 0}`` if none)."""
    v = sorted(x for x in values if x is not None)
    return {"n": len(v), "median": round(statistics.median(v), 3), "max": round(v[-1], 3)} if v else {"n": 0}
