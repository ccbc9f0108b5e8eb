"""The background heal (SHOAL_HEAL=background) under real processes: gloo on loopback, a coordinator in the test.

A joiner is admitted before its download, the survivors keep committing while
it downloads (its download is parked until they committed some steps: the
checks run every time, whatever the machine's speed), it replays what it
missed and ends bitwise equal to the survivors; a source SIGKILLed
mid-transfer loses its ranges to the other sources. With SHOAL_HEAL_PACE the
same, the download asking for ranges only in the slots the commits open.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

ENV = {"SHOAL_HEAL": "background"}


def _check_join(final: list[dict[str, Any]], park: int, why: str, complete: bool = True) -> dict[str, Any]:
    """The joiner's story; returns its catch-up stats (``complete``: no contributor died meanwhile)."""
    *survivors, joiner = final
    cu = joiner["catchup"]
    admitted, caught = cu["admitted_step"], cu["caught_up_step"]
    # Admitted before its download: it voted on committed steps as a non-contributor while it downloaded.
    assert admitted >= 0 and caught >= admitted + park, why
    downloading = [e for e in joiner["log"] if e["committed"] and not e["contributes"] and e["step"] > admitted]
    assert downloading and downloading[0]["step"] == admitted + 1, why
    # The survivors kept committing during the download: their commits of steps admitted..caught-1.
    for s in survivors:
        during = [e for e in s["log"] if e["committed"] and admitted < e["step"] <= caught]
        assert len(during) >= park > 0, why
        assert all(e["contributors"] == e["size"] - 1 for e in during), why   # the joiner counts zero
    assert cu["replayed"] == caught - admitted, why
    # From its first contributing step on, the joiner equals the survivors after every step.
    peer = {e["step"]: e["digest"] for e in survivors[0]["log"] if e["committed"]}
    mine = [e for e in joiner["log"] if e["committed"] and e["contributes"]]
    assert mine and all(e["digest"] == peer[e["step"]] for e in mine), why
    assert mine[0]["step"] == caught + 2, why   # contributes from the step after the one it caught up at
    # The joiner counted zero: during the download the mean every survivor received is the mean of the
    # survivors' own gradients (each computed apart, on a copy of the model, from the same batch).
    by_step: dict[int, list[dict[str, Any]]] = {}
    for s in survivors:
        for g in s["grads"]:
            by_step.setdefault(g["step"], []).append(g)
    full = [gs for gs in by_step.values() if len(gs) == gs[0]["contributors"]]   # every contributor logged it
    assert full or not complete, why
    for gs in full:
        ref = sum(g["local"] / len(gs) for g in gs)
        for g in gs:
            assert torch.allclose(g["mean"], ref, rtol=1e-5, atol=1e-7), why
    assert joiner["stats"]["heals_received"] == 1, why
    assert 0 < cu["download_bytes"] == joiner["stats"]["heal_bytes"], why
    harness.assert_equal_state(final)
    return cu


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["ddp", "wrap", "paced"])
def test_joiner_admitted_before_download_survivors_commit_and_state_is_bitwise_equal(path: str, tmp_path: Any) -> None:
    park = 3
    extra = ["--wrap"] if path == "wrap" else []
    env = {**ENV, "SHOAL_HEAL_PACE": "0.5"} if path == "paced" else ENV
    out = harness.run(str(tmp_path), 3, ["--joiner", "2", "--park", str(park), *extra], env=env, hard_limit=100,
                      restarts=0, script="catchup_worker.py", initial_workers=2)
    why = out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], why
    cu = _check_join(final, park, why)
    # Striped: both survivors served part of it, and the parts make the whole state.
    assert len(cu["by_source"]) == 2 and all(n > 0 for n in cu["by_source"].values()), why
    assert sum(cu["by_source"].values()) == cu["download_bytes"], why
    paced = final[2]["paced"]
    if path == "paced":   # SHOAL_HEAL_PACE: no range asked for before a commit after the admission opened a slot
        assert paced and min(paced) >= 1 and cu["slots"] >= 1, why
    else:
        assert paced and set(paced) == {-1} and cu["slots"] == 0, why


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pace", ["", "0.5"])
def test_source_killed_mid_transfer_joiner_finishes_from_the_others(pace: str, tmp_path: Any) -> None:
    stop = threading.Event()

    def killer() -> None:   # SIGKILL rank 1 once the joiner holds part of the state, then let it go on
        while not stop.is_set() and not (tmp_path / "midway").exists():
            time.sleep(0.01)
        if stop.is_set():
            return
        pid = int((tmp_path / "pid-1").read_text())
        os.killpg(pid, signal.SIGKILL)
        (tmp_path / "killed").touch()

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        out = harness.run(str(tmp_path), 4, ["--joiner", "3", "--park", "2", "--midway"],
                          env={**ENV, "SHOAL_HEAL_PACE": pace},
                          hard_limit=100, restarts=0, script="catchup_worker.py", initial_workers=3)
    finally:
        stop.set()
    why = out.logs
    assert [r for r, _ in out.deaths] == [1], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (2, 0), (3, 0)], why
    cu = _check_join(final, 2, why, complete=False)
    assert cu["failed_sources"] != [] and len(cu["failed_sources"]) == 1, why
    alive = [m for m in cu["by_source"] if m not in cu["failed_sources"]]
    assert len(alive) == 2 and all(cu["by_source"][m] > 0 for m in alive), why
    assert (cu["slots"] >= 1) == bool(pace), why   # paced: the stripes of the lost source came in slots too
    # Paced: the step the kill failed closed the joiner's slot (its first failure, recorded on the group, reached
    # the catch-up): the survivors' recovery and retried step had the link to themselves.
    assert (cu["pauses"] >= 1) == bool(pace), why


@pytest.mark.timeout(120)
def test_ddp_with_a_codec_refuses_and_heals_blocking(tmp_path: Any) -> None:
    # A codec's means count every member: with SHOAL_HEAL=background the group still heals blocking
    # (no non-contributor ever), and the joiner equals the survivors from its first step.
    out = harness.run(str(tmp_path), 3, ["--joiner", "2", "--powersgd"], env=ENV, hard_limit=100,
                      restarts=0, script="catchup_worker.py", initial_workers=2)
    why = out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], why
    joiner = final[2]
    assert joiner["catchup"]["admitted_step"] == -1 and joiner["stats"]["heals_received"] == 1, why
    assert all(e["contributes"] and e["contributors"] == e["size"] for r in final for e in r["log"]), why
    peer = {e["step"]: e["digest"] for e in final[0]["log"] if e["committed"]}
    assert joiner["log"][0]["committed"] and joiner["log"][0]["digest"] == peer[joiner["log"][0]["step"]], why
    harness.assert_equal_state(final)


@pytest.mark.timeout(120)
def test_every_source_gone_mid_transfer_joiner_fails_one_step_and_is_admitted_again(tmp_path: Any) -> None:
    # Both survivors stop serving the snapshot while the joiner holds part of it: its download fails,
    # it fails that step (one discard), is needy in the next quorum and heals from a fresh snapshot.
    stop = threading.Event()

    def dropper() -> None:
        while not stop.is_set() and not (tmp_path / "midway").exists():
            time.sleep(0.01)
        (tmp_path / "dropall").touch()
        while not stop.is_set() and not all((tmp_path / f"dropped-{r}").exists() for r in (0, 1)):
            time.sleep(0.01)
        (tmp_path / "killed").touch()   # lets the joiner's download go on, against no source

    t = threading.Thread(target=dropper, daemon=True)
    t.start()
    try:
        out = harness.run(str(tmp_path), 3, ["--joiner", "2", "--park", "2", "--midway", "--drop-on"], env=ENV,
                          hard_limit=100, restarts=0, script="catchup_worker.py", initial_workers=2)
    finally:
        stop.set()
    why = out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)] and not out.deaths, why
    cu = final[2]["catchup"]
    assert cu["admissions"] == 2 and cu["failed_sources"] == [], why   # the second download had no failure
    assert final[0]["stats"]["discards"] >= 1, why
    _check_join(final, 2, why, complete=False)


@pytest.mark.timeout(120)
def test_a_run_ending_while_the_joiner_downloads_leaves_it_caught_up(tmp_path: Any) -> None:
    # The loop ends at the first step with the joiner in the quorum, while its download is parked: its
    # leave() waits for the download and replays (the survivors' leave() waits until it has fetched),
    # so what it saves after leave() is the run's state.
    out = harness.run(str(tmp_path), 3, ["--joiner", "2", "--park", "1", "--end-at-admission", "--steps", "8"],
                      env=ENV, hard_limit=100, restarts=0, script="catchup_worker.py", initial_workers=2)
    why = out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], why
    joiner = final[2]
    assert joiner["catchup"]["admitted_step"] >= 0 and joiner["catchup"]["caught_up_step"] == -1, why
    assert all(not e["contributes"] for e in joiner["log"]), why        # it never contributed in the loop
    assert joiner["caught_up"] and joiner["stats"]["heals_received"] == 1, why
    harness.assert_equal_state([{**r, "cursor": 0} for r in final])   # model and optimizer (the cursor is not topped up)
