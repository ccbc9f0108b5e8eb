"""A worker slot's progress since its host's copy (SHOAL_STATE_CACHE_EVERY; seed.keep_progress/resume_progress).

A DiLoCo member writes, every few inner steps, its model and inner optimizer
beside the copy of the global state it went on from; a restart on the same
host that loads that very copy goes on from there instead of from the copy
(its round then takes the last life's steps too). Checked here: what is
written and when (only after its copy, dropped when a newer copy replaces
that one, removed with it), what a next life resumes (the model and the
optimizer bitwise, the steps counted as trained), and every reason it does
not (another copy's, another run's, other shapes, another strategy).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shoal.errors import ConfigError
from shoal.membership import seed as seed_mod
from shoal.membership.seed import StateSeed, copy_digest, keep_progress, resume_progress
from shoal.membership.stateserve import clone_tree
from shoal.strategies.diloco_heal import OuterReplay

sys.path.insert(0, os.path.dirname(__file__))
from test_state_seed import _blob, _inner, _tree  # noqa: E402

RUN_TAG = "run-a/own-state"


def _member(seed: int = 0, steps: int = 3, fragments: int = 1, overlap: int = 0, at: int = 10
            ) -> tuple[torch.nn.Module, torch.optim.Optimizer, OuterReplay]:
    """A small model whose AdamW stepped ``steps`` times, and the DiLoCo replayer of a strategy at step ``at``."""
    net, opt, _ = _inner(seed, steps)
    # Fragment k's rounds after the steps s with s % 8 == its offset (as StreamingDiLoCo spreads them).
    frags = [SimpleNamespace(offset=(k + 1) * 8 // fragments % 8, snapshot=torch.zeros(1), params=[])
             for k in range(fragments)]
    strategy = SimpleNamespace(config=SimpleNamespace(overlap_steps=overlap, inner_steps=8), fragments=frags,
                               step=at, trained_steps=0, _reset_to_global=lambda f: None)
    return net, opt, OuterReplay(strategy, "k", opt)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _written(tmp_path: Any, steps: int = 2) -> tuple[StateSeed, torch.nn.Module, torch.optim.Optimizer]:
    """A first life: its copy (generation 1) written, then its progress ``steps`` inner steps after it."""
    seed = StateSeed(str(tmp_path / "slot-0.state"))
    net, opt, replay = _member(steps=5)
    seed.save(clone_tree(_tree()), gen=1)
    seed.save_progress(1, keep_progress([replay], RUN_TAG, steps))
    assert seed.flush(30) and seed.writes == 1 and seed.progress_writes == 1
    return seed, net, opt


def test_a_next_life_that_loaded_the_same_copy_goes_on_from_the_progress(tmp_path: Any) -> None:
    seed, old_net, old_opt = _written(tmp_path, steps=2)
    assert sorted(os.listdir(tmp_path)) == ["slot-0.state", "slot-0.state" + seed_mod.PROGRESS]
    assert seed.read() == _blob(_tree())   # the copy the download compares is unchanged
    net, opt, replay = _member(seed=1, steps=0, at=10)   # the next life, just loaded the copy at its step 10
    replay.entered = 10
    assert resume_progress(seed, [replay], RUN_TAG, _blob(_tree())) == 2
    assert _same(net, old_net)   # bitwise its last life's model and optimizer
    so, sn = old_opt.state_dict()["state"], opt.state_dict()["state"]
    assert all(torch.equal(so[i][k], sn[i][k]) for i in so for k in so[i])
    assert replay.trained() == 2 and replay.weight() == pytest.approx(2 / 8)   # 2 inner steps of a period of 8


def test_streaming_progress_keeps_each_fragments_span_and_the_round_weighs_its_own(tmp_path: Any) -> None:
    """Streaming DiLoCo, 4 fragments of a period of 8 (rounds after steps 2, 4, 6, 8 mod 8): written at step 13,
    fragment k went on for (13 - offset_k) % 8 steps since its round; the copy came with fragment 1's round
    (after step 12), 1 step before. A next life resumes them all: each fragment's round weighs its own span."""
    seed = StateSeed(str(tmp_path / "slot-0.state"))
    _, old_opt, replay = _member(steps=5, fragments=4, at=13)
    assert replay.spans_now() == [3, 1, 7, 5]
    seed.save(clone_tree(_tree()), gen=1)
    seed.save_progress(1, keep_progress([replay], RUN_TAG, 1))
    assert seed.flush(30) and seed.read_progress()["kept"][0]["spans"] == [3, 1, 7, 5]
    net, opt, replay = _member(seed=1, steps=0, fragments=4, at=12)   # loaded the copy: the step it was taken at
    replay.entered = 12
    assert resume_progress(seed, [replay], RUN_TAG, _blob(_tree())) == 1
    assert replay.extra == [2, 0, 6, 4] and replay.trained() == 1
    replay.strategy.step = 13   # one more inner step: the spans are [4, 2, 8, 6]
    replay.strategy.rounds = SimpleNamespace(current="fragment:0")
    assert replay.weight() == pytest.approx(4 / 8)   # fragment 0's round weighs its own span
    assert not replay.full() and replay.longest() == 8
    replay.strategy.rounds = SimpleNamespace(current="fragment:2")
    # Fragment 2's pseudo-gradient spans a whole period: its round weighs 1, as a member's; yet the joiner is
    # not a full member while fragment 1's spans 2 steps (the weight exchange sends both).
    assert replay.weight() == 1.0 and not replay.full()
    replay.strategy.step = 19
    assert replay.full() and replay.weight() == 1.0


def test_a_progress_written_before_spans_were_kept_resumes_one_fragment(tmp_path: Any) -> None:
    seed = StateSeed(str(tmp_path / "slot-0.state"))
    _, _, replay = _member(steps=5)
    part = keep_progress([replay], RUN_TAG, 2)
    del part["kept"][0]["spans"]   # an earlier version's file
    seed.save(clone_tree(_tree()), gen=1)
    seed.save_progress(1, part)
    assert seed.flush(30)
    _, _, replay = _member(seed=1, steps=0, at=10)
    replay.entered = 10
    assert resume_progress(seed, [replay], RUN_TAG, _blob(_tree())) == 2 and replay.extra == [0]


def test_spans_count_no_further_back_than_the_runs_start() -> None:
    _, _, replay = _member(fragments=4, at=1)   # step 1 of a fresh run: no fragment's first round came yet
    assert replay.spans_now() == [1, 1, 1, 1]


def test_spans_count_from_a_blocking_heal() -> None:
    _, _, replay = _member(fragments=4, at=13)
    assert replay.spans_now() == [3, 1, 7, 5]
    replay.replaced()   # a blocking heal at step 13 reset every fragment to its global copy
    replay.strategy.step = 15
    assert replay.spans_now() == [2, 2, 1, 2]   # (fragment 2's round came after step 14)


def test_progress_is_written_only_after_its_copy_and_never_beside_a_newer_one(tmp_path: Any) -> None:
    seed = StateSeed(str(tmp_path / "slot-0.state"))
    _, _, replay = _member()
    seed.save_progress(1, keep_progress([replay], RUN_TAG, 1))   # its copy was never asked for
    assert seed.flush(30) and seed.progress_writes == 0
    seed.save(clone_tree(_tree()), gen=1)
    seed.save_progress(1, keep_progress([replay], RUN_TAG, 1))
    assert seed.flush(30) and seed.progress_writes == 1
    # A newer copy removes the progress that went on from the older one; a progress of the older one that
    # comes after it is not written beside it.
    seed.save(clone_tree(_tree(change=0)), gen=2)
    seed.save_progress(1, keep_progress([replay], RUN_TAG, 2))
    assert seed.flush(30) and seed.progress_writes == 1 and seed.writes == 2
    assert sorted(os.listdir(tmp_path)) == ["slot-0.state"]
    seed.save_progress(2, keep_progress([replay], RUN_TAG, 1))
    assert seed.flush(30) and seed.progress_writes == 2
    assert seed.read_progress()["copy"] == copy_digest(_blob(_tree(change=0)))


@pytest.mark.parametrize("case", ["other copy", "other run", "other shapes", "other optimizer", "other fragments",
                                  "overlapped", "none", "unreadable"])
def test_a_progress_that_does_not_go_on_from_the_loaded_copy_or_does_not_fit_is_not_resumed(
        case: str, tmp_path: Any) -> None:
    seed, _, _ = _written(tmp_path)
    copy, run = _blob(_tree()), RUN_TAG
    net, opt, replay = _member(seed=1, steps=0)
    if case == "other copy":
        copy = _blob(_tree(change=1))   # its copy was stale: the restart loaded the survivors' state instead
    elif case == "other run":
        run = "run-b/own-state"
    elif case == "other shapes":
        net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        replay = OuterReplay(replay.strategy, "k", opt)
    elif case == "other optimizer":
        opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
        replay = OuterReplay(replay.strategy, "k", opt)
    elif case == "other fragments":   # one fragment's spans, for a streaming DiLoCo of two
        _, opt, replay = _member(seed=1, steps=0, fragments=2)
    elif case == "overlapped":
        _, opt, replay = _member(seed=1, steps=0, overlap=1)
    elif case == "none":
        os.unlink(seed.path + seed_mod.PROGRESS)
    elif case == "unreadable":
        with open(seed.path + seed_mod.PROGRESS, "wb") as f:
            f.write(b"not a tree")
    before = clone_tree(net.state_dict())
    replay.entered = 10
    assert resume_progress(seed, [replay], run, copy) == 0
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())   # nothing changed
    assert opt.state_dict()["state"] == {} and replay.trained() == 0


def test_keep_progress_keeps_nothing_where_a_restart_could_not_go_on_exactly() -> None:
    assert keep_progress([_member(overlap=1)[2]], RUN_TAG, 1) is None     # overlapped reductions
    assert keep_progress([object()], RUN_TAG, 1) is None                  # a replayer that keeps no progress


def test_the_progress_interval_comes_from_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(seed_mod.EVERY_ENV, raising=False)
    assert StateSeed(str(tmp_path / "a")).every == seed_mod.EVERY
    monkeypatch.setenv(seed_mod.EVERY_ENV, "0")
    assert StateSeed(str(tmp_path / "a")).every == 0
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(seed_mod.EVERY_ENV, bad)
        with pytest.raises(ConfigError, match=seed_mod.EVERY_ENV):
            StateSeed(str(tmp_path / "a"))
