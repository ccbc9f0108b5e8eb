"""A member SIGKILLed while a new quorum forms costs the survivors no more than its detection (issue #20).

Run F of docs/BENCHMARKS.md: a restarted worker, admitted in a new quorum,
arrived at that quorum's store barrier while the survivors finished their
step, and was killed there. The survivors then passed the barrier (its
arrival was counted) and waited in the gloo constructor for its address
until ``Timeouts.op``: one step hung 64 s. Here (gloo on loopback, world 3,
``barrier_kill_worker.py``) the same happens deterministically: the
survivors park inside a step until the joiner has arrived and died, then
commit and adopt its quorum. And its twin: a survivor dies inside that step,
after the joiner's quorum was published; the other survivor and the joiner
wait at the new quorum's barrier for the dead one (the coordinator serves no
request about the superseded quorum), which only the coordinator's
``heartbeat_timeout`` ended.

Either way, the second step after the park must commit well within
``heartbeat_timeout`` (10 s, below ``op``, 12 s): the lost member is judged
by its stopped heartbeat within a few ``probe`` windows (0.5 s), not by the
coordinator's ``heartbeat_timeout`` nor by the constructor's ``op``
(:mod:`shoal.membership.rendezvous`). The workers left end bitwise equal.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from barrier_kill_worker import TIMEOUTS  # noqa: E402

PARK, STEPS = 2, 6


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [2, 1], ids=["joiner", "survivor"])
def test_kill_while_a_quorum_forms_costs_the_survivors_only_its_detection(victim: int, tmp_path: Any) -> None:
    out = harness.run(str(tmp_path), 3, ["--park", str(PARK), "--steps", str(STEPS), "--victim", str(victim)],
                      hard_limit=150, restarts=0, script="barrier_kill_worker.py", initial_workers=2,
                      env={"SHOAL_HEAL": "background"})
    why = out.logs
    assert [r for r, _ in out.deaths] == [victim], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(r, 0) for r in range(3) if r != victim], why
    bound = TIMEOUTS.heartbeat_timeout / 2
    survivor = final[0]
    after = [c for c in survivor["commits"] if c[0] >= survivor["released"]]
    # The parked step commits at once over the old quorum, and the next one adopts the new quorum (the joiner
    # died); or it is discarded, adopts it and runs again (a survivor died). Either way the second commit
    # after the release comes after one rendezvous of the new quorum and one over the survivors.
    assert [c[1] for c in after] == list(range(PARK + 1, STEPS + 1)), why
    gap = after[1][0] - survivor["released"]
    assert gap < bound, (f"the second step after the kill committed {gap:.1f} s after it (bound {bound} s; "
                         f"Timeouts.op {TIMEOUTS.op} s): a wait on the dead member\n{why}")
    assert after[1][2] == 2, why   # over the two workers left
    assert all(r["caught_up"] for r in final), why   # a background joiner, too, once its leave() caught it up
    harness.assert_equal_state(final, cursor=False)
