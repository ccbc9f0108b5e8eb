"""The bench's figures: loss against seconds, samples and bytes, and a summary of time against bytes.

Every strategy gets its own colour *and* line style (ddp and torch-ddp often
coincide: both stay visible), evaluations that follow a synchronisation of a
periodic strategy (DiLoCo, local SGD) carry a marker, the loss axis is cut to
the range where strategies differ, bytes are on a log axis, failed strategies
are named on the figure and the run's details (task, model, link, budget,
commit, date) are printed on it.

Example::

    plot(results, "results/run/report.png")        # results: a loaded results.json
"""

from __future__ import annotations

import os
from typing import Any

STYLES = ("-", "--", "-.", ":")


def _style(i: int) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    return {"color": plt.get_cmap("tab10")(i % 10), "ls": STYLES[(i // 10 + i) % len(STYLES)], "lw": 1.6}


def _mb(p: dict[str, Any]) -> float:
    return sum(p["meter_sent"]) / len(p["meter_sent"]) / 1e6


def sync_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluations right after a synchronisation, for strategies that do not synchronise every interval.

    >>> pts = [{"meter_sent": [b]} for b in (0, 0, 5, 5, 9)]
    >>> [pts.index(p) for p in sync_points(pts)]
    [2, 4]
    """
    grew = [i for i in range(1, len(points)) if sum(points[i]["meter_sent"]) > sum(points[i - 1]["meter_sent"])]
    return [] if len(grew) == len(points) - 1 else [points[i] for i in grew]


def _ylim(curves: list[list[float]]) -> tuple[float, float] | None:
    finals = [c[-1] for c in curves if c]
    if not finals:
        return None
    lo, hi = min(finals), max(finals)
    top = min(max(max(c) for c in curves if c), lo + max(0.6, 2.5 * (hi - lo)))
    return lo - 0.05 * (top - lo) - 1e-3, top


def details(results: dict[str, Any], extra: str = "") -> str:
    """One line of run details for the figure."""
    cfg = results.get("config", {})
    m = cfg.get("model", {})
    size = f"{m.get('n_layers', '?')} layers x {m.get('d_model', '?')}" if m else "default model"
    stop = (f"{cfg['time_budget_s']:g} s" if cfg.get("time_budget_s") else f"{cfg.get('steps')} steps")
    return (f"task {cfg.get('task', '?')} ({size}, global batch {cfg.get('global_batch', '?')}), "
            f"{results.get('network', '?')}, {stop} per strategy{extra}; commit {results.get('commit', '?')}, "
            f"{results.get('started', '?')}")


def _curves(axes: dict[str, Any], results: dict[str, Any]) -> list[list[float]]:
    curves = []
    for i, (name, s) in enumerate(results["strategies"].items()):
        pts = [p for p in s["points"] if p["val_loss"] is not None]
        if not pts or not s.get("ok", True):
            continue
        st, loss = _style(i), [p["val_loss"] for p in pts]
        curves.append(loss)
        marks = sync_points(pts)
        for key, ax in axes.items():
            if key == "mb":
                if _mb(pts[-1]) <= 0:
                    continue
                xs = [max(_mb(p), 1e-3) for p in pts]
                ax.plot(xs, loss, label=name, **st)
                ax.plot([max(_mb(p), 1e-3) for p in marks], [p["val_loss"] for p in marks], "o", ms=4,
                        color=st["color"])
            else:
                ax.plot([p[key] for p in pts], loss, label=name, **st)
                ax.plot([p[key] for p in marks], [p["val_loss"] for p in marks], "o", ms=4, color=st["color"])
    return curves


def _summary(ax: Any, rows: dict[str, dict[str, Any]], title: str) -> None:
    """Time to target (y) against MB per worker (log x), one labelled point per strategy."""
    shown = 0
    for i, (name, r) in enumerate(rows.items()):
        t, mb = r.get("time_to_target_s"), r.get("mb_sent_per_worker")
        # Only the strategies credited with a time (nosync's replicas are not the cluster's model).
        if t is None or mb is None or (r.get("speedup_vs_ddp") is None and r.get("efficiency") is None):
            continue
        ax.plot([max(mb, 1e-2)], [t], "o", color=_style(i)["color"])
        ax.annotate(name, (max(mb, 1e-2), t), fontsize=7, xytext=(3, 3), textcoords="offset points")
        shown += 1
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per worker (log; 0 drawn at 0.01)")
    ax.set_ylabel("time to target (s)")
    ax.set_title(title if shown else title + "\n(no strategy reached the target)", fontsize=9)
    ax.grid(alpha=0.3, which="both")


def _finish(fig: Any, path: str, lines: list[str]) -> None:
    import matplotlib.pyplot as plt

    fig.text(0.01, 0.005, "\n".join(lines), fontsize=8, va="bottom", family="monospace")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _failed_line(failed: list[str]) -> str:
    return ("FAILED (not plotted): " + ", ".join(failed)) if failed else "every strategy finished"


def short_reason(why: str) -> str:
    """A refusal's reason cut to its first clause, to fit a line of the figure.

    >>> short_reason("DASO needs at least 2 workers on every host (it averages ...); got 4 hosts")
    'DASO needs at least 2 workers on every host'
    """
    return why.split(" (")[0].split(";")[0].split(". ")[0].strip()


def failed_names(strategies: dict[str, Any]) -> list[str]:
    """Each strategy that did not finish, as the figure names it: refused (with why) or its exit code."""
    return [f"{n} refused: {short_reason(s['refused'])}" if s.get("refused") else f"{n} (exit {s['returncode']})"
            for n, s in strategies.items() if not s["ok"]]


def plot(results: dict[str, Any], path: str) -> None:
    """The figure of one run: loss vs seconds, vs samples, vs MB (log), and time to target vs MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(14, 9.5))
    ax_t, ax_n, ax_b, ax_s = grid.flat
    curves = _curves({"wall_s": ax_t, "samples": ax_n, "mb": ax_b}, results)
    ideal = results.get("ideal")
    if ideal and ideal["points"]:
        ax_t.plot([p["wall_s"] for p in ideal["points"]], [p["val_loss"] for p in ideal["points"]],
                  color="k", ls=(0, (1, 1)), lw=1.2, label="ideal (local's loss at nosync's speed)")
    target, lim = results.get("target_loss"), _ylim(curves)
    for ax, xl in ((ax_t, "training seconds (communication included)"), (ax_n, "samples trained"),
                   (ax_b, "MB sent per worker (meter, log); strategies that send nothing are not drawn")):
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:.3f}")
        if lim:
            ax.set_ylim(*lim)
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    ax_b.set_xscale("log")
    ax_t.legend(fontsize=7, ncol=2)
    _summary(ax_s, results["strategies"], "time to target against bytes (lower left is better)")
    failed = failed_names(results["strategies"])
    fig.suptitle(f"shoal bench {results['config'].get('task', '?')}: {results['network']}   "
                 "(dots: evaluations after an averaging round)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    _finish(fig, path, [details(results), _failed_line(failed)])


def plot_joined(quality: dict[str, Any], speed: dict[str, Any], joined: dict[str, Any], path: str) -> None:
    """``--mode both``: loss vs samples and vs MB at equal samples, and estimated time to target vs MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_n, ax_b, ax_s) = plt.subplots(1, 3, figsize=(17, 5.8))
    curves = _curves({"samples": ax_n, "mb": ax_b}, quality)
    target, lim = joined.get("target_loss"), _ylim(curves)
    for ax, xl in ((ax_n, "samples trained (equal for every strategy)"),
                   (ax_b, "MB sent per worker (log); strategies that send nothing are not drawn")):
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:.3f}")
        if lim:
            ax.set_ylim(*lim)
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    ax_b.set_xscale("log")
    ax_n.legend(fontsize=7, ncol=2)
    _summary(ax_s, joined["joined"], f"est. time to target on {speed['network']}\n"
                                     "(samples to target x s/sample on the link)")
    fig.suptitle(f"shoal bench {quality['config'].get('task', '?')}: quality at equal samples on loopback, "
                 "speed on the emulated link   (dots: evaluations after an averaging round)")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    failed = [f"{n}: {short_reason(why)}" for n, why in joined.get("failed", {}).items()]
    budget = speed.get("config", {}).get("time_budget_s")
    _finish(fig, path, [details(quality) + " (quality run)",
                        f"speed run: {speed.get('network', '?')}, {budget or '?'} training seconds per strategy, "
                        f"commit {speed.get('commit', '?')}, {speed.get('started', '?')}",
                        _failed_line(failed)])
