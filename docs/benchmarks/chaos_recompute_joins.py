"""Recompute the chaos bench's per-join figures (issue #20) for earlier runs, from their kept step logs.

The JSON files in docs/benchmarks/ hold each run's kill log but not the workers' step logs; those
were kept (``--keep``) under /tmp on the machine that ran them. For each ``chaos-*.json`` this finds
the one kept ``chaos`` folder whose workers' pids hold every pid of the kill log, checks that the
figures the run reported (median step, per kill, per join) come out the same from those logs, and
adds the stall at admission and the download's cost (``shoal.bench.chaos_stats``).

    PYTHONPATH=. python docs/benchmarks/chaos_recompute_joins.py docs/benchmarks recomputed-chaos-joins.json
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

from shoal.bench import chaos_stats as cs
from shoal.bench.chaos import _read


def load(folder: str) -> cs.Logs:
    logs: cs.Logs = {}
    for n in os.listdir(folder):
        if n.startswith("log-"):
            r, life = (int(v) for v in n[4:-6].split("-"))
            logs[r, life] = _read(os.path.join(folder, n))
    return logs


def recompute(ch: dict[str, Any], logs: cs.Logs) -> dict[str, Any]:
    kills, m = ch["kill_log"], cs.median_step(logs)
    same = (abs(m - ch["step_s_median"]) < 1e-9 and cs.join_stalls(logs, kills, m) == ch["per_join"]
            and cs.kill_stalls(logs, kills, m) == ch["per_kill"])
    window = {(j["rank"], j["life"]): j["stall_s"] for j in cs.join_stalls(logs, kills, m)}
    rows = [{**a, **c, "window_stall_s": window.get((a["rank"], a["life"]))}   # restarts that logged a step
            for a, c in zip(cs.admission_stalls(logs, kills, m), cs.download_costs(logs, kills, m))]
    return {"reported_figures_reproduced": same, "median_step_s": round(m, 3), "kills": len(kills),
            "stall_per_kill_s": ch["stall_per_kill_s"],
            "stall_per_join_admission_s": cs.spread([r["admission_stall_s"] for r in rows]),
            "median_round_step_s": round(cs.median_round_step(logs), 3),
            "stall_per_join_admission_vs_round_s": cs.spread(
                [a["admission_stall_s"] for a in cs.admission_stalls(logs, kills, cs.median_round_step(logs))]),
            "joins_admitted_in_their_kills_gap": sum(1 for r in rows if r["in_own_kill_gap"]),
            "stall_per_join_s": ch["stall_per_join_s"],
            "download_cost_per_join_s": cs.spread([r["download_cost_s"] for r in rows]),
            "download_cost_lost_joins_s": cs.spread([r["lost_download_cost_s"] for r in rows]),
            "download_step_max_s": cs.spread([r["download_step_max_s"] for r in rows]), "per_join": rows}


def main(folder: str, out: str | None) -> None:
    kept = [d for d in glob.glob("/tmp/**/chaos", recursive=True) if os.path.exists(d + "/log-0-0.jsonl")]
    pids = {d: {e["pid"] for lg in load(d).values() for e in lg if e.get("event") == "joined"} for d in kept}
    res = {}
    for f in sorted(glob.glob(os.path.join(folder, "chaos-*.json"))):
        ch = json.load(open(f)).get("chaos", {})
        if "kill_log" not in ch or "per_join" not in ch:
            continue
        want = {k["pid"] for k in ch["kill_log"]} | {p for k in ch["kill_log"] for p in k["survivors"]}
        match = [d for d in kept if want <= pids[d]]
        if len(match) == 1:
            res[os.path.basename(f)] = {"kept_logs": match[0], **recompute(ch, load(match[0]))}
        else:
            res[os.path.basename(f)] = {"kept_logs": None, "why": f"{len(match)} kept folders match its pids"}
        print(os.path.basename(f), json.dumps(res[os.path.basename(f)]))
    if out:
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
