"""--mode both's arithmetic: equal-samples quality joined with seconds per sample on the link, by hand."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.bench import joined, report
from shoal.bench.plot import sync_points
from shoal.bench.runner import summarize


def _pts(samples: list[int], losses: list[float], sent: list[int], workers: int) -> list[dict[str, Any]]:
    return [{"step": n // 10, "samples": n, "wall_s": float(i), "val_loss": loss, "meter_sent": [b] * workers,
             "meter_received": [b] * workers, "iface_sent": None, "iface_received": None}
            for i, (n, loss, b) in enumerate(zip(samples, losses, sent))]


def _run(points: list[dict[str, Any]], workers: int, wall: float | None = None, ok: bool = True) -> dict[str, Any]:
    return {"workers": workers, "returncode": 0 if ok else 1, "ok": ok, "launch_s": 1.0, "host_bytes": None,
            "steps": points[-1]["step"], "wall_s": wall if wall is not None else points[-1]["wall_s"],
            "points": points, "log": "x/log.txt"}


def _quality() -> dict[str, dict[str, Any]]:
    grid = [0, 100, 200, 300]
    return {
        "ddp": _run(_pts(grid, [5.0, 4.0, 3.0, 2.0], [0, 400_000_000, 800_000_000, 1_200_000_000], 4), 4),
        "local": _run(_pts(grid, [5.0, 3.5, 2.5, 1.9], [0, 0, 0, 0], 1), 1),
        "nosync": _run(_pts(grid, [5.0, 4.5, 4.0, 3.5], [0, 0, 0, 0], 4), 4),
        # Reaches 3.0 on one replica at 100 samples, before its first exchange (between 100 and 200).
        "diloco-h20": _run(_pts(grid, [5.0, 3.0, 2.5, 2.02], [0, 0, 1_000_000, 3_000_000], 4), 4),
    }


def _speed() -> dict[str, dict[str, Any]]:
    # Seconds per sample on the link: ddp 1.0, local 0.4, nosync 0.1, diloco 0.125.
    return {n: _run(_pts([0, 80], [5.0, 4.0], [0, 0], 4), 4, wall=w)
            for n, w in (("ddp", 80.0), ("local", 32.0), ("nosync", 8.0), ("diloco-h20", 10.0))}


def test_join_by_hand() -> None:
    q = _quality()
    summarize(q, None)
    target = 2.0 * 1.005
    j = joined.join(q, _speed(), target)
    d, ddp = j["diloco-h20"], j["ddp"]
    assert d["loss_vs_ddp"] == pytest.approx(0.01)
    assert d["bytes_vs_ddp"] == pytest.approx(1200 / 3)
    assert d["s_per_sample"] == pytest.approx(0.125)
    # ddp: 2.01 between (200, 3.0) and (300, 2.0) at 299 samples; 1 s/sample.
    assert ddp["time_to_target_s"] == pytest.approx(299.0)
    # diloco reaches 2.01? No: it ends at 2.02, so no time, no speed-up.
    assert d["time_to_target_s"] is None and d["speedup_vs_ddp"] is None
    # local: 2.01 between (200, 2.5) and (300, 1.9) at 281.67 samples, 0.4 s/sample on one worker.
    assert j["local"]["time_to_target_s"] == pytest.approx((200 + 100 * 0.49 / 0.6) * 0.4)
    ideal = joined.ideal_time(q, _speed(), target)
    assert ideal == pytest.approx((200 + 100 * 0.49 / 0.6) * 0.1)
    assert ddp["efficiency"] == pytest.approx(ideal / 299.0)
    assert j["nosync"]["time_to_target_s"] is None   # a replica, never the cluster's model


def test_join_gives_no_credit_before_the_first_exchange() -> None:
    q = _quality()
    j = joined.join(q, _speed(), 3.0)
    # The 3.0 at 100 samples is one replica's: credited points are 0 (5.0) and 200 (2.5).
    assert j["diloco-h20"]["samples_to_target"] == pytest.approx(200 * 2.0 / 2.5)
    assert j["diloco-h20"]["speedup_vs_ddp"] == pytest.approx(200 / (160 * 0.125))


def test_failed_speed_run_leaves_the_time_empty_and_the_table_names_it() -> None:
    speed = _speed()
    speed["diloco-h20"]["ok"] = False
    j = joined.join(_quality(), speed, 3.0)
    assert j["diloco-h20"]["s_per_sample"] is None and j["diloco-h20"]["time_to_target_s"] is None
    text = report.format_rows(joined.table_rows(j, {"diloco-h20": "exit 1 in the speed run"}))
    assert "diloco-h20  failed: exit 1 in the speed run" in text
    assert "x fewer bytes than DDP" in text.splitlines()[0]


def test_sync_markers_only_for_periodic_strategies() -> None:
    q = _quality()
    assert sync_points(q["ddp"]["points"]) == []            # synchronises in every interval
    assert [p["samples"] for p in sync_points(q["diloco-h20"]["points"])] == [200, 300]


def test_figure_names_failed_strategies_and_run_details(tmp_path: Any) -> None:
    from shoal.bench import plot

    q = _quality()
    q["nosync"].update(ok=False, returncode=3)
    results = {"config": {"task": "lm", "model": {"n_layers": 4, "d_model": 256}, "global_batch": 32,
                          "time_budget_s": 25.0}, "network": "4 hosts x 20mbit (emulated)", "commit": "abc1234",
               "started": "2026-11-26T18:00:00+00:00", "target_loss": 2.01, "ideal": None, "strategies": q}
    summarize(q, 2.01)
    text = plot.details(results)
    for part in ("task lm", "4 layers x 256", "4 hosts x 20mbit", "25 s per strategy", "abc1234", "2026-11-26"):
        assert part in text
    assert plot._failed_line(["nosync (exit 3)"]).startswith("FAILED")
    plot.plot(results, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
