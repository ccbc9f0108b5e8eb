"""Recompute the goodput of earlier DiLoCo and streaming DiLoCo chaos runs with each fragment's lost steps.

The chaos bench used to count a killed worker's lost work as its steps since its group's last round.
For streaming DiLoCo a round synchronises one fragment only, so that undercounted the loss: each
fragment holds the worker's progress up to its own last launch (``shoal.bench.chaos_stats.unsynced_steps``).
For each ``chaos-*.json`` of a DiLoCo-family run whose workers' logs were kept (``--keep``, matched by
pid as in chaos_recompute_joins.py) this checks that the old rule reproduces the reported lost steps and
goodput exactly, then recomputes both with the fragments' schedule (built as the run's strategy built it).

    PYTHONPATH=. python docs/benchmarks/chaos_recompute_unsynced.py docs/benchmarks recomputed-chaos-unsynced.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any

from chaos_recompute_joins import load

from shoal.bench import chaos_stats as cs
from shoal.bench.chaos import _Task
from shoal.strategies.diloco import DiLoCoConfig, split_fragments


def schedule(args: dict[str, Any]) -> dict[str, Any]:
    """The fragments' launch offsets and shares, as the run's DiLoCo or StreamingDiLoCo laid them out."""
    a = argparse.Namespace(**args)
    net = _Task(a, 0, 0).model(a)
    names, params = zip(*[(n, p) for n, p in net.named_parameters() if p.requires_grad])
    frags = args["fragments"] if args["strategy"] == "streaming" else 1
    cfg = DiLoCoConfig(inner_steps=args["period"], fragments=frags)
    modules = [n.rsplit(".", 1)[0] if "." in n else "" for n in names]
    layout = split_fragments([p.numel() for p in params], frags, cfg.layout, modules)
    sizes = [sum(params[i].numel() for i in idx) for idx in layout]
    return {"period": cfg.inner_steps, "offsets": [cfg.launch_offset(k) for k in range(frags)],
            "weights": [s / sum(sizes) for s in sizes]}


def old_rule(log: list[dict[str, Any]]) -> int:
    """What the bench counted before: the incarnation's logged steps of its last round, less one."""
    lg = [e for e in log if "dt" in e]
    return (sum(1 for e in lg if e["round"] == lg[-1]["round"]) - 1 if len(lg) > 1 else 0) if lg else 0


def recompute(run: dict[str, Any], logs: cs.Logs) -> dict[str, Any]:
    ch, sync = run["chaos"], schedule(run["args"])
    victims = [logs.get((k["rank"], k["life"]), []) for k in ch["kill_log"]]
    old = [old_rule(lg) for lg in victims]
    progress = sum(len(cs.committed_times(lg)) for lg in logs.values())
    batch = round(ch["goodput_exact"] * ch["trained_s"] / (progress - sum(old)))
    same = (math.isclose(cs.goodput(logs, batch, ch["trained_s"], sum(old)), ch["goodput_exact"], rel_tol=1e-12)
            and math.isclose(sum(old) / len(old), ch["local_steps_lost_per_failure"]))
    new = [cs.unsynced_steps(lg, sync) for lg in victims]
    rate = cs.goodput(logs, batch, ch["trained_s"], sum(new))
    base = run["fault_free"]["goodput_exact"]
    return {"reported_figures_reproduced": same, "sync": sync, "lost_per_kill_before": old,
            "lost_per_kill": [round(x, 3) for x in new], "goodput_ratio_before": run.get("goodput_ratio"),
            "goodput_ratio": round(rate / base, 4), "goodput_exact": rate}


def main(folder: str, out: str | None) -> None:
    kept = [d for d in glob.glob("/tmp/**/chaos", recursive=True) if os.path.exists(d + "/log-0-0.jsonl")]
    pids = {d: {e["pid"] for lg in load(d).values() for e in lg if e.get("event") == "joined"} for d in kept}
    res = {}
    for f in sorted(glob.glob(os.path.join(folder, "chaos-*.json"))):
        run = json.load(open(f))
        ch = run.get("chaos", {})
        if run.get("args", {}).get("strategy") not in ("diloco", "streaming") or "kill_log" not in ch \
                or "fault_free" not in run:
            continue
        want = {k["pid"] for k in ch["kill_log"]} | {p for k in ch["kill_log"] for p in k["survivors"]}
        match = [d for d in kept if want <= pids[d]]
        if len(match) != 1:
            continue
        res[os.path.basename(f)] = {"kept_logs": match[0], **recompute(run, load(match[0]))}
        print(os.path.basename(f), json.dumps({k: v for k, v in res[os.path.basename(f)].items() if k != "sync"}))
    if out:
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
