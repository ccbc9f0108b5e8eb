"""Presenting a comparison: the schema of results.json, the table, the plot.

Example:
    >>> print(format_table({"target_loss": None, "strategies": {}}).splitlines()[0].split()[0])
    strategy
"""

from __future__ import annotations

import os
from typing import Any

from shoal.errors import ShoalError

# results.json, schema 1. Types: "num" int or float; "?" may be None.
RUN_KEYS = {"schema": int, "run": str, "started": str, "config": dict, "network": str,
            "target_loss": "num?", "target_source": str, "ideal": "dict?", "strategies": dict}
STRATEGY_KEYS = {"workers": int, "returncode": int, "ok": bool, "launch_s": "num", "host_bytes": "list?",
                 "steps": "int?", "wall_s": "num?", "points": list, "log": str, "final_val_loss": "num?",
                 "time_to_target_s": "num?", "mb_sent_per_worker": "num?", "iface_mb_sent_per_worker": "num?",
                 "speedup_vs_ddp": "num?", "efficiency": "num?"}
POINT_KEYS = {"step": int, "samples": int, "wall_s": "num", "val_loss": "num?", "meter_sent": "list",
              "meter_received": "list", "iface_sent": "list?", "iface_received": "list?"}


def _type_ok(value: Any, kind: Any) -> bool:
    if isinstance(kind, str):
        if kind.endswith("?"):
            if value is None:
                return True
            kind = kind[:-1]
        kind = {"num": (int, float), "int": int, "dict": dict, "list": list}[kind]
    if kind in (int, (int, float)) and isinstance(value, bool):
        return False
    return isinstance(value, kind)


def _check(obj: dict[str, Any], keys: dict[str, Any], where: str) -> None:
    for key, kind in keys.items():
        if key not in obj:
            raise ShoalError(f"results.json: {where} lacks {key!r}")
        if not _type_ok(obj[key], kind):
            raise ShoalError(f"results.json: {where}.{key} = {obj[key]!r} is not of type {kind}")


def validate_results(results: dict[str, Any]) -> None:
    """Raise :class:`ShoalError` naming the first field of ``results`` that breaks schema 1.

    Beyond types: steps increase, byte lists have one entry per worker, and
    byte counters never decrease.
    """
    _check(results, RUN_KEYS, "run")
    for name, s in results["strategies"].items():
        _check(s, STRATEGY_KEYS, f"strategies[{name}]")
        prev = None
        for i, p in enumerate(s["points"]):
            where = f"strategies[{name}].points[{i}]"
            _check(p, POINT_KEYS, where)
            if not isinstance(p.get("synced", False), (bool, type(None))):   # optional: older files lack it
                raise ShoalError(f"results.json: {where}.synced = {p['synced']!r} is not a bool")
            for key in ("meter_sent", "meter_received", "iface_sent", "iface_received"):
                if p[key] is not None and len(p[key]) != s["workers"]:
                    raise ShoalError(f"results.json: {where}.{key} has {len(p[key])} entries for {s['workers']} workers")
            if prev is not None:
                if p["step"] <= prev["step"]:
                    raise ShoalError(f"results.json: {where}.step does not increase")
                if any(a < b for a, b in zip(p["meter_sent"], prev["meter_sent"])):
                    raise ShoalError(f"results.json: {where}.meter_sent decreases")
            prev = p


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """The table as rows of strings, header first."""
    iface = any(s.get("iface_mb_sent_per_worker") is not None for s in results["strategies"].values())
    header = ["strategy", "steps", "wall s", "time to target", "final val loss", "MB sent/worker"]
    header += ["(iface MB)"] if iface else []
    header += ["speed-up vs DDP", "efficiency"]
    rows = [header]
    for name, s in results["strategies"].items():
        if not s["ok"]:
            rows.append([name, f"refused: {s['refused']}" if s.get("refused")
                         else f"failed (exit {s['returncode']}; see {s['log']})"])
            continue
        row = [name, str(s["steps"]), _fmt(s["wall_s"], ".1f"), _fmt(s["time_to_target_s"], ".1f", " s"),
               _fmt(s["final_val_loss"], ".3f"), _fmt(s["mb_sent_per_worker"], ".1f")]
        row += [_fmt(s.get("iface_mb_sent_per_worker"), ".1f")] if iface else []
        row += [_fmt(s["speedup_vs_ddp"], ".2f", "x"), _fmt(s["efficiency"], ".2f")]
        rows.append(row)
    ideal = results.get("ideal")
    if ideal and ideal.get("time_to_target_s") is not None:
        rows.append(["(ideal)", "", "", _fmt(ideal["time_to_target_s"], ".1f", " s"), "", ""]
                    + ([""] if iface else []) + ["", "1.00"])
    return rows


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table of ``results`` with a line naming the target loss."""
    return format_rows(table_rows(results)) + "\n" + target_line(results)


def format_rows(rows: list[list[str]]) -> str:
    """Rows of strings (header first; a two-cell row is a message spanning the row) as aligned text."""
    widths = [max(len(r[i]) for r in rows if i < len(r) and len(r) > 2) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        if len(r) == 2:  # a failed strategy: one message spanning the row
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def target_line(results: dict[str, Any]) -> str:
    """One line saying which target loss the times refer to, and why that one."""
    target, source = results.get("target_loss"), results.get("target_source")
    if target is None:
        ran = {"ddp", "torch-ddp"} & set(results.get("strategies", {}))
        why = f"{' and '.join(sorted(ran))} did not finish" if ran else "neither ddp nor torch-ddp was in the run"
        return (f"no target loss: {why}; give --target-loss, or --target worst "
                "(the highest final loss of the compared strategies)")
    tol = results.get("target_tolerance", 0.0)
    how = {"given": "given", "worst": "the highest final loss of the compared strategies (--target worst)"}.get(
        str(source), f"{source}'s final validation loss + {100 * tol:.1f}%")
    return (f"target loss {target:.3f} ({how}); an evaluation counts only after a strategy's first "
            "synchronisation")


def markdown_table(results: dict[str, Any]) -> str:
    """The same table in Markdown, for docs/BENCHMARKS.md."""
    rows = [r for r in table_rows(results) if len(r) > 2]
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def plot(results: dict[str, Any], path: str) -> None:
    """Write the run's PNG (see :mod:`shoal.bench.plot`)."""
    from shoal.bench import plot as figures

    figures.plot(results, path)


def plot_joined(quality: dict[str, Any], speed: dict[str, Any], joined: dict[str, Any], path: str) -> None:
    """Write ``--mode both``'s PNG (see :mod:`shoal.bench.plot`)."""
    from shoal.bench import plot as figures

    figures.plot_joined(quality, speed, joined, path)
