"""shoal.bench.chaos's per-join report: the joiner's start-to-contribution, bytes, and the survivors' stall."""

from __future__ import annotations

from shoal.bench.chaos_stats import joins


def _steps(ts: list[float], contributes: bool = True) -> list[dict[str, object]]:
    return [{"t": t, "dt": 0.1, "contributes": contributes} for t in ts]


def test_a_join_reports_start_to_contribution_bytes_and_the_survivors_longest_gap_meanwhile() -> None:
    joiner = [{"event": "joined", "t": 10.0, "started": 8.0, "heal_bytes": 0}, {"event": "joining", "t": 10.5},
              *_steps([11.0, 11.1], contributes=False), *_steps([11.2]),
              {"event": "contributing", "t": 11.2, "heal_bytes": 5000, "download_bytes": 5000,
               "by_source": {"0": 3000, "2": 2000}, "slots": 2, "pauses": 1, "download_s": 0.8, "held_s": 0.25,
               "between_rounds": True, "prefetched_bytes": 1500, "seeded_bytes": 2500}, *_steps([11.3])]
    survivor = [*_steps([9.0, 9.1, 10.4, 10.6, 11.1, 11.2, 11.3])]   # a 1.3 s gap before the join asked: not its own
    first_life = [{"event": "joined", "t": 1.0, "started": 0.5, "heal_bytes": 0}, *_steps([2.0])]
    got = joins({(1, 1): joiner, (0, 0): survivor, (1, 0): first_life}, normal=0.1)
    assert got == [{"rank": 1, "life": 1, "start_to_contribute_s": 3.2, "survivor_stall_s": 0.4,
                    "steps_before_contributing": 2, "state_bytes": 5000, "downloaded_bytes": 5000,
                    "by_source": {"0": 3000, "2": 2000}, "slots": 2, "pauses": 1, "download_s": 0.8, "held_s": 0.25,
                    "between_rounds": True, "prefetched_bytes": 1500, "seeded_bytes": 2500,
                    "trained_before_admission": -1}]
