"""A joiner that entered between two rounds weighs the share of a period it trained (issue #20).

Rounds.mean divides the sum of the contributions by ``contributors - shortfall``; the reference is that
division done here by hand over the same inputs. OuterReplay gives a joiner's weight from the inner steps
it trained since it loaded. The agreement itself (every member reading the same weights) runs in
tests/faults/test_heal_background_diloco.py on real processes.
"""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_resume_round import FakeElastic, World  # noqa: E402

from shoal.codecs import Identity  # noqa: E402
from shoal.comm.group import Group  # noqa: E402
from shoal.strategies.diloco_heal import OuterReplay  # noqa: E402
from shoal.strategies.resume import ResumableMean  # noqa: E402
from shoal.strategies.rounds import Rounds  # noqa: E402


class Weighted(FakeElastic):
    def __init__(self, world: World, rank: int, newcomers: tuple[int, ...], short: float) -> None:
        super().__init__(world, rank, failing=set())
        self.newcomers, self.short = newcomers, short

    def shortfall(self) -> float:
        return self.short


def _means(n: int, newcomers: tuple[int, ...], short: float, resumable: bool) -> list[list[torch.Tensor]]:
    Group.register(Weighted)
    g = torch.Generator().manual_seed(3)
    inputs = [[torch.randn(40, 9, generator=g), torch.randn(17, generator=g)] for _ in range(n)]
    outs = [[t.clone() for t in ts] for ts in inputs]
    world, errors = World(n), []

    def member(r: int) -> None:
        try:
            rounds = Rounds(Weighted(world, r, newcomers, short), "t")
            rounds.resume = ResumableMean(min_bytes=256, max_chunks=4)
            rounds.mean(outs[r], ["a", "b"], Identity(), "t", resumable=resumable)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    counted = [r for r in range(n) if r not in newcomers]
    want = [sum(inputs[r][i] for r in counted) / (len(counted) - short) for i in range(2)]
    for r in range(n):
        for got, w in zip(outs[r], want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    return outs


@pytest.mark.parametrize("resumable", [False, True])
@pytest.mark.parametrize("newcomers, short", [((), 0.75), ((), 0.0), ((1,), 0.5)])
def test_the_mean_divides_by_the_contributors_less_the_shortfall(newcomers: tuple[int, ...], short: float,
                                                                 resumable: bool) -> None:
    # 3 members; a joiner with a quarter of a period (shortfall 0.75), none, or a newcomer beside a joiner
    # with half a period: every member gets sum / (counted - shortfall), by either path.
    _means(3, newcomers, short, resumable)


def _replay(step: int, inner: int) -> tuple[OuterReplay, Any]:
    strategy = SimpleNamespace(step=step, config=SimpleNamespace(inner_steps=inner, overlap_steps=0), trained_steps=0,
                               fragments=[SimpleNamespace(offset=0, snapshot=torch.zeros(1), params=[])],
                               _reset_to_global=lambda f: None)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    return OuterReplay(strategy, "k", opt), strategy


def test_a_joiners_weight_is_its_inner_steps_since_it_loaded_over_the_period() -> None:
    replay, strategy = _replay(step=10, inner=8)
    assert replay.weight() == 1.0            # never loaded between rounds: a full member
    replay.caught_up()                       # loaded at the end of inner step 10
    assert replay.weight() == 0.0            # a round at this step: nothing trained from the global copies yet
    strategy.step = 16
    assert replay.weight() == 6 / 8          # the round at the period's end: 6 of 8 inner steps
    strategy.step = 40
    assert replay.weight() == 1.0            # later rounds span a whole period


def test_only_a_strategy_without_overlapped_reductions_enters_between_rounds() -> None:
    plain, _ = _replay(step=0, inner=8)
    assert plain.enters_between_rounds
    strategy = SimpleNamespace(step=0, config=SimpleNamespace(inner_steps=8, overlap_steps=1), trained_steps=0,
                               fragments=[SimpleNamespace(offset=0, snapshot=torch.zeros(1), params=[])])
    overlapped = OuterReplay(strategy, "k", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert not overlapped.enters_between_rounds   # a launch between rounds reads who contributes
