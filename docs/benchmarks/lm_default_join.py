"""Join equal-samples quality runs of different lengths with one speed run on the link (issue #22).

``shoal bench --mode both`` trains every strategy for the same number of
steps. To ask "how soon does a DiLoCo configuration reach DDP's loss at N
steps?" the DiLoCo run must be allowed to go past N: it was trained longer
(the bench is deterministic at a fixed seed, and with a constant learning
rate nothing depends on the run's length: DDP's N-step curve is the prefix
of its longer run, and DiLoCo's curve past N is the same run going on).
This script reads the ``results.json`` of each quality run and of the speed
run, and for each DDP length N asked for:

* cuts DDP's (and local's) curve at N steps: the target is DDP's loss at N
  times ``1 + tolerance`` (the bench's rule, :func:`shoal.bench.runner.pick_target`);
* gives :func:`shoal.bench.joined.join` every strategy's whole curve (only
  credited evaluations count: none before a strategy's first exchange);
* prints the equal-samples gap at N and the joined table (loss and bytes at
  N steps for every strategy; samples to the
  target times seconds per sample on the link, speed-up against DDP, and
  efficiency against the ideal: local's samples at nosync's pace).

    PYTHONPATH=. python docs/benchmarks/lm_default_join.py --quality RUN_DIR [RUN_DIR ...] --speed RUN_DIR \
        --at 1000 2000 --json out.json
    # the kept runs of docs/benchmarks/lm-default-diloco-loopback-20mbit.json:
    F=docs/benchmarks/lm-default-diloco-loopback-20mbit.json
    PYTHONPATH=. python docs/benchmarks/lm_default_join.py --quality "$F#ddp2000" "$F#diloco3000" "$F#local2000" \
        --speed "$F#speed" --at 1000 2000
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from shoal.bench import joined
from shoal.bench.runner import DEFAULT_TOLERANCE, pick_target


def strategies(run: str) -> dict[str, dict[str, Any]]:
    """A run's strategies: from ``RUN_DIR/results.json``, or ``FILE.json#KEY``, a run kept in a figures file
    (``docs/benchmarks/lm-default-diloco-loopback-20mbit.json#ddp2000``), whose points hold each evaluation's
    bytes as the mean over ranks (``meter_sent_per_worker``) instead of per rank."""
    if "#" in run:
        path, key = run.rsplit("#", 1)
        with open(path) as f:
            kept = json.load(f)["runs"][key]["strategies"]
        return {name: {**r, "points": [{**p, "meter_sent": [p["meter_sent_per_worker"]]} if "meter_sent" not in p
                                       else p for p in r["points"]]} for name, r in kept.items()}
    with open(os.path.join(run, "results.json")) as f:
        return dict(json.load(f)["strategies"])


def cut(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """``run`` as if it had stopped at ``steps`` (its curve, final loss and bytes there)."""
    points = [p for p in run["points"] if p["step"] <= steps]
    if not points or points[-1]["step"] != steps:
        raise SystemExit(f"no evaluation at step {steps} (last: {points[-1]['step'] if points else None})")
    last = points[-1]
    return {**run, "points": points, "final_val_loss": last["val_loss"],
            "mb_sent_per_worker": mb(last), "steps": steps}


def mb(point: dict[str, Any]) -> float:
    """MB sent per worker at an evaluation (the meter's bytes, the mean over ranks, as the bench reports)."""
    sent = point["meter_sent"]
    return (sum(sent) / len(sent) if isinstance(sent, list) else sent) / 1e6


def loss_at(run: dict[str, Any], steps: int) -> float | None:
    return next((p["val_loss"] for p in run["points"] if p["step"] == steps), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality", nargs="+", required=True, help="samples-mode runs (loopback): folders, or FILE.json#KEY")
    ap.add_argument("--speed", required=True, help="time-mode run on the emulated link: a folder, or FILE.json#KEY")
    ap.add_argument("--at", nargs="+", type=int, required=True, help="DDP lengths (steps) the target is taken at")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    quality: dict[str, dict[str, Any]] = {}
    for d in a.quality:
        quality.update(strategies(d))
    speed = strategies(a.speed)
    out: dict[str, Any] = {"quality_runs": a.quality, "speed_run": a.speed, "tolerance": a.tolerance, "at": {}}
    for n in a.at:
        # DDP and local stop at n; the others keep their whole curve (bytes: those sent by step n, equal samples)
        q = {k: (cut(v, n) if k in ("ddp", "local") else
                 {**v, "final_val_loss": loss_at(v, n),
                  "mb_sent_per_worker": next(mb(p) for p in v["points"] if p["step"] == n)})
             for k, v in quality.items()}
        target, how = pick_target({"ddp": q["ddp"]["final_val_loss"]}, "ddp", a.tolerance)
        j = joined.join(q, speed, target)
        ideal = joined.ideal_time(q, speed, target)   # join() takes nosync's pace only from a quality run of it
        for row in j.values():
            t = row["time_to_target_s"]
            row["efficiency"] = None if ideal is None or not t else ideal / t
        equal = {k: loss_at(v, n) for k, v in quality.items()}
        ddp_loss = equal["ddp"]
        out["at"][str(n)] = {"target": target, "ddp_loss": ddp_loss,
                             "equal_samples": {k: {"val_loss": v, "vs_ddp": None if v is None or ddp_loss is None
                                                   else (v - ddp_loss) / ddp_loss} for k, v in equal.items()},
                             "joined": j, "ideal_s": ideal}
        print(f"\nDDP at {n} steps: loss {ddp_loss:.4f}, target {target:.4f} ({how}, tolerance {a.tolerance})")
        for k, v in equal.items():
            if v is not None and k != "ddp":
                print(f"  equal samples ({n} steps): {k} {v:.4f} ({100 * (v - ddp_loss) / ddp_loss:+.2f} % vs DDP)")
        for row in joined.table_rows(j, {}):
            print("  " + " | ".join(row))
        print(f"  ideal (local's samples at nosync's pace): {out['at'][str(n)]['ideal_s']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
