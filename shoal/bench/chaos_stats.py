"""Per-kill and per-join figures of the chaos bench (:mod:`shoal.bench.chaos`), computed from its step logs.

Pure functions over what the workers log (no clock of their own, so they are
unit-tested on made-up logs). A worker's log is a list of entries: one
``{"event": "joined", "t", "started", "pid", ...}`` when it is ready to join,
then one ``{"t", "dt", "step", "discards", ...}`` per optimizer step, where
``step`` is the worker's step counter after it (committed steps for DDP,
local steps for LocalSGD and DiLoCo) and ``discards`` counts the rounds the
step had to re-run; a step logged with ``contributes: false`` (a joiner not
contributing yet) makes no progress. A step *made progress* when its counter advanced (a
discarded DDP step did not; a DiLoCo local step whose averaging round was
re-run with the survivors did, its work stands).

- **stall per kill**: for every worker alive at the kill (a survivor), the
  gap between its last step that made progress before the kill's failure
  (its first step after the kill with ``discards > 0``: the discarded DDP
  step, or the local step whose round was re-run, which for DiLoCo may come
  many steps after the kill) and its first one from that failure on, minus the
  run's median step; without such a failure before the next kill, the gap
  across the kill itself. The kill's figure is the largest over its
  survivors. It is the step in flight, the detection, the new quorum and the
  retried step (and whatever else that retry waited for: the restarted
  worker's admission, if it came in the same round). ``beyond_in_flight_s``
  takes from each survivor's gap what its step in flight had run when the
  kill struck (:func:`in_flight`; that work is lost, and the issue allows
  it): what the kill cost beyond the step in flight.
- **stall per join**: for the restarted incarnation's admission, every
  survivor's longest gap between steps that made progress that ends between
  the newcomer being ready to join (its ``joined`` entry) and its first step
  (plus one median step, as the survivors log the same step a little
  apart), and that starts after the kill's gap; minus the median step; the
  largest over the survivors. ``first_commit_s``: the newcomer's process
  start to its first step. With a background heal that window runs to the
  newcomer's first *contributing* step, many steps after its admission, and
  often holds another kill's stall; two figures split it:
- **stall at admission** (:func:`admission_stalls`, issue #20's "stall per
  join"): the survivors' gap that committed the round admitting the
  newcomer (its first logged step, zero weight or not), and no other.
- **the download's cost** (:func:`download_costs`): the seconds the
  survivors' clean steps between the admission and the first contribution
  took beyond a median step, summed.
Example::

    >>> logs = {(0, 0): [{"event": "joined", "t": 0.0, "started": 0.0, "pid": 1},
    ...                  {"t": 1.0, "dt": 1.0, "step": 1, "discards": 0},
    ...                  {"t": 2.0, "dt": 1.0, "step": 2, "discards": 0},
    ...                  {"t": 6.0, "dt": 4.0, "step": 2, "discards": 1},     # discarded: no progress
    ...                  {"t": 7.0, "dt": 1.0, "step": 3, "discards": 0}]}
    >>> k = kill_stalls(logs, [{"t": 2.5, "rank": 1, "life": 0, "survivors": [1]}], median=1.0)[0]
    >>> k["stall_s"], k["beyond_in_flight_s"]   # the step in flight at the kill had run 0.5 s
    (4.0, 3.5)
    >>> goodput(logs, samples_per_step=8, wall=8.0)   # 3 committed steps of 8 samples in 8 s
    3.0
"""

from __future__ import annotations

import statistics
from typing import Any

Logs = dict[tuple[int, int], list[dict[str, Any]]]   # (rank, life) -> that incarnation's log


def progress_steps(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incarnation's entries of the steps that made progress (see the module docstring), in order.

    A restart's steps logged ``early`` (trained from the survivors' state before its admission, counted on its
    own step counter) made progress only if the round that admitted it took them: the last ``kept`` of them
    (its ``early`` event; those since it last loaded, none if they were dropped), at that round (their entries
    here carry its time); killed before that, they did not.
    """
    kept = max((int(e.get("kept", 0)) for e in log if e.get("event") == "early"), default=0)
    early = [i for i, e in enumerate(log) if "dt" in e and e.get("early")]
    taken = set(early[len(early) - kept:]) if kept else set()
    out, last, was_early = [], None, False
    admitted = next((e["t"] for e in log if "dt" in e and not e.get("early")), None)
    for i, e in enumerate(log):
        if "dt" in e:
            if e.get("early") and i not in taken:
                continue
            if e.get("early"):   # committed by the round that admitted it: then, not when it was trained
                e = {**e, "t": admitted}
            # ``contributes: false``: a joiner still catching up in the background (its steps carry zero
            # weight); its own progress starts with its first contributing step. The admission after early
            # steps moves the counter to the survivors' (the step it trained in is in that round).
            advanced = last is None or e["step"] > last or (was_early and not e.get("early"))
            if advanced and e.get("contributes", True):
                out.append(e)
            last, was_early = e["step"], bool(e.get("early"))
    return out


def committed_times(log: list[dict[str, Any]]) -> list[float]:
    """When the incarnation logged each step that made progress (see the module docstring), in order."""
    return [e["t"] for e in progress_steps(log)]


def median_step(logs: Logs) -> float:
    """The median duration of a step without a re-run round over the whole run (0.0 without any)."""
    dts = [e["dt"] for lg in logs.values() for e in lg if "dt" in e and not e["discards"]]
    return statistics.median(dts) if dts else 0.0


def median_round_step(logs: Logs) -> float:
    """The median duration of a step that committed a round of the group (its ``round`` advanced) and
    was not re-run: every DDP step; a DiLoCo worker's inner step that ran an outer round. The
    baseline of the round that admits a joiner (:func:`admission_stalls`); 0.0 without any."""
    dts = []
    for lg in logs.values():
        last = None
        for e in progress_steps(lg):
            if last is not None and e["round"] > last and not e["discards"]:
                dts.append(e["dt"])
            last = e["round"]
    return statistics.median(dts) if dts else 0.0


def _by_pid(logs: Logs) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for lg in logs.values():
        pid = next((e["pid"] for e in lg if e.get("event") == "joined"), None)
        if pid is not None:
            out[pid] = lg
    return out


def _kill_gap(log: list[dict[str, Any]], t_kill: float, until: float) -> tuple[float, float] | None:
    """The survivor's gap (start, end) that the kill cost it (see the module docstring), or None."""
    ts = committed_times(log)
    pivot = next((e["t"] for e in log if "dt" in e and e["discards"] and t_kill < e["t"] < until), None)
    if pivot is None:
        before, after = [x for x in ts if x <= t_kill], [x for x in ts if x > t_kill]
    else:
        before, after = [x for x in ts if x < pivot], [x for x in ts if x >= pivot]
    return (before[-1], after[0]) if before and after else None


def _until(kills: list[dict[str, Any]], n: int) -> float:
    return kills[n + 1]["t"] if n + 1 < len(kills) else float("inf")


def in_flight(log: list[dict[str, Any]], t_kill: float) -> float:
    """How long the survivor's step in flight at the kill had run when the kill struck: from the start of its
    logged step whose span holds ``t_kill`` (``t - dt``, discarded or not) to the kill; 0.0 if none does (the
    kill fell between two steps)."""
    e = next((e for e in log if "dt" in e and e["t"] > t_kill), None)
    return max(0.0, t_kill - (e["t"] - e["dt"])) if e is not None else 0.0


def kill_stalls(logs: Logs, kills: list[dict[str, Any]], median: float) -> list[dict[str, Any]]:
    """Per kill: ``stall_s`` (largest over the survivors), ``beyond_in_flight_s`` (the largest over the
    survivors of each one's stall less its step in flight's time at the kill, :func:`in_flight`: issue #20's
    "a kill costs at most the step in flight + 2 s" asks this to be at most 2 s) and the survivors measured
    (``n``)."""
    by_pid, out = _by_pid(logs), []
    for n, k in enumerate(kills):
        gaps = [(g[1] - g[0], in_flight(log, k["t"])) for pid in k["survivors"] for log in [by_pid.get(pid, [])]
                if (g := _kill_gap(log, k["t"], _until(kills, n))) is not None]
        out.append({"rank": k["rank"], "life": k["life"], "n": len(gaps),
                    "stall_s": round(max(g for g, _ in gaps) - median, 3) if gaps else None,
                    "beyond_in_flight_s": round(max(g - f for g, f in gaps) - median, 3) if gaps else None})
    return out


def join_stalls(logs: Logs, kills: list[dict[str, Any]], median: float) -> list[dict[str, Any]]:
    """Per restarted incarnation that made progress: ``stall_s`` (survivors' largest) and ``first_commit_s``."""
    by_pid, out = _by_pid(logs), []
    for n, k in enumerate(kills):
        new = logs.get((k["rank"], k["life"] + 1), [])
        joined = next((e for e in new if e.get("event") == "joined"), None)
        mine = committed_times(new)
        if joined is None or not mine:
            continue
        ready, first = joined["t"], mine[0]
        gaps = []
        for pid in k["survivors"]:
            log = by_pid.get(pid, [])
            kill_gap = _kill_gap(log, k["t"], _until(kills, n))
            if kill_gap is None:
                continue
            ts = committed_times(log)
            gaps += [b - a for a, b in zip(ts, ts[1:]) if a >= kill_gap[1] and ready <= b <= first + median]
        out.append({"rank": k["rank"], "life": k["life"] + 1, "first_commit_s": round(first - joined["started"], 3),
                    "stall_s": round(max(gaps) - median, 3) if gaps else None})
    return out


def _restart(logs: Logs, k: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], float | None] | None:
    """The kill's restart: its ``joined`` entry, its first logged step (it is in the quorum from then,
    zero weight or not) and its first contributing step's time (None if it never contributed); None if
    it logged no step."""
    new = logs.get((k["rank"], k["life"] + 1), [])
    joined = next((e for e in new if e.get("event") == "joined"), None)
    first = next((e for e in new if "dt" in e and not e.get("early")), None)   # (early: before its admission)
    if joined is None or first is None:
        return None
    return joined, first, next((e["t"] for e in progress_steps(new)), None)


def _kill_gaps(log: list[dict[str, Any]], kills: list[dict[str, Any]], pid: int) -> list[tuple[float, float]]:
    """Every kill's gap (see the module docstring) in the log of ``pid``, for the kills it survived."""
    return [g for n, k in enumerate(kills)
            if pid in k["survivors"] and (g := _kill_gap(log, k["t"], _until(kills, n))) is not None]


def _admission_gap(log: list[dict[str, Any]], first: dict[str, Any]) -> tuple[float, float] | None:
    """The survivor's gap (start, end) between steps that made progress that admitted the joiner whose
    first logged step is ``first``: it ends at the survivor's first such step of that step's round
    (``round``, the group's committed rounds, equal on every member), or of the next one if that
    first step was discarded (its round then committed later)."""
    target, prev = first["round"] + (1 if first["discards"] else 0), None
    for e in progress_steps(log):
        if e["round"] >= target:
            return (prev, e["t"]) if prev is not None else None
        prev = e["t"]
    return None


def admission_stalls(logs: Logs, kills: list[dict[str, Any]], median: float) -> list[dict[str, Any]]:
    """Per restart that logged a step: the survivors' stall at its admission (issue #20's stall per join).

    The admission is the restart's first logged step, zero weight or not (it is in the quorum from then).
    ``admission_stall_s``: for every survivor of the kill, its gap between steps that made progress
    that spans that admission: from its last such step before the round that admitted the restart to
    the one that committed that round (for DDP the step it logged with the restart's first step, or,
    if that step failed, its re-run; for DiLoCo the outer round that admitted the restart, which ends
    just before the restart's ``joined`` entry). A gap that overlaps the kill's own gap is that kill's
    stall (per kill), not the join's, and is left out (as in :func:`join_stalls`). The longest such
    gap over the survivors, minus ``median`` (None if none is left). Unlike :func:`join_stalls`, the
    gaps while the restart downloads in the background are not in it (see :func:`download_costs`).
    ``kill_in_gap``: whether that gap holds a kill or overlaps a later kill's gap, i.e. the figure is
    also a kill's stall; ``in_own_kill_gap``: the figure is None because the restart was admitted in its
    own kill's gap (e.g. the re-run of the round that the kill broke). With ``median`` the median
    step (:func:`median_step`) this is issue #20's figure as written; with :func:`median_round_step`
    it is what the admission added to the round that admitted the joiner (the same for DDP, whose
    every step is a round; for DiLoCo the outer round is then the baseline, not a stall).
    Example (the gap 3.0 -> 7.0 of round 3 admits it)::

        >>> steps = lambda pid, ts: [{"event": "joined", "t": 0.0, "started": 0.0, "pid": pid}] + [
        ...     {"t": t, "dt": 1.0, "step": i, "round": i, "discards": 0} for i, t in enumerate(ts)]
        >>> logs = {(0, 0): steps(1, [1.0, 2.0, 3.0, 7.0, 8.0]), (1, 0): steps(2, [1.0]),
        ...         (1, 1): [{"event": "joined", "t": 6.0, "started": 4.0, "pid": 3},
        ...                  {"t": 7.0, "dt": 1.0, "step": 3, "round": 3, "discards": 0, "contributes": False}]}
        >>> admission_stalls(logs, [{"t": 1.5, "rank": 1, "life": 0, "survivors": [1]}], median=1.0)
        [{'rank': 1, 'life': 1, 'admission_stall_s': 3.0, 'kill_in_gap': False, 'in_own_kill_gap': False}]
    """
    by_pid, out = _by_pid(logs), []
    for n, k in enumerate(kills):
        got = _restart(logs, k)
        if got is None:
            continue
        best: tuple[float, bool] | None = None
        in_own = False
        for pid in k["survivors"]:
            log = by_pid.get(pid, [])
            gap, own = _admission_gap(log, got[1]), _kill_gap(log, k["t"], _until(kills, n))
            if gap is None or (own is not None and gap[0] < own[1] and own[0] < gap[1]):
                in_own = in_own or gap is not None
                continue
            a, b = gap
            if best is None or b - a > best[0]:
                hit = any(a < kk["t"] < b for kk in kills) or any(
                    g0 < b and a < g1 for g0, g1 in _kill_gaps(log, kills, pid))
                best = (b - a, hit)
        out.append({"rank": k["rank"], "life": k["life"] + 1,
                    "admission_stall_s": round(best[0] - median, 3) if best else None,
                    "kill_in_gap": best[1] if best else None, "in_own_kill_gap": best is None and in_own})
    return out


def download_costs(logs: Logs, kills: list[dict[str, Any]], median: float) -> list[dict[str, Any]]:
    """Per restart that contributed: what its background download cost the survivors, in seconds.

    Counted, for every survivor of the kill: its steps that made progress, ended after the restart's
    admission (its first logged step, plus half a median step: that step is
    :func:`admission_stalls`'s) and by its first contributing step (plus half a median step), and are
    not re-runs of a failed round: ``discards`` 0 and not ending inside any kill's gap of that
    survivor. Each such step's excess is its ``dt`` minus ``median``, clipped at 0.
    ``download_cost_s``: the sum of the excesses (the largest sum over the survivors);
    ``download_step_max_s``: the largest single excess; ``download_steps``: the steps counted (of that
    survivor). A restart that never contributed (killed, or still downloading when the run ended) has
    None there; what its download cost until then (to its kill, else its last logged step) is
    ``lost_download_cost_s``, counted alike, so that no download's cost goes unreported. Example
    (steps of 1.5 s and 1.0 s during the download, median 1.0 s: 0.5 s lost)::

        >>> steps = lambda pid, ts: [{"event": "joined", "t": 0.0, "started": 0.0, "pid": pid}] + [
        ...     {"t": t, "dt": t - p, "step": i, "discards": 0} for i, (p, t) in enumerate(zip([0] + ts, ts))]
        >>> joiner = [{"event": "joined", "t": 2.5, "started": 2.0, "pid": 3},
        ...           {"t": 3.0, "dt": 1.0, "step": 3, "discards": 0, "contributes": False},
        ...           {"t": 4.5, "dt": 1.5, "step": 4, "discards": 0, "contributes": False},
        ...           {"t": 5.5, "dt": 1.0, "step": 5, "discards": 0}]
        >>> logs = {(0, 0): steps(1, [1.0, 2.0, 3.0, 4.5, 5.5]), (1, 0): steps(2, [1.0]), (1, 1): joiner}
        >>> download_costs(logs, [{"t": 1.5, "rank": 1, "life": 0, "survivors": [1]}], median=1.0)
        [{'rank': 1, 'life': 1, 'download_cost_s': 0.5, 'download_step_max_s': 0.5, 'download_steps': 2, \
'lost_download_cost_s': None}]
    """
    by_pid, out = _by_pid(logs), []
    for k in kills:
        got = _restart(logs, k)
        if got is None:
            continue
        row: dict[str, Any] = {"rank": k["rank"], "life": k["life"] + 1, "download_cost_s": None,
                               "download_step_max_s": None, "download_steps": 0, "lost_download_cost_s": None}
        lo = got[1]["t"] + median / 2
        if got[2] is not None:
            best = _excesses(by_pid, kills, k, lo, got[2] + median / 2, median)
            if best is not None:
                row.update(download_cost_s=round(sum(best, 0.0), 3), download_steps=len(best),
                           download_step_max_s=round(max(best, default=0.0), 3))
        else:   # never contributed: up to its own kill, else to its last logged step
            own = [e["t"] for e in logs.get((k["rank"], k["life"] + 1), []) if "dt" in e]
            died = next((kk["t"] for kk in kills if (kk["rank"], kk["life"]) == (k["rank"], k["life"] + 1)), None)
            best = _excesses(by_pid, kills, k, lo, died if died is not None else own[-1], median)
            if best is not None:
                row["lost_download_cost_s"] = round(sum(best, 0.0), 3)
        out.append(row)
    return out


def _excesses(by_pid: dict[int, list[dict[str, Any]]], kills: list[dict[str, Any]], k: dict[str, Any], lo: float,
              hi: float, median: float) -> list[float] | None:
    """The clean steps' excesses in (lo, hi] of the survivor of kill ``k`` that lost the most (see
    :func:`download_costs`); None without survivors."""
    best: list[float] | None = None
    for pid in k["survivors"]:
        log = by_pid.get(pid, [])
        gaps = _kill_gaps(log, kills, pid)
        ex = [max(0.0, e["dt"] - median) for e in progress_steps(log) if lo < e["t"] <= hi
              and not e["discards"] and not any(g0 < e["t"] <= g1 for g0, g1 in gaps)]
        if best is None or (sum(ex), len(ex)) > (sum(best), len(best)):
            best = ex
    return best


def sync_of(log: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fragments' synchronisation schedule the incarnation logged when it joined (None: none logged)."""
    return next((e.get("sync") for e in log if e.get("event") == "joined"), None)


def unsynced_steps(log: list[dict[str, Any]], sync: dict[str, Any] | None = None) -> float:
    """The killed incarnation's progress that no committed round holds, in steps (its work lost with it).

    Without ``sync`` (DDP, local SGD: one round synchronises everything) it is
    the steps since its last round: those logged with its last ``round``,
    less the step that ran that round. With ``sync`` (DiLoCo, streaming
    DiLoCo: ``{"period": H, "offsets": [...], "weights": [...]}``, each
    fragment synchronised after the steps ``s`` with ``s % H == offset``, in
    its share ``weight`` of the parameters) a fragment holds its progress up to
    its last launch before the kill, so the steps lost are each fragment's
    progress steps since then, weighted by its share. Streaming DiLoCo thus
    loses about half a period per kill, as DiLoCo does, not just the steps
    since the last fragment's round. Example (H=8, two fragments launching
    after steps 4 and 0 of each period, killed after step 11: 7 steps since
    the launch at 4, 3 since the one at 8)::

        >>> log = [{"t": float(s), "dt": 1.0, "step": s, "discards": 0, "round": s // 4} for s in range(1, 12)]
        >>> unsynced_steps(log, {"period": 8, "offsets": [4, 0], "weights": [0.5, 0.5]})
        5.0
        >>> unsynced_steps(log)   # a round every 4 steps: steps 9..11 since the one at step 8
        3.0
    """
    steps = progress_steps(log)
    if not steps:
        return 0.0
    if sync is None:
        last = steps[-1]["round"]
        return float(max(0, sum(1 for e in steps if e["round"] == last) - 1))
    period, end = int(sync["period"]), int(steps[-1]["step"])
    lost = 0.0
    for offset, weight in zip(sync["offsets"], sync["weights"]):
        launched = end - (end - int(offset)) % period   # its last launch at or before the last step
        lost += float(weight) * sum(1 for e in steps if e["step"] > launched)
    return lost


def goodput(logs: Logs, samples_per_step: int, wall: float, lost: float = 0.0) -> float:
    """Committed samples per second: every incarnation's steps that made progress (each of the ``samples`` it
    logged, else ``samples_per_step``), less ``lost`` local steps of ``samples_per_step`` (:func:`unsynced_steps`
    of every killed incarnation).

    >>> goodput({(0, 0): [{"t": 1.0, "dt": 1.0, "step": 1, "samples": 11}]}, samples_per_step=8, wall=2.0)
    5.5
    """
    n = sum(int(e.get("samples", samples_per_step)) for lg in logs.values() for e in progress_steps(lg))
    return (n - lost * samples_per_step) / wall if wall > 0 else 0.0


def trained_s(logs: Logs, began: float, wall: float) -> float:
    """Seconds from ``began`` (the run's start, wall clock) to the last ``done`` entry; ``wall`` if none."""
    ends = [e["t"] for lg in logs.values() for e in lg if e.get("event") == "done"]
    return max(ends) - began if ends else wall


def spread(values: list[float | None]) -> dict[str, float | int]:
    """``{"n", "median", "max"}`` of the values that are not None (``{"n": 0}`` if none)."""
    v = sorted(x for x in values if x is not None)
    return {"n": len(v), "median": round(statistics.median(v), 3), "max": round(v[-1], 3)} if v else {"n": 0}


def joins(logs: Logs, normal: float) -> list[dict[str, Any]]:
    """Per restarted worker: its seconds from process start to its first contributing step, the state it
    received, and the survivors' stall while it joined: the longest gap between two logged steps of any
    other worker overlapping [its first step's start (asking to be admitted), its first contributing
    step], minus the median step (a kill's own stall falls in it only if the restart asked that early)."""
    out = []
    for (rank, life), lg in sorted(logs.items()):
        ev = {e["event"]: e for e in lg if "event" in e}
        # (steps trained before its admission are committed by the round that admitted it: see progress_steps)
        first = next((e for e in lg if "dt" in e and e.get("contributes", True) and not e.get("early")), None)
        if life == 0 or "joined" not in ev or "joining" not in ev or first is None:
            continue
        t0, t1, gaps = ev["joining"]["t"], first["t"], []
        for (other, _), lg2 in logs.items():
            ts = [e["t"] for e in lg2 if "dt" in e]
            gaps += [b - a for a, b in zip(ts, ts[1:]) if other != rank and b >= t0 and a <= t1]
        got = ev.get("contributing", {})
        out.append({"rank": rank, "life": life, "start_to_contribute_s": round(t1 - ev["joined"]["started"], 2),
                    "survivor_stall_s": round(max(gaps) - normal, 3) if gaps else None,
                    "steps_before_contributing": sum(1 for e in lg if "dt" in e and not e.get("contributes", True)),
                    "state_bytes": got.get("heal_bytes", 0), "downloaded_bytes": got.get("download_bytes", 0),
                    "by_source": got.get("by_source", {}), "slots": got.get("slots", 0),
                    "pauses": got.get("pauses", 0),   # its slots a failed step closed early (a kill meanwhile)
                    # the download's seconds, of which held while the joiner was in a round (averaging
                    # strategies), and whether it loaded between two rounds (its first round then weighs k/H)
                    "download_s": got.get("download_s"), "held_s": got.get("held_s"),
                    "between_rounds": got.get("between_rounds"),
                    # bytes it had when admitted: downloaded early, while it waited for the survivors' round
                    "prefetched_bytes": got.get("prefetched_bytes", 0),
                    # bytes taken from its host's copy of an earlier life (--state-cache), not the network
                    "seeded_bytes": got.get("seeded_bytes", 0),
                    # inner steps trained before its admission, from the survivors' state, that the round
                    # admitting it took (preadmit.py; -1: none)
                    "trained_before_admission": got.get("trained_before_admission", -1)})
    return out
