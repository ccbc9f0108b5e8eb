"""ZeRO overlapped with DDP on an elastic group of one member: the step's bookkeeping in one process.

A quorum of one runs every code path of the overlapped elastic step (re-shard
at bucket 0, per-bucket snapshot and step, the vote) without a peer: the
multi-process behaviour (broadcasts, SIGKILL) is in
tests/faults/test_grad_strategy_faults.py. The oracle is plain torch Adam.
"""

from __future__ import annotations

import copy
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import Coordinator, ElasticGroup, Timeouts
from shoal.errors import PeerLostError

_T = Timeouts(op=2.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0, quorum=15.0, join=20.0)
CAP_MB = 0.0003   # three buckets for the net below


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


@pytest.fixture
def group() -> Iterator[ElasticGroup]:
    coord = Coordinator(port=0, initial_workers=1, token="zero-overlap-token").start()
    g = ElasticGroup("zero-overlap", coordinator=coord.address, timeouts=_T, min_workers=1, token="zero-overlap-token")
    try:
        yield g
    finally:
        g.leave()
        coord.stop()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=gen)
    return x, torch.tanh(x[:, :4])


@pytest.mark.timeout(60)
def test_discarded_step_undoes_the_buckets_stepped_in_backward(group: ElasticGroup) -> None:
    net = _net()
    ref = copy.deepcopy(net)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, process_group=group, lr=1e-2)
    model = shoal.DistributedDataParallel(net, process_group=group, optimizer=zero, bucket_cap_mb=CAP_MB)
    assert len(model.reducer.buckets) == 3
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(6):
        x, y = _batch(step)
        before = [p.detach().clone() for p in net.parameters()]
        F.mse_loss(model(x), y).backward()
        if step == 3:   # a failure reported after backward stepped every bucket: the vote drops them all
            assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
            group.report_error(PeerLostError("injected"))
            assert zero.step() is None and zero.last_step_committed is False
            assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
            assert all(p.grad is None for p in net.parameters())
            continue
        assert zero.step() is None and zero.last_step_committed is True
        zero.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    el = zero._shards
    assert el is not None and el.stats.commits == 5 and el.stats.discards == 1 and el.stats.reshards == 2
    held = el.held_state()
    for i, p in enumerate(ref.parameters()):   # the state too: the discarded step left no trace in it
        assert torch.equal(held[i]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        assert held[i]["step"] == opt.state[p]["step"]


@pytest.mark.timeout(60)
def test_a_loop_without_zero_step_is_voted_at_the_next_step_start(group: ElasticGroup) -> None:
    net = _net()
    ref = copy.deepcopy(net)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1,
                                         momentum=0.9)
    model = shoal.DistributedDataParallel(net, process_group=group, optimizer=zero, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    el = zero._shards
    assert el is not None and zero._overlap is not None
    for step in range(4):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()     # the forward voted the previous step
        assert zero._overlap.pending and group.step == step
        F.mse_loss(ref(x), y).backward()
        opt.step()
        zero.zero_grad()
        opt.zero_grad()
    zero.wait_for_params()                     # votes the last one
    assert not zero._overlap.pending and group.step == 4 and el.stats.commits == 4
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("voter", ["wait_for_params", "eval_forward"])
def test_zero_step_after_another_caller_voted_returns_that_verdict_and_steps_nothing(
        group: ElasticGroup, voter: str) -> None:
    # Something votes the overlapped step between backward and zero.step() (wait_for_params, a
    # validation forward): zero.step() must return that verdict, not step again with the same grads.
    net = _net()
    ref = copy.deepcopy(net)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
    model = shoal.DistributedDataParallel(net, process_group=group, optimizer=zero, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        if voter == "wait_for_params":
            zero.wait_for_params()
        else:
            with torch.no_grad():
                model(x)
        assert zero.step() is None and zero.last_step_committed is True
        zero.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    el = zero._shards
    assert el is not None and el.stats.commits == 3 and group.step == 3
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain"])
def test_nonfinite_gradients_skip_the_step_as_a_commit_not_a_discard(group: ElasticGroup, overlap: bool) -> None:
    net = _net()
    ref = copy.deepcopy(net)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, process_group=group, lr=1e-2)
    model = shoal.DistributedDataParallel(net, process_group=group, optimizer=zero if overlap else None,
                                          bucket_cap_mb=CAP_MB)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(6):
        x, y = _batch(step)
        if step == 3:   # NaN in the first layer: the last bucket, reduced after the others were stepped
            before = [p.detach().clone() for p in net.parameters()]
            handle = net[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([2]), float("nan")))
            with pytest.warns(RuntimeWarning, match="NaN/Inf"):   # at backward, or at the step that reads it
                F.mse_loss(model(x), y).backward()
                handle.remove()
                assert zero.step() is None and zero.last_step_committed is True   # not a failure: the same verdict on every member, nothing to vote
            zero.zero_grad()
            assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
            continue
        F.mse_loss(model(x), y).backward()
        assert zero.step() is None and zero.last_step_committed is True
        zero.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    zero.wait_for_params()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    el = zero._shards
    assert el is not None and el.stats.commits == 6 and el.stats.discards == 0
    assert model.comm_stats().total.nonfinite_skips == 1
    held = el.held_state()
    for i, p in enumerate(ref.parameters()):   # Adam's moments and step count: the skipped step left no trace
        assert torch.equal(held[i]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        assert held[i]["step"] == opt.state[p]["step"]


@pytest.mark.timeout(60)
def test_a_deferred_nonfinite_verdict_of_a_step_that_failed_after_backward_is_no_verdict(group: ElasticGroup) -> None:
    # A fused optimizer leaves DDP's verdict unread; the step fails after backward and its vote discards
    # it, so the inner optimizer never reads it. The next forward reads it before begin_step clears the
    # failure: no warning and no skip counted for a step that did not happen (it was read after, and
    # counted, before this was fixed).
    import warnings

    from shoal.elastic import ElasticOptimizer

    net = _net()
    model = shoal.DistributedDataParallel(net, process_group=group, bucket_cap_mb=CAP_MB)
    opt = ElasticOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True), group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = _batch(step)
            loss = F.mse_loss(model(x), y)
            if step == 2:
                handle = net[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan")))
            loss.backward()
            if step == 2:
                handle.remove()
                group.report_error(PeerLostError("injected after backward"))
                assert opt.step() is False
            else:
                assert opt.step() is True
            opt.zero_grad()
    assert not [w for w in caught if "NaN/Inf" in str(w.message)]
    assert model.comm_stats().total.nonfinite_skips == 0
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())


@pytest.mark.timeout(60)
def test_a_nonfinite_last_step_skipped_on_the_device_is_counted_by_comm_stats(group: ElasticGroup) -> None:
    net = _net()
    model = shoal.DistributedDataParallel(net, process_group=group, bucket_cap_mb=CAP_MB)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    x, y = _batch(0)
    net[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan")))
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        F.mse_loss(model(x), y).backward()
        opt.step()                                   # skipped on the device, verdict unread
        assert model.comm_stats().total.nonfinite_skips == 1   # read here: the run's last step counts
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
