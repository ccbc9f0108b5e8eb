"""A worker SIGKILLed between two rounds costs an averaging strategy's survivors no failed round: gloo on loopback, world 3.

Rank 2 SIGKILLs itself between two of the strategy's rounds (during the
local / inner steps). The survivors' peer watch (:mod:`shoal.membership.watch`)
sees its heartbeat stop, raises the quorum's abort flag and asks the
coordinator for a new quorum; before its next round each survivor leaves the
dissolved quorum (:meth:`ElasticGroup.renew_if_dissolved`), so the round runs
once, over the two survivors: no round is discarded or run again. The
survivors park after the kill until their quorum is dissolved, so the round
always starts after the detection (counted, not timed); the coordinator's
``heartbeat_timeout`` is set far longer than that park, so only the watch can
dissolve it in time. Afterwards both survivors hold bitwise-equal parameters
and strategy state (:func:`strategy_worker.synced_state`).

Per strategy (``KILL``: the step after which the victim dies, between two rounds):

- DiLoCo, streaming DiLoCo (two fragments) without and with overlapped
  reductions: with overlap, the launch after the renewal starts nothing and
  its landing round reduces in the foreground over the survivors;
- local SGD, post-local SGD past its warm-up (without and with local
  gradient groups, launch slots {0, 1} and {2}: then every step is a
  ``DISCARD`` gradient round, renewed before too), Hierarchical (the round
  after the kill is the level of launch slots {0, 1}, whose vote is the
  quorum's);
- DASO: every step is a voted step; the renewal before the next step's
  ``begin_step`` (DASO's admission hook) leaves the dissolved quorum, so not
  even the step after the kill is discarded.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

# (the step after which rank 2 dies, the step at which all stop: right after a round of every member)
KILL = {"diloco": (5, 16), "streaming": (5, 16), "streaming-overlap": (5, 16), "localsgd": (6, 16),
        "postlocal": (9, 16), "postlocal-group": (9, 16), "hierarchical": (6, 16), "daso": (6, 16)}
# the first step >= 16 right after an averaging
END = {"localsgd": 17, "postlocal": 19, "postlocal-group": 19, "hierarchical": 17}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", list(KILL))
def test_kill_between_rounds_costs_no_failed_round(strategy: str, tmp_path: Any) -> None:
    # No liveness links: a dead worker's link would end and the coordinator dissolve the quorum itself
    # (the test below), so only the peer watch is left to see the kill here.
    kill_at, steps = KILL[strategy]
    out = harness.run(str(tmp_path), 3, ["--strategy", strategy, "--kill-at", str(kill_at), "--steps", str(steps)],
                      hard_limit=130, restarts=0, script="kill_worker.py", env={"SHOAL_LIVENESS": "off"})
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0)], why
    for r in final:
        assert r["detected"] == kill_at, f"rank {r['rank']}: the kill was not detected between the rounds\n{why}"
        # The round after the kill ran once, over the survivors: nothing discarded, no round re-run.
        assert r["discarded"] == [] and r["stats"]["discards"] == 0, why
        assert r["sizes"][-1] == 2 and 3 in r["sizes"], why
    assert sum(r["suspected"] for r in final) >= 1, why   # the watch dissolved the quorum
    a, b = final
    assert a["step"] == b["step"] == END.get(strategy, steps) and len(a["synced"]) == len(b["synced"]) > 0, why
    for i, (x, y) in enumerate(zip(a["synced"], b["synced"])):
        assert torch.equal(x, y), f"synced tensor {i} differs between the survivors\n{why}"


@pytest.mark.timeout(150)
def test_with_liveness_links_the_coordinator_dissolves_the_quorum_first(tmp_path: Any) -> None:
    # The dead worker's liveness link ends with its process: the coordinator aborts the quorum and publishes
    # the survivors' at once, before any survivor's watch suspects anyone (its window is two probes, 2 s here).
    kill_at, steps = KILL["diloco"]
    out = harness.run(str(tmp_path), 3, ["--strategy", "diloco", "--kill-at", str(kill_at), "--steps", str(steps)],
                      hard_limit=130, restarts=0, script="kill_worker.py")
    why = out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0)], why
    for r in final:
        assert r["detected"] == kill_at and r["discarded"] == [] and r["stats"]["discards"] == 0, why
        assert r["sizes"][-1] == 2, why
    assert sum(r["suspected"] for r in final) == 0, why
    a, b = final
    for i, (x, y) in enumerate(zip(a["synced"], b["synced"])):
        assert torch.equal(x, y), f"synced tensor {i} differs between the survivors\n{why}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["diloco", "streaming-overlap", "localsgd"])
def test_a_restart_admitted_in_the_renewed_round_ends_equal(strategy: str, tmp_path: Any) -> None:
    # The victim is restarted and is in a published quorum before the survivors' next round: that round
    # re-forms over all three and admits it. Nobody's round is discarded and all three end bitwise equal.
    # DiLoCo admits it as a zero-weight downloader (SHOAL_HEAL=background): its first download request comes
    # either before its admission (the survivors, their quorum dissolved, offer it the snapshot from their inner
    # steps while it waits for their round) or after the admitting round committed, never in a round (the
    # round's all-reduce has the link to itself); with overlap, the
    # admitting round is the landing that the renewal turned into a foreground reduction. Local SGD has no
    # background heal: the admitting round's heal is blocking. (DASO's restart, alone on its host, holds its
    # host's progress, not the survivors': tests/faults/test_elastic_topology.py covers it.)
    kill_at = KILL[strategy][0]
    out = harness.run(str(tmp_path), 3, ["--strategy", strategy, "--kill-at", str(kill_at), "--rejoin",
                                         "--steps", "24"],
                      env={"SHOAL_HEAL": "background"}, hard_limit=160, restarts=1, script="kill_worker.py")
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    *survivors, joiner = final
    for r in survivors:
        assert r["detected"] == kill_at and r["discarded"] == [] and r["stats"]["discards"] == 0, why
    if strategy in ("diloco", "streaming-overlap"):
        cu = joiner["catchup"]
        first = joiner["first_chunk"]
        assert cu["admitted_step"] >= 0 and first["step"] is not None and not first["in_round"], why
        assert cu["caught_up_step"] > cu["admitted_step"], why
        if cu["prefetched_bytes"] > 0:   # the survivors offered it their snapshot during their inner steps
            assert not first["admitted"], why
        else:   # else only after the admitting round's collectives: once it committed, or (a download kept from
            # before the admission, with nothing received yet) during its vote, when no round holds the link
            assert first["admitted"] and first["step"] >= cu["admitted_step"], why
    else:
        assert joiner["stats"]["heals_received"] == 1, why
    ref = survivors[0]
    for r in final[1:]:
        # at least the run's length: the survivors go on (in whole periods) until the joiner has caught up
        assert r["step"] == ref["step"] >= {"diloco": 24, "streaming-overlap": 24, "localsgd": 25}[strategy], why
        assert len(r["synced"]) == len(ref["synced"]) > 0, why
        for i, (x, y) in enumerate(zip(ref["synced"], r["synced"])):
            assert torch.equal(x, y), f"synced tensor {i} differs between rank 0 and rank {r['rank']}\n{why}"
