"""Equal-samples quality joined with the speed on an emulated link.

Quality does not depend on the link, speed does not need a long run: the
``samples`` run trains every strategy for the same number of samples on
loopback (evaluating on a grid of sample counts), the ``speed`` run measures
each strategy's seconds per sample on the emulated link, and :func:`join`
combines them per strategy:

* ``final_val_loss`` at equal samples and ``loss_vs_ddp`` (relative gap);
* ``mb_sent_per_worker`` (bytes do not depend on the link either) and
  ``bytes_vs_ddp`` (DDP's bytes / the strategy's: "x fewer");
* ``s_per_sample`` on the link (speed run: training seconds / samples);
* ``time_to_target_s``: samples the strategy needed to reach the target
  (credited evaluations only) times its seconds per sample on the link, and
  from it ``speedup_vs_ddp`` and ``efficiency`` (the ideal: local's samples
  to the target at nosync's seconds per sample).

Example:
    >>> q = {"ddp": {"final_val_loss": 2.0, "mb_sent_per_worker": 100.0, "points": []}}
    >>> s = {"ddp": {"ok": True, "wall_s": 10.0, "steps": 10, "points": [{"samples": 320}]}}
    >>> join(q, s, 2.01)["ddp"]["s_per_sample"]
    0.03125
"""

from __future__ import annotations

from typing import Any

from shoal.bench import metrics


def s_per_sample(run: dict[str, Any]) -> float | None:
    """Training seconds per sample of a finished run (None if it failed or did nothing)."""
    if not run.get("ok") or not run.get("points") or not run.get("wall_s"):
        return None
    samples = run["points"][-1]["samples"]
    return None if samples <= 0 else float(run["wall_s"]) / samples


def join(quality: dict[str, dict[str, Any]], speed: dict[str, dict[str, Any]],
         target: float | None) -> dict[str, dict[str, Any]]:
    """Per strategy in ``quality``: the joined figures (see the module's docstring).

    ``quality`` and ``speed`` are the ``strategies`` of two summarised runs;
    ``target`` is the loss the times refer to (normally DDP's final loss at
    equal samples plus the tolerance).
    """
    from shoal.bench.runner import _is_disconnected, credited_points

    ddp_q = quality.get("ddp", {})
    pace = {n: s_per_sample(speed.get(n, {})) for n in quality}
    out: dict[str, dict[str, Any]] = {}
    for n, q in quality.items():
        n_to_target = (metrics.samples_to_target(credited_points(n, q["points"]), target)
                       if target is not None and q.get("points") else None)
        t = None if n_to_target is None or pace[n] is None else n_to_target * pace[n]   # type: ignore[operator]
        out[n] = {
            "final_val_loss": q.get("final_val_loss"),
            "loss_vs_ddp": _rel(q.get("final_val_loss"), ddp_q.get("final_val_loss")),
            "mb_sent_per_worker": q.get("mb_sent_per_worker"),
            "bytes_vs_ddp": metrics.ratio(ddp_q.get("mb_sent_per_worker"), q.get("mb_sent_per_worker")),
            "s_per_sample": pace[n],
            "samples_to_target": n_to_target,
            "time_to_target_s": None if _is_disconnected(n) else t,
        }
    ideal_n = (metrics.samples_to_target(quality["local"]["points"], target)
               if target is not None and quality.get("local", {}).get("points") else None)
    ideal = None if ideal_n is None or pace.get("nosync") is None else ideal_n * pace["nosync"]  # type: ignore[operator]
    ddp_t = out.get("ddp", {}).get("time_to_target_s")
    for n, j in out.items():
        j["speedup_vs_ddp"] = metrics.ratio(ddp_t, j["time_to_target_s"])
        j["efficiency"] = metrics.ratio(ideal, j["time_to_target_s"])
    return out


def _rel(value: float | None, ref: float | None) -> float | None:
    return None if value is None or ref is None or ref == 0 else (value - ref) / ref


def ideal_time(quality: dict[str, dict[str, Any]], speed: dict[str, dict[str, Any]],
               target: float | None) -> float | None:
    """The ideal's time to ``target``: local's samples at nosync's seconds per sample."""
    local, nosync = quality.get("local", {}), speed.get("nosync", {})
    if target is None or not local.get("points"):
        return None
    n = metrics.samples_to_target(local["points"], target)
    pace = s_per_sample(nosync)
    return None if n is None or pace is None else n * pace


def table_rows(joined: dict[str, dict[str, Any]], failed: dict[str, str]) -> list[list[str]]:
    """The joined table as rows of strings, header first; ``failed``: name -> why."""
    def f(v: float | None, spec: str, suffix: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{suffix}"

    rows = [["strategy", "val loss @ equal samples", "vs DDP", "MB sent/worker", "x fewer bytes than DDP",
             "s/sample on link", "time to target (est.)", "speed-up vs DDP", "efficiency"]]
    for n, j in joined.items():
        if n in failed:
            rows.append([n, f"failed: {failed[n]}"])
            continue
        rows.append([n, f(j["final_val_loss"], ".4f"), f(None if j["loss_vs_ddp"] is None else 100 * j["loss_vs_ddp"],
                                                          "+.2f", "%"),
                     f(j["mb_sent_per_worker"], ".1f"), f(j["bytes_vs_ddp"], ".0f", "x"),
                     f(j["s_per_sample"], ".4f"), f(j["time_to_target_s"], ".1f", " s"),
                     f(j["speedup_vs_ddp"], ".2f", "x"), f(j["efficiency"], ".2f")])
    return rows
