"""The chaos bench's per-kill and per-join stalls and goodput, on made-up logs with known answers."""

from __future__ import annotations

import math
from typing import Any

from shoal.bench.chaos_stats import goodput, join_stalls, kill_stalls, median_step, spread


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
    assert kill_stalls(logs, late, 0.5) == [{"rank": 0, "life": 0, "n": 0, "stall_s": None}]


def test_goodput_counts_committed_steps_only_less_the_lost_ones() -> None:
    logs, _ = _run()
    committed = sum(1 for lg in logs.values() for e in lg if "dt" in e and not e["discards"])
    assert committed == 33 + 33 + 20 + 3                   # the discarded attempts do not count
    assert math.isclose(goodput(logs, samples_per_step=16, wall=20.0), 16 * committed / 20.0)
    assert math.isclose(goodput(logs, samples_per_step=16, wall=20.0, lost=4), 16 * (committed - 4) / 20.0)
    ff = {(r, 0): _log(r, 0.0, 0.0, [(0.5 * i, 0) for i in range(1, 41)]) for r in range(3)}
    assert goodput(ff, 16, 20.0) == 16 * 120 / 20.0


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
