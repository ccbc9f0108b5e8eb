"""DiLoCo's background heal in one process: the replay of outer rounds is exact, and what heals blocking says why.

The group is a single-process static :class:`Group` that keeps what the
strategy registers for the background heal (replays, refusals). The
reference is the strategy itself: a second DiLoCo, started from a snapshot
of the first one's global copies and outer state, replays the means the
first one committed and must then hold its global copies, outer state and
parameters bit for bit.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.comm import Group
from shoal.strategies.diloco_heal import OuterReplay
from shoal.strategies.diloco_state import outer_state
from shoal.testing import free_port


class _Keeping(Group):
    """A static group that keeps the replays and refusals registered on it."""

    replays: list[Any]
    kept: list[tuple[str, Callable[[], bool] | None]]

    def register_replay(self, replayer: Any) -> None:
        self.replays.append(replayer)

    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None:
        self.kept.append((why, when))

    @property
    def refusals(self) -> list[str]:
        """The reasons that hold now (what an elastic group's heal plan asks)."""
        return [why for why, when in self.kept if when is None or when()]


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        created = True
    yield
    if created:
        dist.destroy_process_group()


def _group() -> Any:
    g = _Keeping()
    g.replays, g.kept = [], []
    return g


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _outer(strategy: Any) -> list[torch.Tensor]:
    out = []
    for f in strategy.fragments:
        out.append(f.snapshot)
        for st in f.outer.state_dict()["state"].values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _make(fragments: int, overlap: int) -> Any:
    if fragments == 1 and overlap == 0:
        return shoal.DiLoCo(inner_steps=4)
    if fragments == 1:   # DiLoCo with its exchange behind the next inner step, the overlapped progress kept
        return shoal.StreamingDiLoCo(inner_steps=4, fragments=1, overlap_steps=overlap, merge="carry")
    return shoal.StreamingDiLoCo(inner_steps=4, fragments=fragments, overlap_steps=overlap, mixing=0.0)


@pytest.mark.parametrize("fragments, overlap, rounds", [(1, 0, 3), (2, 0, 6), (2, 1, 5), (1, 1, 2)])
def test_replaying_the_committed_means_gives_the_global_copies_and_outer_state_bit_for_bit(
        world: None, fragments: int, overlap: int, rounds: int) -> None:
    g = _group()
    strategy = _make(fragments, overlap)
    net = _net(0)
    model, opt = shoal.wrap(net, torch.optim.Adam(net.parameters(), lr=1e-2), strategy, process_group=g)
    assert g.refusals == [] and len(g.replays) == 1 and isinstance(g.replays[0], OuterReplay)
    replay = g.replays[0]
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):   # a round in progress: the snapshot is taken mid-period, as at an admission
        x = torch.randn(16, 8, generator=gen)
        F.mse_loss(model(x), x[:, :2]).backward()
        opt.step()
        opt.zero_grad()
    snap = outer_state(strategy)            # what a source serves (<key>/strategy)
    records: list[Any] = []
    g.on_commit(lambda: records.append(replay.record()))
    for _ in range(11):
        x = torch.randn(16, 8, generator=gen)
        F.mse_loss(model(x), x[:, :2]).backward()
        opt.step()
        opt.zero_grad()
    assert sum(r is not None for r in records) == rounds   # the outer rounds of steps 6..16

    g2 = _group()
    joiner = _make(fragments, overlap)
    net2 = _net(1)                          # a different model: everything must come from the heal
    inner2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    shoal.wrap(net2, inner2, joiner, process_group=g2)
    x = torch.randn(16, 8, generator=gen)   # the joiner trained its own model while downloading
    F.mse_loss(net2(x), x[:, :2]).backward()
    inner2.step()
    assert len(inner2.state) > 0
    joiner._heal_outer(snap)
    for r in records:
        g2.replays[0].replay(r)
    g2.replays[0].caught_up()
    assert len(inner2.state) == 0           # its inner optimizer starts afresh
    for a, b in zip(_outer(strategy), _outer(joiner)):
        assert torch.equal(a, b)
    for f, f2 in zip(strategy.fragments, joiner.fragments):   # its parameters: the global copies
        for p, v in zip(f2.params, f.global_views):
            assert torch.equal(p.detach(), v.view_as(p))
        if f2.launched is not None:   # merge="carry": a pending merge carries only what it trains from here on
            assert torch.equal(f2.launched, f.snapshot)


def test_a_reduction_landing_later_refuses_while_it_is_in_flight_only(world: None) -> None:
    # overlap_steps=1: fragment 0 launches after step 2 and merges in step 3's round; a joiner admitted in
    # between would never receive that mean. A retry that reduces in the foreground is fine.
    g = _group()
    net = _net(0)
    strategy = shoal.StreamingDiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy, process_group=g)
    seen = []
    for _ in range(4):   # fragment 0 launches after step 2 (merged in step 3's round), fragment 1 after step 4
        F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 2)).backward()
        opt.step()
        opt.zero_grad()
        seen.append(bool(g.refusals))
    assert seen == [False, True, False, True] and all("lands after it" in r for r in g.refusals)
    strategy.fragments[1].redo = True   # what a failed landing leaves: the retry reduces in the foreground
    assert g.refusals == []


@pytest.mark.parametrize("make, why", [
    (lambda: shoal.DiLoCo(inner_steps=4, codec=shoal.codecs.PowerSGD(rank=1)), "PowerSGD"),
    (lambda: shoal.DiLoCo(inner_steps=4, codec=shoal.codecs.ErrorFeedback(shoal.codecs.TopK(0.1))), "ErrorFeedback"),
])
def test_what_cannot_replay_exactly_refuses_and_says_why(world: None, make: Callable[[], Any], why: str) -> None:
    g = _group()
    net = _net(0)
    shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), make(), process_group=g)
    assert any(why in r for r in g.refusals), g.refusals


@pytest.mark.parametrize("codec", [None, shoal.codecs.Cast(), shoal.codecs.Int8Blockwise()])
def test_codecs_every_member_decodes_alike_do_not_refuse(world: None, codec: Any) -> None:
    g = _group()
    net = _net(0)
    shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shoal.DiLoCo(inner_steps=4, codec=codec),
               process_group=g)
    assert g.refusals == [] and len(g.replays) == 1


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 5) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        F.mse_loss(model(x), x[:, :2]).backward()
        opt.step()
        opt.zero_grad()


def _overlapped(seed: int, **kwargs: Any) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """One fragment, H 4, overlap 1 (``merge``/``mixing`` from ``kwargs``), wrapped on ``_net(seed)``."""
    net = _net(seed)
    strategy = shoal.StreamingDiLoCo(inner_steps=4, fragments=1, overlap_steps=1, **kwargs)
    model, opt = shoal.wrap(net, torch.optim.Adam(net.parameters(), lr=1e-2), strategy, process_group=_group())
    return strategy, model, opt


def test_carry_merges_to_the_global_copy_bit_for_bit_when_nothing_was_trained_since_the_launch(world: None) -> None:
    # Launched after step 4, merged by close() with no step in between: every rank must then hold exactly the
    # new global copy (the same on every rank), not global + (local - local) rounded.
    strategy, model, opt = _overlapped(0, merge="carry")
    _train(model, opt, 4)
    assert strategy.fragments[0].merge_at == 5
    strategy.close()
    f = strategy.fragments[0]
    for p, g in zip(f.params, f.global_views):
        assert torch.equal(p.detach(), g.view_as(p))


def test_a_mix_checkpoint_with_a_pending_merge_is_refused_by_carry_before_anything_loads(world: None) -> None:
    mix, model, opt = _overlapped(0, mixing=0.0)
    _train(model, opt, 4)                  # launched after step 4: pending at the checkpoint
    state = mix.state_dict()
    mix.close()
    carry = _overlapped(1, merge="carry")[0]
    before = carry.fragments[0].snapshot.clone()
    with pytest.raises(shoal.errors.ConfigError, match="saved without merge='carry'"):
        carry.load_state_dict(state)
    assert carry.step == 0 and carry.fragments[0].merge_at is None   # nothing loaded
    assert torch.equal(carry.fragments[0].snapshot, before)
    carry.close()


def test_merged_rounds_counts_merges_only_and_travels_with_a_checkpoint(world: None) -> None:
    """The bench's credit rule (Trainer.synced) reads it: a launch is not a merge; a resumed run has merged."""
    strategy, model, opt = _overlapped(0, merge="carry")
    _train(model, opt, 4)
    assert strategy.merged_rounds == 0 and strategy.fragments[0].merge_at == 5    # launched, not merged
    _train(model, opt, 1)
    assert strategy.merged_rounds == 1
    state = strategy.state_dict()
    strategy.close()
    again = _overlapped(1, merge="carry")[0]
    again.load_state_dict(state)
    assert again.merged_rounds == 1
    again.load_state_dict({k: v for k, v in state.items() if k != "merged_rounds"})   # an older checkpoint
    assert again.merged_rounds == 0
    again.close()


def test_a_later_load_keeps_the_progress_of_the_fragments_no_round_changed(world: None) -> None:
    """Streaming DiLoCo, 2 fragments, H 4 (fragment 0's rounds after steps 2, 6, ...; fragment 1's after 4, 8, ...).
    A restart loads its host's copy (taken after step 3) and trains from it; the survivors commit fragment 1's
    round after step 4. Its next load (the snapshot and that round, replayed) keeps fragment 0's parameters
    (its global copy is still the copy's: the steps trained on it are progress from there) and takes fragment
    1's new global copy; its inner optimizer goes on; fragment 0's round then weighs the steps kept."""
    g = _group()
    strategy = _make(2, 0)
    net = _net(0)
    model, opt = shoal.wrap(net, torch.optim.Adam(net.parameters(), lr=1e-2), strategy, process_group=g)
    replay = g.replays[0]
    _train(model, opt, 3)
    copy = outer_state(strategy)             # the host's copy, written after fragment 0's round
    records: list[Any] = []
    g.on_commit(lambda: records.append(replay.record()))
    _train(model, opt, 2, seed=6)             # fragment 1's round after step 4
    assert [r[0] for r in records if r is not None] == [1]

    g2 = _group()
    joiner = _make(2, 0)
    net2 = _net(1)
    inner2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    model2, opt2 = shoal.wrap(net2, inner2, joiner, process_group=g2)
    jr = g2.replays[0]
    joiner._heal_outer(copy)                  # its early load, from the host's copy
    assert jr.caught_up() is False and jr.base is not None
    # ... and its last life's progress since that copy (1 step; fragment 0 had gone on for 2, fragment 1 for 3)
    kept = {"type": "Adam", "params": [p.detach().clone() for p in net2.parameters()], "state": {}, "spans": [2, 3]}
    assert jr.progress_fits(kept) is None and jr.restore_progress(kept, 1) is None
    assert jr.extra == [1, 2] and jr.base_ahead == [2, 3]
    _train(model2, opt2, 1, seed=7)          # it trains from that copy (no round of its own: step 1)
    trained = [[p.detach().clone() for p in f.params] for f in joiner.fragments]
    jr.before_load()
    joiner._heal_outer(copy)                  # the final load: the snapshot at its admission ...
    for r in records:
        jr.replay(r)                          # ... and the round committed since
    assert jr.caught_up() is True and jr.kept_fragments == 1
    for a, b in zip(_outer(strategy), _outer(joiner)):   # the global copies and outer state: the survivor's
        assert torch.equal(a, b)
    f0, f1 = joiner.fragments
    assert all(torch.equal(p.detach(), t) for p, t in zip(f0.params, trained[0]))   # kept
    assert all(torch.equal(p.detach(), v.view_as(p)) for p, v in zip(f1.params, f1.global_views))   # reset
    assert not all(torch.equal(p.detach(), t) for p, t in zip(f1.params, trained[1]))
    assert len(inner2.state) > 0              # the optimizer its kept steps trained with goes on
    assert jr.extra == [3, 0] and jr.entered == joiner.step   # fragment 0: its last life's 2 and its own 1
    joiner.rounds.current = "fragment:0"
    assert jr.weight() == pytest.approx(3 / 4) and not jr.full() and jr.longest() == 3
    assert jr.base is None                    # that load was for good (before_load's default): no copy kept ...
    jr.before_load()                          # ... so a later load compares with nothing
    joiner._heal_outer(copy)
    assert jr.caught_up() is False and len(inner2.state) == 0
