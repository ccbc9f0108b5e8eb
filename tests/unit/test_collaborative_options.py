"""CollaborativeOptimizer options on a swarm of one peer: what each option changes, against a plain run.

Every optimizer here is alone in its run (one process, an in-process
coordinator), so an epoch is 2 steps of 4 samples and its "average" is the
peer's own gradient: each option's effect can be compared exactly with a
plain optimizer fed the same batches. Swarm-level behaviour of the same
options (equal peers, state averaging across peers) is in
tests/faults/test_collaborative_swarm.py.
"""

from __future__ import annotations

import gc
import io
import logging
import re
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.codecs import Cast
from shoal.collaborative.state import encode_state, stat_tensors
from shoal.membership.coordinator import Coordinator
from shoal.errors import ConfigError, ShoalError

TOKEN = "unit-token-456"
EPOCH_LINE = re.compile(r"^epoch (\d+): (\d+) peers, (\d+)/(\d+) samples, (\d+) samples/s, "
                        r"(averaged|local|loaded) with (\d+) peers in (\d+\.\d) s$")


@pytest.fixture(scope="module")
def coord() -> Iterator[Coordinator]:
    torch.set_num_threads(1)
    c = Coordinator(port=0, token=TOKEN).start()
    yield c
    c.stop()


@pytest.fixture
def made(coord: Coordinator) -> Iterator[list[shoal.CollaborativeOptimizer]]:
    """Optimizers a test created; all leave their runs at the end, whatever happened."""
    opts: list[shoal.CollaborativeOptimizer] = []
    yield opts
    for o in opts:
        o.shutdown()
    opts.clear()
    # Close their store connections now: with many open clients a new TCPStore connection
    # sometimes takes 5 s (seen with torch 2.13's TCPStore, both backends).
    gc.collect()


def _net(width: int = 8, dtype: torch.dtype = torch.float32) -> nn.Module:
    net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return net.to(dtype)


def _solo(coord: Coordinator, made: list[shoal.CollaborativeOptimizer], net: nn.Module, *,
          factory: Any = None, scheduler: Any = None, extra: tuple[torch.Tensor, ...] = (), target: int = 8,
          **cfg: Any) -> shoal.CollaborativeOptimizer:
    config = shoal.CollaborativeConfig(run_id="u" + uuid.uuid4().hex[:8], target_batch_size=target, batch_size_per_step=4,
                                       coordinator=coord.address, token=TOKEN, matchmaking_time=0.5,
                                       averaging_timeout=10, **cfg)
    opt = shoal.CollaborativeOptimizer(factory or (lambda ps: torch.optim.Adam(ps, lr=0.05)), net.named_parameters(),
                                       config=config, scheduler=scheduler, extra_tensors=extra)
    made.append(opt)
    return opt


def _backward(net: nn.Module, i: int, scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """Batch ``i`` (4 samples, the same on every call) through ``net``; gradients added to ``.grad``."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(4, 4, generator=gen)
    y = torch.randn(4, 2, generator=gen)
    first = next(net.parameters())
    scale(F.mse_loss(net(x.to(first.dtype)).float(), y)).backward()


def _train(opt: shoal.CollaborativeOptimizer, net: nn.Module, batches: range | list[int], zero: bool = True) -> None:
    for i in batches:
        _backward(net, i)
        opt.step()
        if zero:
            opt.zero_grad()


def _same(a: nn.Module | list[torch.Tensor], b: nn.Module | list[torch.Tensor]) -> bool:
    xs = list(a.parameters()) if isinstance(a, nn.Module) else a
    ys = list(b.parameters()) if isinstance(b, nn.Module) else b
    return all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_offload_optimizer_steps_host_fp32_copies_and_matches_the_plain_run(coord: Coordinator, made: list) -> None:
    plain_net, off_net = _net(), _net()
    plain, off = _solo(coord, made, plain_net), _solo(coord, made, off_net, offload_optimizer=True)
    _train(plain, plain_net, range(6))
    _train(off, off_net, range(6))
    assert plain.local_epoch == off.local_epoch == 3
    model = list(off_net.parameters())
    assert all(q is not p and q.data_ptr() != p.data_ptr() for p, q in zip(model, off.opt_params))
    assert all(a is b for a, b in zip(off.optimizer.param_groups[0]["params"], off.opt_params))
    assert {id(k) for k in off.optimizer.state} == {id(q) for q in off.opt_params}, "state must key the host copies"
    for q in off.opt_params:
        for k in ("exp_avg", "exp_avg_sq"):
            assert off.optimizer.state[q][k].device.type == "cpu" and off.optimizer.state[q][k].dtype == torch.float32
    assert _same(off_net, plain_net) and _same(model, off.opt_params), "offloading must not change the result"
    # A bf16 model: the optimizer keeps fp32 masters, the model receives their rounding at each epoch.
    half_net = _net(dtype=torch.bfloat16)
    half = _solo(coord, made, half_net, offload_optimizer=True)
    _train(half, half_net, range(4))
    assert all(q.dtype == torch.float32 for q in half.opt_params)
    assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(half_net.parameters(), half.opt_params))
    assert any(not torch.equal(q, q.to(torch.bfloat16).float()) for q in half.opt_params), "masters stay fp32"


def test_delay_optimizer_step_applies_the_update_at_the_next_step(coord: Coordinator, made: list) -> None:
    ref_net, net = _net(), _net()
    ref = _solo(coord, made, ref_net)
    opt = _solo(coord, made, net, offload_optimizer=True, delay_optimizer_step=True)
    stepped_in: list[str] = []
    real_step = opt.optimizer.step

    def spy(*a: Any, **k: Any) -> Any:
        stepped_in.append(threading.current_thread().name)
        return real_step(*a, **k)
    opt.optimizer.step = spy  # type: ignore[method-assign]
    _train(ref, ref_net, range(2))                 # one epoch, stepped at once
    before = [p.detach().clone() for p in net.parameters()]
    _train(opt, net, range(1))
    _backward(net, 1)
    report = opt.step()
    opt.zero_grad()
    assert report is not None and report.outcome == "local" and report.peers == 1 and opt.local_epoch == 1
    assert opt._pending is not None
    opt._pending.result()                          # the background step is done...
    assert _same(list(net.parameters()), before), "...but the model must not change before the next step()"
    assert not _same(opt.opt_params, before)
    _train(opt, net, [2])                          # batch 2's gradients were computed on the old parameters
    assert _same(net, ref_net), "the next step() applies exactly the plain run's update"
    assert stepped_in and all(name.startswith("shoal-collab") for name in stepped_in), stepped_in


def test_delay_grad_averaging_rounds_in_the_background_and_waits_at_the_next_epoch_end(
        coord: Coordinator, made: list) -> None:
    ref_net, net = _net(), _net()
    ref = _solo(coord, made, ref_net)
    opt = _solo(coord, made, net, offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True)
    rounds_in: list[str] = []
    real_round = opt._round

    def slow_round(*a: Any, **k: Any) -> Any:
        rounds_in.append(threading.current_thread().name)
        time.sleep(0.3)                            # longer than the next epoch's compute below
        return real_round(*a, **k)
    opt._round = slow_round  # type: ignore[method-assign]
    _train(ref, ref_net, range(2))
    _train(opt, net, range(1))
    _backward(net, 1)
    assert opt.step() is None, "with delay_grad_averaging the epoch's report comes from the background"
    opt.zero_grad()
    assert opt.local_epoch == 1 and opt.rounds == [], "the next batches already count for epoch 1"
    _train(opt, net, [2, 3])     # epoch 1 reaches its target: step() waits for epoch 0's round, then starts epoch 1's
    assert [r.epoch for r in opt.rounds] == [0] and _same(net, ref_net)
    opt.wait_pending()
    assert [(r.epoch, r.own_samples) for r in opt.rounds] == [(0, 8), (1, 8)], \
        "an epoch must end at its target even while the previous round runs (not accumulate past it)"
    assert rounds_in and all(name.startswith("shoal-collab") for name in rounds_in), rounds_in


def test_reuse_grad_buffers_accumulates_in_grad_and_matches_the_plain_run(coord: Coordinator, made: list) -> None:
    plain_net, net, probe = _net(), _net(), _net()
    plain = _solo(coord, made, plain_net, target=12)
    reuse = _solo(coord, made, net, target=12, reuse_grad_buffers=True)
    assert reuse._acc is None and plain._acc is not None, "with reuse_grad_buffers .grad is the only accumulator"
    _train(reuse, net, [0, 1], zero=False)
    _backward(probe, 0)
    _backward(probe, 1)              # plain autograd accumulation of the same two batches
    for p, q in zip(net.parameters(), probe.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    _train(reuse, net, [2], zero=False)
    assert reuse.local_epoch == 1 and all(p.grad is None for p in net.parameters()), "shoal zeroes .grad per epoch"
    _train(reuse, net, range(3, 6), zero=False)
    _train(plain, plain_net, range(6))
    for p, q in zip(net.parameters(), plain_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShoalError, match="reuse_grad_buffers"):
        reuse.zero_grad()
    _backward(net, 0)
    with pytest.raises(ConfigError, match="reuse_grad_buffers"):
        reuse.step(grad_scaler=torch.amp.GradScaler("cpu"))


def test_grad_scaler_skips_overflowed_batches_and_adjusts_the_scale(coord: Coordinator, made: list) -> None:
    ref_net, net = _net(), _net()
    ref = _solo(coord, made, ref_net)
    opt = _solo(coord, made, net)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scales = []
    for i in range(4):
        _backward(net, i, scale=scaler.scale)
        if i == 1:                      # this batch overflowed
            next(net.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        opt.step(grad_scaler=scaler)
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if i == 1:
            assert opt._samples == 4 and opt.tracker.add_samples(0, 0) == 4, "an overflowed batch is not counted"
        if i == 2:
            assert opt.local_epoch == 1
            _train(ref, ref_net, [0, 2])    # the same epoch without the overflowed batch, unscaled
            for p, q in zip(net.parameters(), ref_net.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # torch's rule: back off at an overflow; grow after growth_interval good batches in a row
    assert scales == [256.0, 128.0, 128.0, 256.0]


def test_scheduler_steps_once_per_epoch(coord: Coordinator, made: list) -> None:
    net = _net()
    opt = _solo(coord, made, net, factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
                scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5))
    lrs = []
    for i in range(6):
        _train(opt, net, [i])
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.1, 0.05, 0.05, 0.025, 0.025, 0.0125]
    assert opt.state_dict()["scheduler"]["last_epoch"] == 3
    # a scheduler instance over a ready optimizer
    net2 = _net()
    torch_opt = torch.optim.SGD(net2.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=2, gamma=0.1)
    config = shoal.CollaborativeConfig(run_id="u" + uuid.uuid4().hex[:8], target_batch_size=8, batch_size_per_step=4,
                                       coordinator=coord.address, token=TOKEN, matchmaking_time=0.5)
    opt2 = shoal.CollaborativeOptimizer(torch_opt, net2.named_parameters(), config=config, scheduler=sched)
    made.append(opt2)
    lrs = []
    for i in range(8):
        _train(opt2, net2, [i])
        lrs.append(opt2.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.01, 0.001])


def test_verbose_logs_one_line_per_epoch_in_the_documented_format(coord: Coordinator, made: list,
                                                                   caplog: Any) -> None:
    logger = logging.getLogger("shoal.collaborative")
    level = logger.level
    try:
        quiet_net, loud_net = _net(), _net()
        quiet = _solo(coord, made, quiet_net)
        loud = _solo(coord, made, loud_net, verbose=True)
        assert logger.getEffectiveLevel() <= logging.INFO
        assert not logger.handlers, "logging is configured (pytest's root handlers): no second handler"
        _train(quiet, quiet_net, range(6))
        _train(loud, loud_net, range(6))
        lines = [r.getMessage() for r in caplog.records if r.name == "shoal.collaborative"]
        epochs = [EPOCH_LINE.match(m) for m in lines]
        matched = [m for m in epochs if m is not None]
        assert [int(m.group(1)) for m in matched] == [0, 1, 2], lines
        for m in matched:
            assert m.group(2) == "1" and m.group(3) == m.group(4) == "8" and m.group(6) == "local", m.group(0)
    finally:
        logger.setLevel(level)


def test_state_loading_codec_sends_floating_state_in_fp16_and_scalars_exactly(coord: Coordinator, made: list) -> None:
    gen = torch.Generator().manual_seed(3)
    src_net = _net(512)
    src = _solo(coord, made, src_net, state_loading_codec=Cast(torch.float16), extra=(torch.randn(5, generator=gen),))
    _train(src, src_net, range(2))
    for st in src.optimizer.state.values():
        st["step"].fill_(5001.0)              # above 2048: fp16 cannot hold it exactly
    blob = src._state_blob()
    exact = encode_state(src._full_state(), None)
    assert blob.numel() < 0.6 * exact.numel(), "floating state travels in 2 bytes, not 4"
    sent = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    assert all(t.dtype == torch.float16 for t in sent["params"] + sent["extra"])
    assert all(s["exp_avg"].dtype == torch.float16 and s["step"].item() == 5001.0
               for s in sent["optimizer"]["state"].values())
    dst_net = _net(512)
    dst = _solo(coord, made, dst_net, extra=(torch.zeros(5),))
    before = [p.detach().clone() for p in dst.opt_params]
    # a state that is not of the round's epoch (a source lying about where the swarm is) is refused
    assert not dst._load_blob(blob, source=src.member_id, epoch=src.local_epoch + 5)
    assert _same(dst.opt_params, before) and dst.local_epoch == 0
    assert dst._load_blob(blob, source=src.member_id, epoch=src.local_epoch)
    assert dst.local_epoch == 1
    for p, q in zip(dst.opt_params + dst.extra, src.opt_params + src.extra):
        assert p.dtype == torch.float32 and torch.equal(p, q.detach().half().float())
    assert not _same(dst.opt_params, src.opt_params), "fp16 on the wire must show in the loaded parameters"
    for a, b in zip(dst.opt_params, src.opt_params):
        assert torch.equal(dst.optimizer.state[a]["exp_avg"], src.optimizer.state[b]["exp_avg"].half().float())
        assert dst.optimizer.state[a]["step"].item() == 5001.0
    # a blob for another model is refused and changes nothing
    other = _solo(coord, made, _net(32))
    keep = [p.detach().clone() for p in dst.opt_params]
    assert not dst._load_blob(other._state_blob(), source=other.member_id, epoch=other.local_epoch)
    assert _same(dst.opt_params, keep) and dst.local_epoch == 1


def test_average_state_every_runs_on_multiples_and_averages_the_named_statistics(coord: Coordinator,
                                                                                   made: list) -> None:
    net = _net()
    opt = _solo(coord, made, net, average_state_every=3, average_opt_statistics=("exp_avg_sq",),
                extra=(torch.zeros(2),))
    calls: list[tuple[int, bool]] = []
    real = opt._average_state

    def spy(skip: Any = ()) -> bool:
        assert not skip, "no member was caught sending bad data"
        calls.append((opt.local_epoch, real(skip)))
        return calls[-1][1]
    opt._average_state = spy  # type: ignore[method-assign]
    _train(opt, net, range(14))
    assert opt.local_epoch == 7
    assert calls == [(2, True), (5, True)], "state averaging belongs to the rounds that end epochs 3 and 6"
    _, names = stat_tensors(opt.opt_params, opt.names, opt.extra, opt.optimizer, ("exp_avg_sq",))
    params = list(opt.names)
    assert names == params + ["extra0"] + [f"{n}:exp_avg_sq" for n in params], names
