"""The chaos bench's per-kill and per-join stalls and goodput, on made-up logs with known answers."""

from __future__ import annotations

import math
from typing import Any

from shoal.bench.chaos_stats import goodput, in_flight, join_stalls, kill_stalls, median_step, spread


def _log(pid: int, started: float, ready: float, steps: list[tuple[float, int]], first: int = 1,
         local: bool = False) -> list[dict[str, Any]]:
    """A worker's log: ready to join at ``ready``; one step per (time, discards), each 0.5 s of compute.

    DDP-like (default): a step with discards did not advance the counter; ``local`` (DiLoCo-like): every
    local step advances it, also the one whose averaging round was re-run.
    """
    out: list[dict[str, Any]] = [{"event": "joined", "t": ready, "started": started, "pid": pid}]
    step = first - 1
    for t, d in steps:
        step += 1 if local or not d else 0
        out.append({"t": t, "dt": 0.5, "discards": d, "step": step})
    return out


def _run() -> tuple[dict[tuple[int, int], list[dict[str, Any]]], list[dict[str, Any]]]:
    # Two survivors step every 0.5 s; rank 2 is killed at t=10.2. The survivors' step in flight fails,
    # and their next commit comes at 11.7 (stall 1.5 - 0.5 = 1.0 s). The restart is ready at 14.0, is
    # admitted with a 3 s gap of the survivors (commit at 16.0, then 19.0), its first commit at 19.01.
    base = [(0.5 * i, 0) for i in range(1, 21)]                        # 0.5 .. 10.0
    after = [(11.7, 0)] + [(11.7 + 0.5 * i, 0) for i in range(1, 9)]   # 11.7 .. 15.7
    tail = [(16.0, 0), (19.0, 0), (19.5, 0), (20.0, 0)]
    survivor = base + [(11.2, 1)] + after + tail
    logs = {(0, 0): _log(100, 0.0, 0.0, survivor),
            (1, 0): _log(101, 0.0, 0.0, [(t + 0.01, d) for t, d in survivor]),
            (2, 0): _log(102, 0.0, 0.0, base),
            (2, 1): _log(103, 10.3, 14.0, [(19.01, 0), (19.51, 0), (20.01, 0)], first=40)}
    kills = [{"rank": 2, "life": 0, "t": 10.2, "pid": 102, "survivors": [100, 101]}]
    return logs, kills


def test_the_stall_of_a_kill_is_the_survivors_gap_across_it_less_a_median_step() -> None:
    logs, kills = _run()
    assert median_step(logs) == 0.5
    (k,) = kill_stalls(logs, kills, 0.5)
    assert k["n"] == 2 and math.isclose(k["stall_s"], 11.7 - 10.0 - 0.5, abs_tol=1e-6), k


def test_the_stall_of_a_join_is_the_survivors_longest_gap_around_its_admission() -> None:
    logs, kills = _run()
    (j,) = join_stalls(logs, kills, 0.5)
    assert math.isclose(j["stall_s"], 19.0 - 16.0 - 0.5, abs_tol=1e-6), j
    assert math.isclose(j["first_commit_s"], 19.01 - 10.3, abs_tol=1e-6), j   # process start -> first commit
    assert (j["rank"], j["life"]) == (2, 1)


def test_a_kill_without_a_commit_after_it_has_no_stall_and_a_restart_that_never_committed_no_join() -> None:
    logs, kills = _run()
    logs[(2, 1)] = logs[(2, 1)][:1]                       # ready, but never committed
    late = [{"rank": 0, "life": 0, "t": 30.0, "pid": 100, "survivors": [101]}]   # after the last step
    assert join_stalls(logs, kills, 0.5) == []
    assert kill_stalls(logs, late, 0.5) == [{"rank": 0, "life": 0, "n": 0, "stall_s": None,
                                             "beyond_in_flight_s": None}]


def test_goodput_counts_committed_steps_only_less_the_lost_ones() -> None:
    logs, _ = _run()
    committed = sum(1 for lg in logs.values() for e in lg if "dt" in e and not e["discards"])
    assert committed == 33 + 33 + 20 + 3                   # the discarded attempts do not count
    assert math.isclose(goodput(logs, samples_per_step=16, wall=20.0), 16 * committed / 20.0)
    assert math.isclose(goodput(logs, samples_per_step=16, wall=20.0, lost=4), 16 * (committed - 4) / 20.0)
    ff = {(r, 0): _log(r, 0.0, 0.0, [(0.5 * i, 0) for i in range(1, 41)]) for r in range(3)}
    assert goodput(ff, 16, 20.0) == 16 * 120 / 20.0


def test_goodput_counts_each_steps_logged_samples() -> None:
    """``--global-batch``: a survivor's step logs the samples it took (11 of 32 with 3 contributors); a
    discarded attempt's samples do not count, nor do a joiner's steps before it contributes."""
    lg = [{"t": 1.0, "dt": 1.0, "step": 1, "discards": 0, "samples": 8},
          {"t": 3.0, "dt": 2.0, "step": 1, "discards": 1, "samples": 8},    # the kill's step: re-run
          {"t": 4.0, "dt": 1.0, "step": 2, "discards": 0, "samples": 11},
          {"t": 5.0, "dt": 1.0, "step": 3, "discards": 0, "samples": 11}]
    joiner = [{"t": 4.0, "dt": 1.0, "step": 2, "discards": 0, "samples": 11, "contributes": False},
              {"t": 5.0, "dt": 1.0, "step": 3, "discards": 0, "samples": 11}]
    assert goodput({(0, 0): lg, (1, 1): joiner}, samples_per_step=8, wall=10.0) == (8 + 11 + 11 + 11) / 10.0
    assert goodput({(0, 0): lg}, samples_per_step=8, wall=10.0, lost=1) == (8 + 11 + 11 - 8) / 10.0


def test_spread() -> None:
    assert spread([None, 3.0, 1.0, 2.0]) == {"n": 3, "median": 2.0, "max": 3.0}
    assert spread([None]) == {"n": 0}


def test_the_training_time_ends_at_the_last_done_entry_not_at_the_last_exit() -> None:
    from shoal.bench.chaos_stats import trained_s
    logs, _ = _run()
    assert trained_s(logs, began=0.0, wall=99.0) == 99.0           # nobody finished: the whole wall
    logs[(0, 0)].append({"event": "done", "t": 20.2, "val": 2.0})
    logs[(1, 0)].append({"event": "done", "t": 20.3, "val": 2.0})
    assert math.isclose(trained_s(logs, began=0.0, wall=230.0), 20.3)


def test_with_diloco_the_kill_costs_its_re_run_round_which_may_come_many_steps_later() -> None:
    # Survivors train local steps through the kill at 2.2 (no gap there); the round at 6.0 fails
    # and is re-run with the survivors, logged as a local step with discards (it made progress) at 9.0.
    steps = [(0.5 * i, 0) for i in range(1, 13)] + [(9.0, 1)] + [(9.0 + 0.5 * i, 0) for i in range(1, 5)]
    logs = {(0, 0): _log(1, 0.0, 0.0, steps, local=True), (1, 0): _log(2, 0.0, 0.0, steps, local=True),
            (2, 0): _log(3, 0.0, 0.0, steps[:4], local=True)}
    kills = [{"rank": 2, "life": 0, "t": 2.2, "pid": 3, "survivors": [1, 2]}]
    (k,) = kill_stalls(logs, kills, 0.5)
    assert math.isclose(k["stall_s"], 9.0 - 6.0 - 0.5, abs_tol=1e-6), k
    # A failure after the next kill is that kill's: the first kill then costs the gap across it.
    later = kills + [{"rank": 0, "life": 0, "t": 4.1, "pid": 1, "survivors": [2]}]
    assert kill_stalls(logs, later, 0.5)[0]["stall_s"] == 0.0


def test_a_joiner_that_does_not_contribute_yet_makes_no_progress() -> None:
    logs, kills = _run()
    for e in logs[(2, 1)][1:3]:   # its first two steps: admitted, still catching up (zero weight)
        e["contributes"] = False
    (j,) = join_stalls(logs, kills, 0.5)
    assert math.isclose(j["first_commit_s"], 20.01 - 10.3, abs_tol=1e-6), j   # its first contributing step
    assert goodput(logs, 1, 1.0) == 33 + 33 + 20 + 1


def _steps(pid: int, ready: float, steps: list[tuple[float, int]], first: int = 1, started: float = 0.0,
           zero_weight_until: float = -1.0) -> list[dict[str, Any]]:
    """A DDP-like log whose step durations are the gaps between the given (time, discards) entries.

    Steps logged up to ``zero_weight_until`` carry ``contributes: false`` (a joiner downloading).
    """
    out: list[dict[str, Any]] = [{"event": "joined", "t": ready, "started": started, "pid": pid}]
    step, prev = first - 1, steps[0][0] - 1.0
    for t, d in steps:
        step += 0 if d else 1
        out.append({"t": t, "dt": t - prev, "discards": d, "step": step, "round": step,
                    "contributes": t > zero_weight_until})
        prev = t
    return out


def _join_with_a_kill_in_its_download() -> tuple[dict[tuple[int, int], list[dict[str, Any]]], list[dict[str, Any]]]:
    # Steps of 1 s. Rank 2 dies at 10.2: the step in flight fails (11.5), the retry commits at 13.0.
    # Its restart is ready at 15.5 and admitted in the survivors' step 16.0 -> 19.0 (3 s: 2 s stall);
    # it downloads at zero weight while the survivors step 20.5 (1.5 s: 0.5 s lost) and 21.5; rank 3
    # dies at 21.7 (failed step 22.5, retry 21.5 -> 26.0: that kill's stall, not the download's);
    # then 27.2 (0.2 s lost) and 28.2, the restart's first contributing step.
    survivor = ([(float(t), 0) for t in range(1, 11)] + [(11.5, 1), (13.0, 0), (14.0, 0), (15.0, 0), (16.0, 0),
                (19.0, 0), (20.5, 0), (21.5, 0), (22.5, 1), (26.0, 0), (27.2, 0), (28.2, 0), (29.2, 0)])
    logs = {(0, 0): _steps(100, 0.0, survivor), (1, 0): _steps(101, 0.0, [(t + 0.01, d) for t, d in survivor]),
            (2, 0): _steps(102, 0.0, survivor[:10]), (3, 0): _steps(103, 0.0, survivor[:18]),
            (2, 1): _steps(104, 15.5, [(19.0, 0), (20.5, 0), (21.5, 0), (22.5, 1), (26.0, 0), (27.2, 0),
                                       (28.2, 0), (29.2, 0)], first=15, started=11.0, zero_weight_until=27.5)}
    kills = [{"rank": 2, "life": 0, "t": 10.2, "pid": 102, "survivors": [100, 101, 103]},
             {"rank": 3, "life": 0, "t": 21.7, "pid": 103, "survivors": [100, 101, 104]}]
    return logs, kills


def test_the_stall_at_admission_is_the_survivors_gap_that_admitted_the_joiner_not_a_later_kills() -> None:
    from shoal.bench.chaos_stats import admission_stalls
    logs, kills = _join_with_a_kill_in_its_download()
    assert median_step(logs) == 1.0
    (a,) = admission_stalls(logs, kills, 1.0)
    assert (a["rank"], a["life"], a["kill_in_gap"], a["in_own_kill_gap"]) == (2, 1, False, False)
    assert math.isclose(a["admission_stall_s"], 19.0 - 16.0 - 1.0, abs_tol=1e-6), a
    # The window figure (ready -> first contribution) holds the second kill's re-run: 4.5 - 1.0 s.
    (j,) = join_stalls(logs, kills, 1.0)
    assert math.isclose(j["stall_s"], 26.0 - 21.5 - 1.0, abs_tol=0.02), j


def test_the_downloads_cost_sums_the_survivors_clean_steps_excess_and_skips_a_kills_re_run() -> None:
    from shoal.bench.chaos_stats import download_costs
    logs, kills = _join_with_a_kill_in_its_download()
    (d,) = download_costs(logs, kills, 1.0)
    # 20.5 (+0.5), 21.5 (0), 27.2 (+0.2), 28.2 (0); not the failed 22.5 nor the retry ending at 26.0,
    # nor the admission step ending at 19.0.
    assert (d["rank"], d["life"], d["download_steps"]) == (2, 1, 4), d
    assert math.isclose(d["download_cost_s"], 0.7, abs_tol=1e-6), d
    assert math.isclose(d["download_step_max_s"], 0.5, abs_tol=1e-6), d


def test_a_joiner_that_never_contributed_has_an_admission_stall_and_its_cost_until_lost_apart() -> None:
    from shoal.bench.chaos_stats import admission_stalls, download_costs
    logs, kills = _join_with_a_kill_in_its_download()
    for e in logs[(2, 1)]:
        e["contributes"] = False
    assert admission_stalls(logs, kills, 1.0)[0]["admission_stall_s"] is not None
    # Still downloading at the run's end (its last step 29.2): 20.5 (+0.5), 21.5, 27.2 (+0.2), 28.2, 29.2.
    assert download_costs(logs, kills, 1.0) == [{"rank": 2, "life": 1, "download_cost_s": None,
                                                 "download_step_max_s": None, "download_steps": 0,
                                                 "lost_download_cost_s": 0.7}]
    # Killed at 27.0 before contributing: counted up to its kill (20.5 and 21.5; 22.5 failed, 26.0 is the
    # second kill's re-run), not dropped from the figures.
    kills.append({"rank": 2, "life": 1, "t": 27.0, "pid": 104, "survivors": [100, 101]})
    (d,) = download_costs(logs, kills, 1.0)   # (2, 2) never logged: no row
    assert d["download_cost_s"] is None and math.isclose(d["lost_download_cost_s"], 0.5, abs_tol=1e-6), d


def test_an_admission_in_a_later_kills_re_run_counts_and_says_so() -> None:
    from shoal.bench.chaos_stats import admission_stalls
    logs, kills = _join_with_a_kill_in_its_download()
    full = logs[(2, 1)]
    for since in (23.0, 22.0):   # its first step: the retry ending at 26.0, or the failed round at 22.5
        logs[(2, 1)] = [{**full[0], "t": since - 1.0}] + [e for e in full if e["t"] >= since and "dt" in e]
        (a,) = admission_stalls(logs, kills, 1.0)
        assert a["kill_in_gap"] is True and math.isclose(a["admission_stall_s"], 26.0 - 21.5 - 1.0, abs_tol=0.02), a


def test_a_diloco_joiner_admitted_in_the_outer_round_before_it_was_ready_counts_that_round() -> None:
    from shoal.bench.chaos_stats import admission_stalls
    # Inner steps of 1 s; the outer round that admits the restart (round 1) ends at 12.0 (4 s); the
    # restart logs ``joined`` at 12.2 (after the round) and its first inner step at 13.2.
    steps = [(float(t), 0) for t in range(1, 9)] + [(12.0, 0), (13.0, 0), (14.0, 0)]
    logs = {(0, 0): _log(1, 0.0, 0.0, steps, local=True), (1, 0): _log(2, 0.0, 0.0, steps, local=True),
            (2, 0): _log(3, 0.0, 0.0, steps[:3], local=True),
            (2, 1): _log(4, 5.0, 12.2, [(13.2, 0), (14.2, 0)], first=10, local=True)}
    for lg in logs.values():
        for e in lg[1:]:
            e["round"] = 1 if e["t"] >= 12.0 else 0
    kills = [{"rank": 2, "life": 0, "t": 3.5, "pid": 3, "survivors": [1, 2]}]
    (a,) = admission_stalls(logs, kills, 1.0)
    assert math.isclose(a["admission_stall_s"], 12.0 - 8.0 - 1.0, abs_tol=1e-6), a
    assert join_stalls(logs, kills, 1.0)[0]["stall_s"] == 0.0   # its first step's window: inner steps only


def test_against_a_median_round_step_an_outer_round_is_the_baseline_not_a_stall() -> None:
    from shoal.bench.chaos_stats import admission_stalls, median_round_step
    # Inner steps of 1 s, an outer round every 4th step taking 3 s; the round that admits the restart
    # (round 3) takes 4 s: 1 s more than a median round step, 3 s more than a median (inner) step.
    ts, t = [], 0.0
    for i in range(1, 17):
        t += 4.0 if i == 12 else 3.0 if i % 4 == 0 else 1.0
        ts.append(t)
    logs = {}
    for pid, (rank, life) in enumerate([(0, 0), (1, 0), (2, 0)], start=1):
        lg = [{"event": "joined", "t": 0.0, "started": 0.0, "pid": pid}]
        prev = 0.0
        for i, t in enumerate(ts if rank < 2 else ts[:2], start=1):
            lg.append({"t": t, "dt": t - prev, "step": i, "round": i // 4, "discards": 0})
            prev = t
        logs[(rank, life)] = lg
    logs[(2, 1)] = [{"event": "joined", "t": ts[10] + 0.5, "started": ts[10], "pid": 4},
                    {"t": ts[11], "dt": 1.0, "step": 12, "round": 3, "discards": 0, "contributes": False}]
    kills = [{"rank": 2, "life": 0, "t": ts[1] + 0.5, "pid": 3, "survivors": [1, 2]}]
    assert median_round_step(logs) == 3.0 and median_step(logs) == 1.0
    (a,) = admission_stalls(logs, kills, median_step(logs))
    (r,) = admission_stalls(logs, kills, median_round_step(logs))
    assert math.isclose(a["admission_stall_s"], 3.0) and math.isclose(r["admission_stall_s"], 1.0), (a, r)


def test_a_joiner_admitted_in_its_own_kills_re_run_has_no_admission_stall_of_its_own() -> None:
    from shoal.bench.chaos_stats import admission_stalls
    logs, kills = _join_with_a_kill_in_its_download()
    logs[(2, 1)] = _steps(104, 11.0, [(13.0, 0), (14.0, 0)], first=11, started=10.5)   # in the retry 10.0 -> 13.0
    assert admission_stalls(logs, kills, 1.0) == [{"rank": 2, "life": 1, "admission_stall_s": None,
                                                   "kill_in_gap": None, "in_own_kill_gap": True}]


def test_the_bench_summary_reports_the_admission_stall_beside_the_window_and_the_downloads_cost(tmp_path) -> None:
    import json

    from shoal.bench.chaos import _summarise
    logs, kills = _join_with_a_kill_in_its_download()
    for (rank, life), lg in logs.items():
        lg[0].update(heal_s=0.0, heal_bytes=0, params=1)   # what the bench's workers add to ``joined``
        (tmp_path / f"log-{rank}-{life}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lg))
    got = _summarise(str(tmp_path), kills, wall=30.0, batch=8, began=0.0)
    assert got["stall_per_join_admission_s"] == {"n": 1, "median": 2.0, "max": 2.0}, got
    assert got["stall_per_join_admission_vs_round_s"] == got["stall_per_join_admission_s"], got   # DDP: alike
    assert got["stall_per_join_s"] == {"n": 1, "median": 3.5, "max": 3.5}, got   # the window figure, as before
    assert got["download_cost_per_join_s"] == {"n": 1, "median": 0.7, "max": 0.7}, got
    assert got["download_step_max_s"] == {"n": 1, "median": 0.5, "max": 0.5}, got
    assert got["joins_admitted_in_their_kills_gap"] == 0
    (row,) = got["per_join_admission"]
    assert (row["rank"], row["life"], row["download_steps"], row["kill_in_gap"]) == (2, 1, 4, False), row


def _local(steps: range, period: int, contributes: Any = True) -> list[dict[str, Any]]:
    """A DiLoCo worker's log: one entry per inner step, its round counter advancing after each ``period``."""
    return [{"t": float(s), "dt": 1.0, "step": s, "discards": 0, "round": s // period,
             "contributes": contributes(s) if callable(contributes) else contributes} for s in steps]


def test_diloco_loses_the_steps_since_its_last_round_and_streaming_each_fragments_since_its_launch() -> None:
    from shoal.bench.chaos_stats import unsynced_steps
    diloco = {"period": 8, "offsets": [0], "weights": [1.0]}
    assert unsynced_steps(_local(range(1, 12), 8), diloco) == 3.0          # steps 9..11 since the round at 8
    assert unsynced_steps(_local(range(1, 8), 8), diloco) == 7.0           # the first period: all of it
    assert unsynced_steps(_local(range(1, 9), 8), diloco) == 0.0           # killed right after its round
    # Streaming, 4 fragments launching after steps 2, 4, 6, 0 of each period of 8 (a round every 2 steps):
    # killed after step 13, the fragments hold its progress up to steps 10, 12, 6, 8: 3+1+7+5 steps lost.
    streaming = {"period": 8, "offsets": [2, 4, 6, 0], "weights": [0.25] * 4}
    log = _local(range(1, 14), 2)
    assert unsynced_steps(log, streaming) == 4.0
    assert unsynced_steps(log) == 1.0   # what the rounds alone say: the step since the last fragment's round
    # Weighted by each fragment's share of the parameters.
    assert unsynced_steps(log, {"period": 8, "offsets": [2, 6], "weights": [0.75, 0.25]}) == 0.75 * 3 + 0.25 * 7


def test_a_joiner_loses_only_the_steps_it_contributed() -> None:
    from shoal.bench.chaos_stats import unsynced_steps
    diloco = {"period": 8, "offsets": [0], "weights": [1.0]}
    downloading = _local(range(9, 15), 8, contributes=False)              # killed before it contributed
    assert unsynced_steps(downloading, diloco) == 0.0 and unsynced_steps(downloading) == 0.0
    entered = _local(range(9, 15), 8, contributes=lambda s: s > 11)        # loaded after step 11: 12..14 count
    assert unsynced_steps(entered, diloco) == 3.0


def test_the_bench_summary_subtracts_each_fragments_unsynced_steps_from_the_goodput(tmp_path) -> None:
    import json

    from shoal.bench.chaos import _summarise
    sync = {"period": 8, "offsets": [2, 4, 6, 0], "weights": [0.25] * 4}
    logs = {(r, 0): [{"event": "joined", "t": 0.0, "started": 0.0, "pid": 10 + r, "heal_s": 0.0, "heal_bytes": 0,
                      "params": 1, "sync": sync}] + _local(range(1, 17 if r else 14), 2) for r in range(2)}
    for (rank, life), lg in logs.items():
        (tmp_path / f"log-{rank}-{life}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lg))
    kills = [{"rank": 0, "life": 0, "t": 13.5, "pid": 10, "survivors": [11]}]
    got = _summarise(str(tmp_path), kills, wall=16.0, batch=1, began=0.0)
    assert got["local_steps_lost_per_failure"] == 4.0, got
    assert math.isclose(got["goodput_exact"], (13 + 16 - 4.0) / 16.0), got


def test_steps_trained_before_the_admission_count_only_if_the_round_that_admitted_it_took_them() -> None:
    from shoal.bench.chaos_stats import admission_stalls, progress_steps, unsynced_steps

    def restart(kept: int | None) -> list[dict[str, Any]]:
        # Three inner steps on its own counter before its admission (``early``), then the survivors' step 40 on.
        out: list[dict[str, Any]] = [{"event": "joined", "t": 5.0, "started": 4.0, "pid": 7}]
        out += [{"t": 5.0 + i, "dt": 1.0, "step": i, "round": 0, "discards": 0, "early": True} for i in (1, 2, 3)]
        if kept is not None:   # admitted (else killed before that)
            out.append({"t": 9.0, "dt": 1.0, "step": 40, "round": 10, "discards": 0, "early": False})
            out.append({"event": "early", "t": 9.0, "steps": 3, "kept": kept})
            out.append({"t": 10.0, "dt": 1.0, "step": 41, "round": 10, "discards": 0, "early": False})
        return out

    assert [e["step"] for e in progress_steps(restart(3))] == [1, 2, 3, 40, 41]
    # ... committed by the round that admitted it (at 9.0), not when they were trained
    assert [e["t"] for e in progress_steps(restart(3))] == [9.0, 9.0, 9.0, 9.0, 10.0]
    assert [e["step"] for e in progress_steps(restart(2))] == [2, 3, 40, 41]   # reloaded after the first
    assert [e["step"] for e in progress_steps(restart(0))] == [40, 41]   # dropped as stale
    assert progress_steps(restart(None)) == []   # killed before its admission: nothing of it counts
    assert unsynced_steps(restart(None), {"period": 8, "offsets": [0], "weights": [1.0]}) == 0.0
    # Its admission is the first step after the early ones, not its first logged step.
    survivor = [{"event": "joined", "t": 0.0, "started": 0.0, "pid": 1}] + [
        {"t": float(t), "dt": 1.0, "step": t, "round": t // 4, "discards": 0} for t in range(1, 8)] + [
        {"t": 9.5, "dt": 1.0, "step": 40, "round": 10, "discards": 0}]
    logs = {(0, 0): survivor, (1, 0): [{"event": "joined", "t": 0.0, "started": 0.0, "pid": 2}],
            (1, 1): restart(3)}
    got = admission_stalls(logs, [{"t": 0.5, "rank": 1, "life": 0, "survivors": [1]}], median=1.0)
    assert got[0]["admission_stall_s"] == 1.5   # the survivor's gap 7.0 -> 9.5 that committed round 10


def test_the_stall_beyond_the_step_in_flight_leaves_out_what_that_step_had_run_at_the_kill() -> None:
    """Issue #20's "a kill costs at most the step in flight + 2 s": the work the step in flight had done when the
    kill struck is lost anyway; what comes after (detection, the new quorum, waits) is the kill's own cost."""
    def log(pid: int, start_of_failed: float) -> list[dict[str, object]]:
        return [{"event": "joined", "t": 0.0, "started": 0.0, "pid": pid},
                {"t": 10.0, "dt": 10.0, "step": 1, "discards": 0},
                # the step in flight began at start_of_failed; the kill at 20.0 failed it at 21.0
                {"t": 21.0, "dt": 21.0 - start_of_failed, "step": 1, "discards": 1},
                {"t": 31.0, "dt": 10.0, "step": 2, "discards": 0}]
    kill = [{"rank": 2, "life": 0, "t": 20.0, "survivors": [1, 2]}]
    # survivor 1's step had run 9.5 s at the kill (from 10.5), survivor 2's 2 s (it began late, at 18)
    k = kill_stalls({(0, 0): log(1, 10.5), (1, 0): log(2, 18.0)}, kill, median=10.0)[0]
    assert k["stall_s"] == 11.0                        # the gap 10 -> 31, less a median step
    assert k["beyond_in_flight_s"] == 9.0              # survivor 2: 21 - 2 - 10 (its 8 s before that step count)
    assert in_flight(log(1, 10.5), 20.0) == 9.5
    assert in_flight(log(1, 10.5), 40.0) == 0.0        # no step spans it
