"""The "Writing a strategy" template of :mod:`shoal.strategies.base`, run as written on a static and an elastic group.

The template is taken from the module docstring itself, so the documented
code is the tested code. Reference: a single process that trains every rank's
copy with its own batches and averages the parameters after each step. On an
elastic group two workers train as the static group does (bitwise the same
parameters), then a third joins: it is healed right after a round and counts
in every later average; all three end equal, and equal to the reference with
the join.
"""

from __future__ import annotations

import inspect
import os
import textwrap
import uuid
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
        _sgd_then_average(nets, [_batch(rank, step) for rank in range(world)])
    return [p.detach() for p in nets[0].parameters()]


def _sgd_then_average(nets: list[nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One reference step: each net an SGD step (lr 0.1) on its batch, then every parameter averaged."""
    for net, (x, y) in zip(nets, batches):
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


EXTRA = 3          # steps after a third worker joined the elastic run
TOKEN = "template-token"


def _elastic(rank: int, world: int, address: str, run_id: str, out_dir: str) -> dict[str, Any]:
    """Workers 0 and 1 train STEPS steps (the static run's), then wait for worker 2 to be in a published
    quorum; it is admitted right after their next round (an empty round, at once) and all three train
    EXTRA steps. Data: ``_batch(worker, its own step)``."""
    import time

    from shoal.elastic import ElasticGroup, Timeouts

    torch.set_num_threads(1)
    joiner, ready = rank == 2, os.path.join(out_dir, "ready")
    deadline = time.monotonic() + 60
    while joiner and not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.02)
    timeouts = Timeouts(op=10.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=5.0, quorum=30.0, join=40.0)
    group = ElasticGroup(run_id, coordinator=address, timeouts=timeouts, min_workers=2, token=TOKEN)
    # The joiner starts elsewhere: the join's heal must give it the group's state. (The first two start alike:
    # which of them the first quorum's heal copies depends on which registered first; the static test above
    # checks that different starts are equalised.)
    net = _net(seed=7 if joiner else 0)
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), template()(), process_group=group)
    healed = [p.detach().clone() for p in net.parameters()]
    before: list[torch.Tensor] = []
    for step in range(EXTRA if joiner else STEPS + 1 + EXTRA):
        if step == STEPS and not joiner:
            before = [p.detach().clone() for p in net.parameters()]   # the static run's end
            quorum = group.quorum
            open(ready, "w").close()
            while quorum is not None and group.client.latest() <= quorum.qid and time.monotonic() < deadline:
                time.sleep(0.02)    # until the coordinator has published a quorum with the joiner
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {"params": [p.detach().clone() for p in net.parameters()], "before": before, "healed": healed,
           "size": group.size, "commits": group.stats.commits, "discards": group.stats.discards,
           "heals": group.stats.heals_received}
    group.leave()
    return out


def _reference_with_join() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Single process: two workers for STEPS + 1 steps, then a third holding their average, EXTRA more steps;
    (the parameters after the joiner's heal, the final ones)."""
    nets = [_net(seed=0) for _ in range(2)]
    healed: list[torch.Tensor] = []
    for step in range(STEPS + 1 + EXTRA):
        if step == STEPS + 1:
            nets.append(_net(seed=0))
            with torch.no_grad():
                for p, q in zip(nets[2].parameters(), nets[0].parameters()):
                    p.copy_(q)
            healed = [p.detach().clone() for p in nets[2].parameters()]
        _sgd_then_average(nets, [_batch(worker, step if worker < 2 else step - STEPS - 1)
                                 for worker in range(len(nets))])
    return healed, [p.detach() for p in nets[0].parameters()]


@pytest.mark.timeout(150)
def test_template_on_an_elastic_group_that_a_worker_joins_equals_the_static_run(tmp_path: Any) -> None:
    from shoal.elastic import Coordinator

    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    try:
        out = run_workers(_elastic, 3, coord.address, uuid.uuid4().hex[:8], str(tmp_path), timeout=130,
                          init_group=False)
        static = run_workers(_static, 2, timeout=60)
    finally:
        coord.stop()
    first, second, joiner = out
    # Before the join: two elastic workers end where the static group's run ends, bitwise.
    for w in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(w["before"], static[0])), "elastic and static runs differ"
        assert w["discards"] == 0 and w["commits"] == 1 + STEPS + 1 + 1 + EXTRA, w   # join, steps, admission
    # The joiner healed into the group's state right after a round and then counted in every average.
    healed, final = _reference_with_join()
    assert joiner["heals"] == 1 and joiner["size"] == 3 and joiner["discards"] == 0, joiner
    for a, b in zip(joiner["healed"], healed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Every worker ends with the same parameters, those of the reference with the join.
    for w in out:
        assert all(torch.equal(a, b) for a, b in zip(w["params"], first["params"])), "workers disagree"
    for a, b in zip(first["params"], final):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
