"""DASO admits a newcomer only where the state it heals is the state its peers train on from.

A committed round of :class:`~shoal.strategies.rounds.Rounds` admits a waiting
quorum at once, in an empty round whose heal copies the peers' registered
state as it is at that moment; the newcomer then trains the next step. So
nothing of the step may change that state after such an admission: DASO used
to land a global round's mean after the round returned, and a worker
admitted in between healed the agreed parameters of before the landing with
the landing still pending, which it then never applied (its parameters
differed from its peers' for good: seen as a flaky elastic SIGKILL test).

Here 4 gloo ranks pose as 2 hosts x 2 on a static group that says a quorum
is waiting during every ``after_step`` (and whose steps end at their
votes, as an elastic group's) and records, at the admitting round's
``begin_step`` (where an elastic group heals), every registered state; each
record must equal the state when ``optimizer.step()`` returns.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import shoal
from shoal.comm.start import Traits
from shoal.comm.objects import from_bytes, to_bytes
from shoal.strategies import DASO
from shoal.strategies.rounds import ADOPT
from shoal.testing import run_workers

SPE, EPOCHS = 2, 5


class _Waiting(shoal.Group):
    """A static group on which a newcomer waits while ``armed``; the admitting round records the heal.

    As on an elastic group, no reduction stays in flight past a round's vote (DASO's leaders' mean
    is in ``delta`` when the round commits, where a heal would copy it).
    """

    traits = Traits(members_change=False, work_in_flight=False)
    armed = False
    rounds: Any = None
    healed: list[dict[str, Any]]

    @property
    def quorum_pending(self) -> bool:
        return self.armed

    def begin_step(self) -> None:
        super().begin_step()
        if self.armed and self.rounds is not None and self.rounds.current == ADOPT:
            self.armed = False     # admitted: what a healer would send now
            self.healed.append(_states(self))


def _states(group: shoal.Group) -> dict[str, Any]:
    return from_bytes(to_bytes({k: e.get() for k, e in group.hooks.states.items()}))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _work(rank: int, world: int) -> dict[str, Any]:
    os.environ["SHOAL_HOST_ID"] = f"host-{rank // 2}"
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    daso = DASO(total_epochs=EPOCHS, steps_per_epoch=SPE, warmup_epochs=1, cooldown_epochs=1, max_global_skips=8)
    group = _Waiting()
    group.healed = []
    after_step = daso.after_step

    def armed_after_step() -> None:     # a newcomer waits while the step's rounds run
        group.armed = True
        try:
            after_step()
        finally:
            group.armed = False

    daso.after_step = armed_after_step   # type: ignore[method-assign]
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), daso,
                            process_group=group)
    group.rounds = daso.rounds
    wrong: list[tuple[int, str]] = []
    admitted = 0
    for step in range(EPOCHS * SPE):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 5, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        daso.report_loss(1.0)   # a plateau: skips grow, so launches and landings come apart
        now = _states(group)
        for heal in group.healed:
            wrong += [(step, k) for k in now if not _same(heal[k], now[k])]
        admitted += len(group.healed)
        group.healed.clear()
    daso.close()
    return {"wrong": wrong, "admitted": admitted, "events": list(daso.schedule.events)}


@pytest.mark.timeout(120)
def test_a_newcomer_admitted_after_a_daso_round_heals_the_steps_final_state() -> None:
    res = run_workers(_work, 4, timeout=110)
    lands = {t for t, kind, _ in res[0]["events"] if kind == "land"}
    launches = {t for t, kind, _ in res[0]["events"] if kind == "launch"}
    assert lands - launches, "no delayed landing: the schedule is too weak for this test"
    for r in res:
        assert r["admitted"] >= 6, r      # a newcomer admitted in most steps (every launch)
        assert r["wrong"] == [], r["wrong"]
