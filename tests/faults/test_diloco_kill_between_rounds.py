"""A worker SIGKILLed between two outer rounds costs DiLoCo's survivors no failed round: gloo on loopback, world 3.

Rank 2 SIGKILLs itself during the inner steps. The survivors' peer watch
(:mod:`shoal.membership.watch`) sees its heartbeat stop, raises the quorum's
abort flag and asks the coordinator for a new quorum; before the next outer
round each survivor leaves the dissolved quorum
(:meth:`ElasticGroup.renew_if_dissolved`), so the round runs once, over the
two survivors: no round is discarded or run again. The survivors park after
the kill until their quorum is dissolved, so the round always starts after
the detection (counted, not timed); the coordinator's ``heartbeat_timeout``
is set far longer than that park, so only the watch can dissolve it in time.
Afterwards both survivors hold bitwise-equal parameters, global copies and
outer optimizer state. DiLoCo, and streaming DiLoCo (two fragments, no
overlap: a round every two inner steps).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

KILL_AT = 5   # an inner step between rounds: DiLoCo's at 4 and 8, streaming DiLoCo's at 4 and 6 (2 fragments)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2])
def test_kill_between_outer_rounds_costs_no_failed_round(fragments: int, tmp_path: Any) -> None:
    out = harness.run(str(tmp_path), 3, ["--kill-at", str(KILL_AT), "--fragments", str(fragments)],
                      hard_limit=100, restarts=0, script="diloco_kill_worker.py")
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0)], why
    for r in final:
        assert r["detected"] == KILL_AT, f"rank {r['rank']}: the kill was not detected between the rounds\n{why}"
        # The round after the kill ran once, over the survivors: nothing discarded, no round re-run.
        assert r["discarded"] == [] and r["stats"]["discards"] == 0, why
        assert r["sizes"][-1] == 2 and 3 in r["sizes"], why
    assert sum(r["suspected"] for r in final) >= 1, why   # the watch dissolved the quorum
    a, b = final
    assert a["step"] == b["step"] == 16 and len(a["synced"]) == len(b["synced"]) > 0, why
    for i, (x, y) in enumerate(zip(a["synced"], b["synced"])):
        assert torch.equal(x, y), f"synced tensor {i} differs between the survivors\n{why}"


@pytest.mark.timeout(180)
def test_a_restart_admitted_in_the_renewed_round_downloads_after_it_and_ends_equal(tmp_path: Any) -> None:
    # The victim is restarted and is in a published quorum before the survivors' next outer round: that round
    # re-forms over all three and admits it as a zero-weight downloader (SHOAL_HEAL=background). Nobody's
    # round is discarded, its first download request comes after the admitting round committed (the
    # round's all-reduce has the link to itself), and all three end bitwise equal.
    out = harness.run(str(tmp_path), 3, ["--kill-at", str(KILL_AT), "--rejoin", "--steps", "24"],
                      env={"SHOAL_HEAL": "background"}, hard_limit=160, restarts=1, script="diloco_kill_worker.py")
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    *survivors, joiner = final
    for r in survivors:
        assert r["detected"] == KILL_AT and r["discarded"] == [] and r["stats"]["discards"] == 0, why
    cu = joiner["catchup"]
    assert cu["admitted_step"] >= 0 and joiner["first_chunk_step"] is not None, why
    assert joiner["first_chunk_step"] > cu["admitted_step"] and cu["caught_up_step"] > cu["admitted_step"], why
    ref = survivors[0]
    for r in final[1:]:
        assert r["step"] == ref["step"] == 24 and len(r["synced"]) == len(ref["synced"]) > 0, why
        for i, (x, y) in enumerate(zip(ref["synced"], r["synced"])):
            assert torch.equal(x, y), f"synced tensor {i} differs between rank 0 and rank {r['rank']}\n{why}"
