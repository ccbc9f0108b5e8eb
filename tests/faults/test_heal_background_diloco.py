"""DiLoCo's background heal (SHOAL_HEAL=background) under a real SIGKILL and restart: gloo on loopback, world 3.

Rank 2 is SIGKILLed inside an outer round; the harness restarts it. Its
second life is admitted at once as a zero-weight member of the outer rounds,
and its download is parked until the survivors committed ``PARK`` rounds, so
every check runs every time, whatever the machine's speed: the survivors'
rounds do not wait for the download (they commit while it is parked: counted,
not timed), the joiner replays the outer steps it received with zero weight,
no round is discarded after the admission, and at the end every worker holds
bitwise-equal parameters, global copies and outer optimizer state. DiLoCo,
and streaming DiLoCo with and without overlapped reductions; a codec with
per-worker state heals blocking.

Without overlapped reductions the joiner's download is let finish before a
chosen inner step (``--load-at-phase``), so it loads between two rounds and
its first round takes the inner steps it trained since, weighted by their
share of the period: every member divides that round's mean by the same
``contributors - shortfall``. With them it loads at a round's begin and
contributes from the round after, with full weight.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

ENV = {"SHOAL_HEAL": "background"}
PARK = 2
PERIOD = 4          # diloco_heal_worker.PERIOD
LOAD_AT_PHASE = 1   # the joiner loads at the end of the inner step that starts at this phase of the period


def _assert_equal(final: list[dict[str, Any]], why: str) -> None:
    """Every worker at rank 0's step, with bitwise rank 0's parameters, global copies and outer state."""
    ref = final[0]
    for r in final[1:]:
        assert r["step"] == ref["step"] and len(r["synced"]) == len(ref["synced"]), why
        for i, (a, b) in enumerate(zip(ref["synced"], r["synced"])):
            assert torch.equal(a, b), f"synced tensor {i} differs between rank 0 and rank {r['rank']}\n{why}"


def _check(out: harness.Outcome, fragments: int, between: bool) -> None:
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    *survivors, joiner = final
    cu = joiner["catchup"]
    admitted, caught = cu["admitted_step"], cu["caught_up_step"]
    # Admitted in the background (not healed blocking), and caught up only after PARK more commits.
    assert admitted >= 0 and caught >= admitted + PARK, why
    assert cu["replayed"] == caught - admitted and joiner["stats"]["heals_received"] == 1, why
    assert 0 < cu["download_bytes"] == joiner["stats"]["heal_bytes"], why
    assert len(cu["by_source"]) == 2 and all(n > 0 for n in cu["by_source"].values()), why   # striped
    for s in survivors:
        # The survivors committed the rounds of steps admitted..caught-1 while the joiner downloaded, the
        # joiner in the quorum with zero weight; outer steps among them (what the joiner replayed).
        during = [e for e in s["log"] if admitted <= e["step"] < caught]
        assert [e["step"] for e in during] == list(range(admitted, caught)), why
        assert all(e["size"] == 3 and e["counted"] == 2 and e["mine"] for e in during), why
        assert sum(e["kind"] != "adopt" for e in during) >= 1, why
        # Later it contributes: rounds with all three counted.
        assert any(e["counted"] == 3 and e["kind"] != "adopt" for e in s["log"]), why
    assert [e["step"] for e in survivors[0]["log"]] == [e["step"] for e in survivors[1]["log"]], why
    # Nothing failed after the admission: no round of anyone was discarded (the catch-up costs no retry).
    assert all(s <= admitted for r in final for s in r["discarded"]), why
    mine = {e["step"]: e["mine"] for e in joiner["log"]}
    assert min(mine) == admitted and joiner["contributed"] > 0, why
    assert cu["entered_between_rounds"] == between, why
    if between:
        # Loaded after the inner step at LOAD_AT_PHASE, so its first contributing round is the next one
        # with progress since then: k of PERIOD inner steps, the same weight in every member's division.
        first = min(s for s, m in mine.items() if m)
        assert first >= caught and not any(m for s, m in mine.items() if s < first), why
        assert all(m for s, m in mine.items() if s >= first), why
        k = cu["first_weight"] * PERIOD
        assert 0 < k < PERIOD and k == int(k), why
        if fragments == 1:   # the round at the period's end: the inner steps after the loading one
            assert k == PERIOD - (LOAD_AT_PHASE + 1) and first == caught, why
        for s in survivors:
            short = {e["step"]: e["short"] for e in s["log"]}
            assert short[first] == pytest.approx(1.0 - cu["first_weight"]), why
            # Every later round has a full period behind it (PERIOD 4, loaded at phase 2): weight 1 again.
            assert all(v == 0.0 for st, v in short.items() if st != first), why
    else:
        # Zero weight up to the round it caught up at, a contributor with full weight from the next one.
        assert not any(m for s, m in mine.items() if s <= caught), why
        assert all(m for s, m in mine.items() if s > caught), why
        assert all(e["short"] == 0.0 for s in survivors for e in s["log"]), why
    assert len(survivors[0]["synced"]) == (6 if fragments == 1 else 0) + fragments + 6, why   # params, globals, momenta
    _assert_equal(final, why)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 0), (2, 1)])
def test_diloco_joiner_admitted_with_zero_weight_replays_outer_steps_bitwise(fragments: int, overlap: int,
                                                                            tmp_path: Any) -> None:
    # (1, 0): DiLoCo; (2, 0): streaming DiLoCo, a round per fragment; (2, 1): streaming DiLoCo whose
    # reductions run in the background for one inner step (the joiner takes part with zero weight).
    out = harness.run(str(tmp_path), 3, ["--park", str(PARK), "--fragments", str(fragments), "--overlap",
                                         str(overlap), "--load-at-phase", str(LOAD_AT_PHASE)],
                      env=ENV, hard_limit=130, restarts=1, script="diloco_heal_worker.py")
    _check(out, fragments, between=overlap == 0)


def _rank_2_restarted(tmp_path: Any, args: list[str]) -> tuple[list[dict[str, Any]], str]:
    """Run the three workers with ``args``; rank 2 died once and its restart ended with the others: (final, logs)."""
    out = harness.run(str(tmp_path), 3, args, env=ENV, hard_limit=130, restarts=1, script="diloco_heal_worker.py")
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    return final, why


@pytest.mark.timeout(150)
def test_diloco_with_a_codec_of_per_worker_state_refuses_and_heals_blocking(tmp_path: Any) -> None:
    # PowerSGD keeps error feedback of each worker's own: the group heals blocking (the joiner is never a
    # zero-weight downloader) and still ends bitwise equal.
    out = harness.run(str(tmp_path), 3, ["--powersgd"], env=ENV, hard_limit=130, restarts=1,
                      script="diloco_heal_worker.py")
    why = out.logs
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    joiner = final[2]
    assert joiner["catchup"]["admitted_step"] == -1 and joiner["stats"]["heals_received"] == 1, why
    assert all(e["mine"] for e in joiner["log"] if e["step"] > min(x["step"] for x in joiner["log"])), why
    for r in final[1:]:
        for a, b in zip(final[0]["synced"], r["synced"]):
            assert torch.equal(a, b), why


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fragments", [1, 2])
def test_a_restart_before_the_next_round_downloads_before_its_admission(fragments: int, tmp_path: Any) -> None:
    # Rank 2 dies between two rounds; its restart is published in a quorum before the survivors' next round,
    # which the survivors hold until they have sent it bytes. The survivors offer it the snapshot from their
    # inner steps (the global copies and outer state no inner step changes), its download starts while it
    # waits for that round, and its admission keeps it: the state at the admitting step's begin. It then
    # replays the admitting round, enters, and all three end bitwise equal.
    final, why = _rank_2_restarted(tmp_path, ["--early", "--park", "0", "--fragments", str(fragments)])
    *survivors, joiner = final
    cu = joiner["catchup"]
    # Offered once, from the inner steps, and not again at the admission (no step committed in between).
    assert all(s["catchup"]["offered_early"] == 1 and s["catchup"]["served"] == 1 for s in survivors), why
    assert cu["admitted_step"] >= 0 and cu["admissions"] == 1, why   # in the background, once
    assert 0 < cu["prefetched_bytes"] <= cu["download_bytes"] == joiner["stats"]["heal_bytes"], why
    assert all(s <= cu["admitted_step"] for r in final for s in r["discarded"]), why
    _assert_equal(final, why)


@pytest.mark.timeout(150)
def test_a_restart_published_after_the_survivors_renewed_is_admitted_at_their_next_round(tmp_path: Any) -> None:
    # Rank 2 dies in a round; the survivors rerun it in a quorum of two and only then is its restart published.
    # That quorum lost no member, yet it must not run its next round without the restart: the first survivor
    # to see the newer quorum dissolves theirs between rounds and offers the snapshot, the restart downloads
    # before that round (which it holds until it served bytes), and that round admits it: no second round
    # of two, no empty round to adopt it. All three end bitwise equal.
    out = harness.run(str(tmp_path), 3, ["--park", "0", "--served-before-round"], env=ENV, hard_limit=130,
                      restarts=1, script="diloco_heal_worker.py")
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    *survivors, joiner = final
    cu = joiner["catchup"]
    assert 1 <= sum(s["catchup"]["dissolved_for_join"] for s in survivors) <= 2, why
    assert all(s["catchup"]["offered_early"] == 1 and s["catchup"]["served"] == 1 for s in survivors), why
    assert cu["admitted_step"] >= 0 and cu["admissions"] == 1, why
    assert 0 < cu["prefetched_bytes"] <= cu["download_bytes"] == joiner["stats"]["heal_bytes"], why
    for s in survivors:
        assert [e["kind"] for e in s["log"] if e["step"] > 0].count("adopt") == 0, why   # but the first quorum's
        assert len([e for e in s["log"] if e["size"] == 2]) == 1, why   # the rerun of the round it died in
        rerun = next(e["step"] for e in s["log"] if e["size"] == 2)
        assert min(e["step"] for e in s["log"] if e["size"] == 3 and e["step"] > rerun) == cu["admitted_step"], why
        # That round counts it only if its download ended before the survivors reached the round, so that it
        # trained from that state before its admission (shoal.membership.preadmit); else it is zero weight there.
        admitting = [e for e in s["log"] if e["step"] == cu["admitted_step"]]
        assert [e["counted"] for e in admitting] == [3 if cu["trained_before_admission"] >= 0 else 2], why
    assert all(s <= cu["admitted_step"] for r in final for s in r["discarded"]), why
    _assert_equal(final, why)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fragments", [1, 2])
def test_a_restart_on_the_same_host_takes_the_unchanged_state_from_its_copy(fragments: int, tmp_path: Any) -> None:
    # As above (rank 2 dies between two rounds, its restart is admitted at the survivors' next round), with
    # SHOAL_STATE_CACHE: each worker wrote the global copies and outer state after every round, and no round
    # committed between the death and the admission, so the restart's copy matches every range the sources
    # published: nothing crosses the network, and all three still end bitwise equal. (A copy that is partly
    # stale, as a streaming fragment synchronised since: tests/unit/test_state_seed.py.)
    cache = tmp_path / "cache"
    cache.mkdir()
    final, why = _rank_2_restarted(tmp_path, ["--early", "--park", "0", "--fragments", str(fragments),
                                              "--hidden", "64", "--state-cache", str(cache)])
    *survivors, joiner = final
    cu = joiner["catchup"]
    assert cu["admitted_step"] >= 0 and cu["admissions"] == 1, why   # in the background, once
    assert cu["seeded_bytes"] == joiner["stats"]["heal_bytes"] > 0 and cu["download_bytes"] == 0, why
    assert all(s["seed_writes"] >= 2 for s in final), why   # the initial state, then after rounds
    assert all(s <= cu["admitted_step"] for r in final for s in r["discarded"]), why
    _assert_own_resumed(joiner, why)
    _assert_equal(final, why)


def _assert_own_resumed(joiner: dict[str, Any], why: str, resumed: bool = True) -> None:
    """The restart's inner Adam resumed the step count its first life had at the kill (2 periods: its host's
    copy, seed.py, was written after that round), not an empty one: it counts those plus its steps since its
    last load (not resumed: only those)."""
    since = joiner["step"] - joiner["entered"]
    assert (joiner["catchup"]["own_restored"] >= 1) == resumed, why
    assert joiner["inner_step"] == (2 * PERIOD if resumed else 0) + since and since > 0, why



@pytest.mark.timeout(150)
@pytest.mark.parametrize("seeded", [False, True])
def test_a_restart_holding_the_state_trains_before_its_admission_and_its_round_takes_it(seeded: bool,
                                                                                       tmp_path: Any) -> None:
    # Rank 2 dies between two rounds; its restart fetches the snapshot the survivors offer from their inner steps
    # (or, seeded, takes it from its host's copy) and, holding the state their next round starts from, trains
    # from it instead of waiting at that round's barrier (shoal.membership.preadmit). The survivors hold that
    # round until it trained 2 inner steps, and it trains one more once they wait at the barrier. The round that
    # admits it takes those 3, weighted 3/4 (their share of the period), the same shortfall on every member;
    # nothing is discarded; all end bitwise equal. From its host's copy it trains at once, before the download
    # has checked the copy (on this fast loopback many steps: weight 1).
    args = ["--early", "--park", "0", "--train-before-admission", "2"]
    if seeded:
        cache = tmp_path / "cache"
        cache.mkdir()
        args += ["--hidden", "64", "--state-cache", str(cache)]
    final, why = _rank_2_restarted(tmp_path, args)
    *survivors, joiner = final
    cu = joiner["catchup"]
    k, admitted = cu["trained_before_admission"], cu["admitted_step"]
    assert (k >= 3 if seeded else k == 3) and admitted > 0 and cu["admissions"] == 1, why
    assert cu["entered_between_rounds"], why
    assert cu["caught_up_step"] == admitted and cu["replayed"] == 0, why   # loaded before: nothing to replay
    assert joiner["stats"]["heals_received"] == 1 and joiner["stats"]["heal_bytes"] > 0, why
    assert cu["early_from_copy"] == seeded and cu["early_reloads"] == 0, why
    if seeded:
        assert cu["seeded_bytes"] == joiner["stats"]["heal_bytes"] and cu["download_bytes"] == 0, why
    else:
        assert 0 < cu["download_bytes"] == joiner["stats"]["heal_bytes"], why
    _assert_own_resumed(joiner, why, resumed=seeded)   # without a host's copy its inner optimizer starts empty
    weight = min(1.0, k / PERIOD)
    assert cu["first_weight"] == pytest.approx(weight), why
    for s in survivors:
        at = [e for e in s["log"] if e["step"] == admitted]
        # The round that admitted it counted all three, the joiner short of 1 - k/H.
        assert len(at) == 1 and at[0]["kind"] == "fragment:0" and at[0]["size"] == 3, why
        assert at[0]["counted"] == 3 and at[0]["short"] == pytest.approx(1.0 - weight), why
    mine = {e["step"]: e["mine"] for e in joiner["log"]}
    assert min(mine) == admitted and all(mine.values()), why   # a contributor from its admission on
    assert all(s <= admitted for r in final for s in r["discarded"]), why
    _assert_equal(final, why)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("progress", [False, True])
def test_a_restart_with_a_stale_copy_trains_from_it_then_from_the_offered_state_which_its_round_takes(
        progress: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 2 dies in a round; the survivors rerun it without it, so its host's copy (written before that round)
    # is one round behind. Its restart loads the copy at once and trains from it while the download the
    # survivors offer runs; that download ends with other bytes, so it reloads them and trains from there
    # (the steps from the stale copy count for nothing). The survivors hold their next round until it trained
    # 2 steps from the offered state; their round admits it with the 3 it trained (weight 3/4), and all three
    # end bitwise equal. With its first life's progress kept after every inner step (SHOAL_STATE_CACHE_EVERY=1)
    # the restart first goes on from those steps, which went on from the stale copy: dropped with it.
    cache = tmp_path / "cache"
    cache.mkdir()
    if progress:
        monkeypatch.setenv("SHOAL_STATE_CACHE_EVERY", "1")
    final, why = _rank_2_restarted(tmp_path, ["--park", "0", "--served-before-round", "--train-before-admission",
                                              "2", "--hidden", "64", "--state-cache", str(cache)])
    *survivors, joiner = final
    cu = joiner["catchup"]
    assert cu["early_from_copy"] and cu["early_reloads"] == 1, why
    traced = "".join(p.read_text() for p in (tmp_path / "trace").glob("*.jsonl"))
    assert ('"progress-resumed"' in traced) == progress and cu["resumed_steps"] == 0, why
    assert cu["trained_before_admission"] == 3 and cu["admissions"] == 1 and cu["caught_up_step"] == \
        cu["admitted_step"], why
    assert 0 < cu["download_bytes"] == joiner["stats"]["heal_bytes"], why   # the copy matched no range
    for s in survivors:
        at = [e for e in s["log"] if e["step"] == cu["admitted_step"]]
        assert [(e["counted"], e["short"]) for e in at] == [(3, pytest.approx(0.25))], why
    assert all(s <= cu["admitted_step"] for r in final for s in r["discarded"]), why
    _assert_equal(final, why)


@pytest.mark.timeout(150)
def test_a_restart_admitted_before_its_download_checked_a_stale_copy_drops_the_steps_it_trained_from_it(
        tmp_path: Any) -> None:
    # Rank 2 stopped writing its host's copy after the first round, and dies between two rounds: the copy is a
    # round behind. Its restart trains from it at once; its download is parked until after its admission, and
    # the survivors go to their round once it trained 2 steps. The admission cannot check the copy (the
    # download must fetch ranges, held in the round): the steps are dropped, it is a zero-weight downloader in
    # that round, and all three still end bitwise equal (counted, it would have brought a stale pseudo-gradient
    # and stale global copies).
    cache = tmp_path / "cache"
    cache.mkdir()
    final, why = _rank_2_restarted(tmp_path, ["--early", "--park", "1", "--train-before-admission", "2",
                                              "--stale-copy", "--hidden", "64", "--state-cache", str(cache)])
    *survivors, joiner = final
    cu = joiner["catchup"]
    assert cu["early_from_copy"] and cu["early_reloads"] == 0 and cu["trained_before_admission"] == -1, why
    assert cu["admissions"] == 1 and cu["caught_up_step"] > cu["admitted_step"], why
    assert cu["seeded_bytes"] == 0 and 0 < cu["download_bytes"] == joiner["stats"]["heal_bytes"], why
    for s in survivors:
        assert [e["counted"] for e in s["log"] if e["step"] == cu["admitted_step"]] == [2], why
    assert all(s <= cu["admitted_step"] for r in final for s in r["discarded"]), why
    _assert_equal(final, why)


@pytest.mark.timeout(150)
def test_a_restart_goes_on_from_its_last_lifes_inner_steps_kept_on_its_host(tmp_path: Any) -> None:
    # SHOAL_STATE_CACHE_EVERY=1: each member also writes its model and inner optimizer after every inner step
    # beside its host's copy. Rank 2 dies 2 inner steps after a round; its restart loads that copy (no round
    # committed since) and goes on from those 2 steps: its model and inner Adam are bitwise its first life's at
    # the kill, and the round that admits it takes them with the steps it trains itself (weight k/H, the same
    # shortfall on every member). All three end bitwise equal.
    cache = tmp_path / "cache"
    cache.mkdir()
    out = harness.run(str(tmp_path), 3, ["--early", "--park", "0", "--train-before-admission", "2", "--hidden", "64",
                                         "--state-cache", str(cache), "--kill-phase", "2"],
                      env={**ENV, "SHOAL_STATE_CACHE_EVERY": "1"}, hard_limit=130, restarts=1,
                      script="diloco_heal_worker.py")
    why = out.logs
    assert [r for r, _ in out.deaths] == [2], why
    final = out.final()
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    *survivors, joiner = final
    cu = joiner["catchup"]
    assert cu["resumed_steps"] == 2 and cu["early_from_copy"] and cu["early_reloads"] == 0, why
    at_kill, resumed = (torch.load(tmp_path / f, weights_only=True) for f in ("at-kill.keep", "resumed.keep"))
    assert all(torch.equal(a, b) for a, b in zip(at_kill["params"], resumed["params"])), why
    assert at_kill["inner"].keys() == resumed["inner"].keys() and all(
        torch.equal(v, resumed["inner"][i][k]) for i, st in at_kill["inner"].items() for k, v in st.items()), why
    k, admitted = cu["trained_before_admission"], cu["admitted_step"]
    assert k >= 3 and admitted > 0 and cu["admissions"] == 1, why   # the 2 resumed and at least 1 of its own
    weight = min(1.0, k / PERIOD)
    assert cu["first_weight"] == pytest.approx(weight), why
    for s in survivors:
        at = [e for e in s["log"] if e["step"] == admitted]
        assert len(at) == 1 and at[0]["counted"] == 3 and at[0]["short"] == pytest.approx(1.0 - weight), why
    assert all(s <= admitted for r in final for s in r["discarded"]), why
    _assert_own_resumed(joiner, why)   # its inner Adam counts on from its first life's steps at the kill
    _assert_equal(final, why)
