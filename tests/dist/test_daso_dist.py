"""DASO on 4 gloo ranks posing as 2 hosts x 2: who agrees with whom, when, and the bytes between hosts."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shoal

from shoal.strategies import DASO
from shoal.strategies.daso import expected_global_bytes
from shoal.testing import run_workers

SPE = 2  # short epochs: the schedule's whole cycle in 10 steps


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _work(rank: int, world: int) -> dict:
    os.environ["SHOAL_HOST_ID"] = f"host-{rank // 2}"
    torch.manual_seed(rank)  # different inits: wrap must broadcast rank 0's
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    daso = DASO(total_epochs=5, steps_per_epoch=SPE, warmup_epochs=1, cooldown_epochs=1, max_global_skips=8)
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), daso)
    snaps, before_sync = [], []  # parameters after each step, and after the local step but before DASO's
    opt.optimizer.register_step_post_hook(lambda *_: before_sync.append(_flat(net)))
    for step in range(5 * SPE):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 5, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        daso.report_loss(1.0)  # a scripted plateau: skips grow 1 -> 2 -> 4
        snaps.append(_flat(net))
    daso.close()
    meter = daso.group.meter.by_tag()
    numel = sum(p.numel() for p in net.parameters())
    return {"snaps": snaps, "before": before_sync, "events": list(daso.schedule.events), "model": type(model).__name__, "numel": numel,
            "global": meter["daso/global/bf16"].bytes_sent if "daso/global/bf16" in meter else 0}


@pytest.mark.timeout(120)
def test_daso_hosts_agree_every_step_and_hosts_at_global_syncs() -> None:
    res = run_workers(_work, 4, timeout=110)
    events = res[0]["events"]
    assert all(r["events"] == events for r in res)  # one schedule everywhere
    assert res[0]["model"] == "DistributedDataParallel"  # exact averaging inside the host
    launches = [t for t, kind, _ in events if kind == "launch"]
    lands = [t for t, kind, _ in events if kind == "land"]
    # warm-up (0-1) and cool-down (8-9) every step; epoch 1 skips 1, epoch 2 skips 2, epoch 3 skips 4 (lands a step later)
    assert launches == [0, 1, 2, 3, 4, 6, 8, 9]
    assert lands == [0, 1, 2, 3, 4, 7, 8, 9]
    for step in range(5 * SPE):
        s = [r["snaps"][step] for r in res]
        assert torch.equal(s[0], s[1]) and torch.equal(s[2], s[3]), f"ranks of one host differ at step {step}"
        hosts_agree = torch.equal(s[0], s[2])
        # Hosts hold the same parameters right after a blocking sync; a delayed one (step 7) lands
        # the agreement of step 6 plus each host's own progress since, so they still differ.
        blocking = step in lands and step in launches
        assert hosts_agree == blocking, f"step {step}: hosts agree={hosts_agree}, blocking sync={blocking}"
    # The delayed landing at step 7: agreed (step 4's sync + the hosts' mean move from there to step 6,
    # in bf16) plus this host's own progress from step 6 to step 7.
    mean_move = sum(r["before"][6] - r["snaps"][4] for r in res) / 4
    for r in res:
        expect = r["snaps"][4] + mean_move + (r["before"][7] - r["before"][6])
        torch.testing.assert_close(r["snaps"][7], expect, rtol=0, atol=1e-2 * float(mean_move.abs().max()) + 1e-6)
    numel = res[0]["numel"]
    per_sync = expected_global_bytes(numel, 2, torch.bfloat16)
    assert [r["global"] for r in res] == [len(launches) * per_sync, 0, len(launches) * per_sync, 0]


def _lone(rank: int, world: int) -> str:
    os.environ["SHOAL_HOST_ID"] = f"host-{rank // 3}"   # ranks 0-2 on one host, rank 3 alone on another
    net = nn.Linear(3, 1)
    try:
        shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), DASO(total_epochs=2, steps_per_epoch=2))
    except shoal.errors.ConfigError as e:
        return str(e)
    return "accepted"


@pytest.mark.timeout(120)
def test_daso_refuses_a_host_of_one_worker_among_several_hosts() -> None:
    """Between global syncs such a host takes single-worker steps (the lm bench's loss jump on 4 hosts x 1)."""
    for msg in run_workers(_lone, 4, timeout=110):   # every rank refuses alike: no rank is left waiting
        assert "at least 2 workers on every host" in msg and "rank(s) [3]" in msg
