"""The "Writing a strategy" template of :mod:`shoal.strategies.base`, run as written on a static and an elastic group.

The template is taken from the module docstring itself, so the documented
code is the tested code. Reference: a single process that trains every rank's
copy with its own batches and averages the parameters after each step.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
import shoal.strategies.base as base
from shoal.comm import Group
from shoal.testing import run_workers

STEPS = 4


def template() -> type:
    """The ``EveryStep`` class of the docstring's "Writing a strategy" block, executed."""
    doc = inspect.getdoc(base) or ""
    head = doc.index("Writing a strategy")
    block = doc[doc.index("::", head) + 2:]
    code = textwrap.dedent("\n".join(line for line in block.splitlines() if not line or line.startswith("    ")))
    ns: dict[str, Any] = {}
    exec(compile(code, "<shoal.strategies.base template>", "exec"), ns)   # noqa: S102 - our own docstring
    return ns["EveryStep"]


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(4, 6, generator=gen)
    return x, x[:, :2].sin()


def _train(group: Group, rank: int) -> list[torch.Tensor]:
    net = _net(seed=rank)           # different starts: setup must give every rank rank 0's
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), template()(), process_group=group)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _reference(world: int) -> list[torch.Tensor]:
    nets = [_net(seed=0) for _ in range(world)]
    for step in range(STEPS):
        for rank, net in enumerate(nets):
            x, y = _batch(rank, step)
            F.mse_loss(net(x), y).backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        with torch.no_grad():
            for ps in zip(*(n.parameters() for n in nets)):
                mean = torch.stack([p for p in ps]).mean(0)
                for p in ps:
                    p.copy_(mean)
    return [p.detach() for p in nets[0].parameters()]


def _static(rank: int, world: int) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    return _train(Group(), rank)


@pytest.mark.timeout(120)
def test_template_on_a_static_group_averages_like_the_reference() -> None:
    out = run_workers(_static, 2, timeout=100)
    ref = _reference(2)
    for got in out:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_template_on_an_elastic_group_runs_and_commits_every_round() -> None:
    from shoal.elastic import Coordinator, ElasticGroup, Timeouts

    timeouts = Timeouts(op=5.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0, quorum=15.0, join=20.0)
    coord = Coordinator(port=0, initial_workers=1, token="template-token").start()
    group = ElasticGroup("template", coordinator=coord.address, timeouts=timeouts, min_workers=1,
                         token="template-token")
    try:
        got = _train(group, rank=0)   # before the fix: "collective on an elastic group before its first step"
        assert group.stats.commits == STEPS + 1, vars(group.stats)   # the join's round, then one per step
        assert group.stats.discards == 0, vars(group.stats)
    finally:
        group.leave()
        coord.stop()
    for a, b in zip(got, _reference(1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
