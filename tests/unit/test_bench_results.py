"""results.json schema, the table, and the ideal-curve / efficiency arithmetic on synthetic runs."""

import copy
import json
from typing import Any

import pytest

from shoal.bench import metrics, report, strategies
from shoal.bench.runner import SCHEMA_VERSION, BenchConfig, merge_ranks, summarize
from shoal.errors import ConfigError, ShoalError


def _points(walls: list[float], samples: list[int], losses: list[float], workers: int, mb_per_step: float = 0.0) -> list[dict[str, Any]]:
    out = []
    for i, (w, n, loss) in enumerate(zip(walls, samples, losses)):
        sent = int(i * mb_per_step * 1e6)
        out.append({"step": i * 10, "samples": n, "wall_s": w, "val_loss": loss,
                    "meter_sent": [sent] * workers, "meter_received": [sent] * workers,
                    "iface_sent": None, "iface_received": None})
    return out


def _run(points: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    return {"workers": workers, "returncode": 0, "ok": True, "launch_s": 9.0, "host_bytes": None,
            "steps": points[-1]["step"], "wall_s": points[-1]["wall_s"], "points": points, "log": "x/log.txt"}


def _synthetic() -> dict[str, Any]:
    runs = {
        "ddp": _run(_points([0, 40, 80], [0, 100, 200], [5.0, 4.0, 3.5], 4, 10.0), 4),
        "torch-ddp": _run(_points([0, 50, 100], [0, 100, 200], [5.0, 4.0, 3.6], 4, 10.0), 4),
        "local": _run(_points([0, 30, 60], [0, 100, 200], [5.0, 4.0, 3.0], 1), 1),
        "nosync": _run(_points([0, 10, 20], [0, 100, 200], [5.0, 4.5, 4.2], 4), 4),
    }
    results = {"schema": SCHEMA_VERSION, "run": "synthetic", "started": "2026-11-21T00:00:00+00:00",
               "config": {"task": "lm"}, "network": "4 hosts x 20mbit (emulated)"}
    results.update(summarize(runs, None))
    results["strategies"] = runs
    return results


def test_default_target_is_ddps_final_loss_within_the_tolerance() -> None:
    r = _synthetic()
    assert r["target_source"] == "ddp"
    assert r["target_loss"] == pytest.approx(3.5 * 1.005)   # not torch-ddp's worse 3.6
    assert r["strategies"]["ddp"]["time_to_target_s"] == pytest.approx(80 - 40 * (3.5175 - 3.5) / 0.5)
    assert "ddp's final validation loss + 0.5%" in report.format_table(r)


def test_worst_loss_target_only_on_request_and_torch_ddp_stands_in_for_ddp() -> None:
    runs = _synthetic()["strategies"]
    out = summarize(runs, None, target="worst")
    assert out["target_loss"] == pytest.approx(3.6) and out["target_source"] == "worst"  # nosync's 4.2 excluded
    no_ddp = {n: r for n, r in runs.items() if n != "ddp"}
    assert summarize(no_ddp, None)["target_loss"] == pytest.approx(3.6 * 1.005)
    alone = {"local": runs["local"], "nosync": runs["nosync"]}
    out = {**summarize(alone, None), "strategies": alone}     # as the bench writes results.json
    assert out["target_loss"] is None and out["target_source"] == "none"
    assert "no target loss: neither ddp nor torch-ddp was in the run" in report.target_line(out)
    with_failed = {**alone, "ddp": {**runs["ddp"], "points": [], "ok": False}}
    failed = {**summarize(with_failed, None), "strategies": with_failed}
    assert failed["target_loss"] is None and "no target loss: ddp did not finish" in report.target_line(failed)
    with pytest.raises(ConfigError, match="target"):
        summarize(runs, None, target="best")


def test_no_credit_before_the_first_synchronisation() -> None:
    """A DiLoCo-like run: its replica reaches the target at 10 s, before any byte was exchanged."""
    runs = _synthetic()["strategies"]
    pts = _points([0, 10, 20, 30], [0, 100, 200, 300], [5.0, 3.0, 3.4, 3.0], 4)
    for p, sent in zip(pts, [0, 0, 5_000_000, 5_000_000]):   # first outer step between 10 s and 20 s
        p["meter_sent"] = [sent] * 4
    runs["diloco-h20"] = _run(pts, 4)
    summarize(runs, 3.5)
    # Credited evaluations: step 0 (the common initial model) and 20 s (3.4), the first after a sync;
    # the replica's 3.0 at 10 s is not: 3.5 is crossed between (0 s, 5.0) and (20 s, 3.4).
    assert runs["diloco-h20"]["time_to_target_s"] == pytest.approx(20 * 1.5 / 1.6)
    assert runs["diloco-h20"]["speedup_vs_ddp"] == pytest.approx(runs["ddp"]["time_to_target_s"] / (20 * 1.5 / 1.6))
    # Never synchronised at all: no time to target, no speed-up, no efficiency.
    for p in pts:
        p["meter_sent"] = [0] * 4
    summarize(runs, 3.5)
    d = runs["diloco-h20"]
    assert d["time_to_target_s"] is None and d["speedup_vs_ddp"] is None and d["efficiency"] is None


def test_time_to_target_speedup_and_efficiency_by_hand() -> None:
    runs = _synthetic()["strategies"]
    out = summarize(runs, 3.6)
    s = runs
    # ddp crosses 3.6 between (40 s, 4.0) and (80 s, 3.5): 40 + 40 * 0.4 / 0.5 = 72 s.
    assert s["ddp"]["time_to_target_s"] == pytest.approx(72.0)
    assert s["torch-ddp"]["time_to_target_s"] == pytest.approx(100.0)
    # local needs 140 samples; nosync does 10 samples/s -> ideal 14 s.
    assert out["ideal"]["time_to_target_s"] == pytest.approx(14.0)
    assert s["ddp"]["efficiency"] == pytest.approx(14 / 72)
    assert s["torch-ddp"]["speedup_vs_ddp"] == pytest.approx(0.72)
    assert s["ddp"]["speedup_vs_ddp"] == pytest.approx(1.0)
    assert s["local"]["efficiency"] == pytest.approx(14 / 42)
    assert s["nosync"]["time_to_target_s"] is None and s["nosync"]["efficiency"] is None
    assert s["ddp"]["mb_sent_per_worker"] == pytest.approx(20.0)


def test_given_target_and_missing_baselines() -> None:
    runs = {"ddp": _run(_points([0, 10], [0, 10], [5.0, 4.0], 2, 1.0), 2)}
    out = summarize(runs, 4.5)
    assert out["target_source"] == "given" and out["ideal"] is None
    assert runs["ddp"]["time_to_target_s"] == pytest.approx(5.0)
    assert runs["ddp"]["efficiency"] is None


def test_ideal_curve_is_local_loss_at_nosync_samples() -> None:
    r = _synthetic()
    ideal = r["ideal"]["points"]
    assert [p["wall_s"] for p in ideal] == [0, 10, 20]
    assert [p["val_loss"] for p in ideal] == [5.0, 4.0, 3.0]


def test_nosync_extrapolates_beyond_its_last_point() -> None:
    assert metrics.nosync_seconds_for(400, _points([0, 20], [0, 200], [5, 4], 1)) == pytest.approx(40.0)


def test_synthetic_results_pass_the_schema_and_survive_json() -> None:
    r = json.loads(json.dumps(_synthetic()))
    report.validate_results(r)


@pytest.mark.parametrize("breakage", ["missing", "wrong-type", "short-bytes", "step-order", "bytes-decrease"])
def test_schema_rejects_broken_results(breakage: str) -> None:
    r = copy.deepcopy(_synthetic())
    pts = r["strategies"]["ddp"]["points"]
    if breakage == "missing":
        del r["strategies"]["ddp"]["final_val_loss"]
    elif breakage == "wrong-type":
        pts[1]["wall_s"] = "12"
    elif breakage == "short-bytes":
        pts[1]["meter_sent"] = pts[1]["meter_sent"][:2]
    elif breakage == "step-order":
        pts[2]["step"] = pts[1]["step"]
    else:
        pts[2]["meter_sent"] = [0, 0, 0, 0]
    with pytest.raises(ShoalError):
        report.validate_results(r)


def test_table_has_every_strategy_and_the_issue_columns() -> None:
    r = _synthetic()
    r.update(summarize(r["strategies"], 3.6))
    text = report.format_table(r)
    header = text.splitlines()[0]
    for col in ("strategy", "steps", "wall s", "time to target", "final val loss", "MB sent/worker",
                "speed-up vs DDP", "efficiency"):
        assert col in header
    assert "72.0 s" in text and "0.72x" in text and "(ideal)" in text
    assert "target loss 3.600 (given)" in text
    md = report.markdown_table(r)
    assert md.count("\n") == 6  # header, rule, 4 strategies, ideal


def test_failed_strategy_is_reported_not_hidden() -> None:
    r = _synthetic()
    r["strategies"]["ddp"].update(ok=False, returncode=1, points=[])
    assert "failed (exit 1" in report.format_table(r)


def test_plot_writes_a_png(tmp_path: Any) -> None:
    path = tmp_path / "report.png"
    report.plot(_synthetic(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_ranks_takes_loss_from_rank0_and_bytes_per_rank() -> None:
    def rec(rank: int, loss: Any, sent: int) -> dict[str, Any]:
        p = {"step": 1, "samples": 8, "wall_s": 1.0 + rank, "val_loss": loss, "meter_sent": sent,
             "meter_received": sent, "iface_sent": None, "iface_received": None, "comm_wait_s": 0.0}
        return {"rank": rank, "points": [p]}

    merged = merge_ranks([rec(1, None, 7), rec(0, 3.0, 5)])
    assert merged == [{"step": 1, "samples": 8, "wall_s": 1.0, "val_loss": 3.0, "meter_sent": [5, 7],
                       "meter_received": [5, 7], "iface_sent": None, "iface_received": None, "synced": None}]


def test_registry_and_config_validation() -> None:
    assert {"ddp", "torch-ddp", "local", "nosync"} <= set(strategies.available())
    with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
        strategies.get("nope")
    with pytest.raises(ConfigError, match="already registered"):
        strategies.register("ddp", description="x")(lambda m, o, g: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="divisible"):
        BenchConfig(hosts=3, global_batch=32, steps=5)
    with pytest.raises(ConfigError, match="stopping rule"):
        BenchConfig()
    with pytest.raises(ConfigError, match="emulated"):
        BenchConfig(steps=5, bandwidth="20mbit")
    with pytest.raises(ConfigError, match="twice"):
        BenchConfig(steps=5, strategies=("ddp", "ddp"))


def test_disconnected_replicas_get_no_speedup_or_efficiency() -> None:
    runs = _synthetic()["strategies"]
    summarize(runs, 4.5)
    assert runs["nosync"]["time_to_target_s"] == pytest.approx(10.0)  # its replica did reach 4.5
    assert runs["nosync"]["speedup_vs_ddp"] is None and runs["nosync"]["efficiency"] is None
    assert runs["local"]["efficiency"] is not None


def test_cli_from_results_resummarises_with_a_new_target(tmp_path: Any, capsys: Any) -> None:
    from shoal.bench.command import main

    (tmp_path / "results.json").write_text(json.dumps(_synthetic()))
    assert main(["--from-results", str(tmp_path), "--target-loss", "4.5"]) == 0
    again = json.loads((tmp_path / "results.json").read_text())
    report.validate_results(again)
    assert again["target_loss"] == 4.5 and again["target_source"] == "given"
    assert again["strategies"]["ddp"]["time_to_target_s"] == pytest.approx(20.0)
    assert (tmp_path / "report.png").exists()
    assert "target loss 4.500 (given)" in capsys.readouterr().out
    (tmp_path / "results.json").write_text("{}")
    assert main(["--from-results", str(tmp_path)]) == 2


def _daso_refusal_log() -> str:
    """What a DASO worker on a host of its own prints: the real check's error, through the launcher's prefix."""
    import traceback

    from shoal.strategies.daso_schedule import MemberInfo, check_hosts

    try:
        check_hosts([MemberInfo(r, f"host{r}") for r in range(4)])
    except ConfigError as e:
        text = "".join(traceback.format_exception(e))
    # As in a real emulated run's log.txt: the launcher's "[r] ", then torch's "[rankr]: ".
    return "".join(f"[{r}] [rank{r}]: {line}\n" for r in range(4) for line in text.splitlines())


def test_refused_strategy_is_named_with_its_reason(tmp_path: Any, monkeypatch: Any) -> None:
    """DASO on 4 hosts x 1 worker: the run records, the table and the figure say 'refused' and why."""
    from types import SimpleNamespace

    import shoal.cli.launcher as launcher
    from shoal.bench import plot, runner

    def refusing_launch(cmd: Any, nprocs: int, cluster: Any, env: Any, stdout: Any, quiet: bool) -> Any:
        stdout.write(_daso_refusal_log())
        return SimpleNamespace(interrupted=False, returncode=1, duration_s=2.0, host_bytes=None)

    monkeypatch.setattr(launcher, "launch", refusing_launch)
    cfg = BenchConfig(strategies=("daso",), hosts=4, steps=10, out_root=str(tmp_path), run="r")
    rec = runner.run_strategy(cfg, "daso", str(tmp_path / "r"))
    assert rec["ok"] is False
    assert rec["refused"].startswith("DASO needs at least 2 workers on every host")
    r = _synthetic()
    r["strategies"]["daso"] = rec
    row = next(line for line in report.format_table(r).splitlines() if line.startswith("daso"))
    assert "refused: DASO needs at least 2 workers on every host" in row
    assert plot.failed_names(r["strategies"]) == ["daso refused: DASO needs at least 2 workers on every host"]
    report.plot(r, str(tmp_path / "report.png"))   # a refused strategy does not break the figure
    assert runner.refusal("[0] RuntimeError: worker crashed") is None   # a crash stays a failure with its exit


def test_no_credit_for_bytes_sent_before_the_model_takes_them_in() -> None:
    """An overlapped exchange: its first bytes go out at 10 s, its model merges them only by 20 s. A point's
    ``synced`` (from the worker) decides; a point without it (an older results file) falls back on bytes."""
    runs = _synthetic()["strategies"]
    pts = _points([0, 10, 20, 30], [0, 100, 200, 300], [5.0, 3.0, 3.4, 3.0], 4, 5.0)   # bytes from 10 s on
    for p, synced in zip(pts, [False, False, True, True]):
        p["synced"] = synced
    runs["diloco-h5-sp1-n1m5-o1"] = _run(pts, 4)
    summarize(runs, 3.5)
    assert runs["diloco-h5-sp1-n1m5-o1"]["time_to_target_s"] == pytest.approx(20 * 1.5 / 1.6)   # not 10 s
    for p in pts:
        del p["synced"]
    summarize(runs, 3.5)
    assert runs["diloco-h5-sp1-n1m5-o1"]["time_to_target_s"] == pytest.approx(10 * 1.5 / 2.0)   # credited at 10 s


def test_merge_ranks_synced_only_when_every_worker_is() -> None:
    def rec(rank: int, synced: list[Any]) -> dict[str, Any]:
        pts = _points([0, 10], [0, 100], [5.0, 4.0], 1)
        for p, s in zip(pts, synced):
            p["synced"] = s
            for key in ("meter_sent", "meter_received"):
                p[key] = p[key][0]
        return {"rank": rank, "points": pts}

    merged = merge_ranks([rec(1, [False, True]), rec(0, [False, False])])
    assert [p["synced"] for p in merged] == [False, False]
    assert [p["synced"] for p in merge_ranks([rec(0, [True, True]), rec(1, [True, True])])] == [True, True]
    assert merge_ranks([rec(0, [None, None]), rec(1, [True, True])])[1]["synced"] is None


def test_a_non_bool_synced_is_refused() -> None:
    r = _synthetic()
    report.validate_results(r)
    r["strategies"]["ddp"]["points"][1]["synced"] = 1
    with pytest.raises(ShoalError, match="synced"):
        report.validate_results(r)
