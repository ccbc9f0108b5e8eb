"""One peer of the collaborative tests: an MLP on a synthetic regression task.

Runs in a process (``collab_worker.py``, for the tests that kill peers) or in
a thread (:func:`run_threads`, for the tests of options and roles: no
process start-up, so a 3-peer swarm costs seconds). A :class:`Spec` says
what the peer does; :func:`train` returns what it saw: one record per epoch,
taken when the epoch's optimizer step is done (in the background thread with
the delayed modes), with a digest of the optimizer's parameters, the
learning rate, the extra tensor and the ``exp_avg_sq`` statistics.

Roles: ``peer``, ``aux``, ``client``, ``nan`` (declares finite gradients,
sends NaN), ``shape`` (a model of another width), ``stall`` (hangs inside
the round of epoch ``stall_at`` for longer than the averaging timeout, then
stops), ``die`` (SIGKILLed in epoch 2's averaging), ``late`` (a restarted
peer that joins a running swarm), ``epochlie`` (holds the token but claims an
epoch a million ahead: in every round header and in its signed progress
record, while holding parameters shifted by +100, so that a peer that loads
its state is visible). ``state_shift`` (with ``nan``): the peer also shifts its
parameters by this much just before each state averaging.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.codecs import Cast
from shoal.collaborative import CollaborativeOptimizer, RoundReport
from shoal.membership.coordinator import Coordinator


@dataclass
class Spec:
    """What one peer does (the JSON given to collab_worker.py has these fields)."""

    rank: int = 0
    role: str = "peer"
    batch: int = 16
    target: int = 96
    epochs: int = 5
    matchmaking: float = 3.0
    averaging_timeout: float = 20.0
    load_timeout: float = 10.0
    heartbeat: float = 5.0          # the library default: peers run as threads of the test process, whose
                                    # coordinator and heartbeats a loaded CI box can starve for seconds
    max_seconds: float = 40.0
    pace: float = 0.0               # seconds of pretend compute per step
    until_peers: int = 0            # stop 3 epochs after a round with this many peers follows one with fewer
    linger: float = 1.5             # stay in the swarm this long after the last epoch (others finish theirs)
    stall_at: int = 2
    lr_gamma: float = 0.0           # > 0: an ExponentialLR scheduler with this gamma (steps once per epoch)
    extra: bool = False             # one extra tensor (3 floats, starting at 0)
    drift_after: list[int] = field(default_factory=list)   # epochs after which params/stats/extra drift
    loading_codec: str | None = None                        # "fp16": state_loading_codec=Cast(float16)
    state_shift: float = 0.0                                # added to the parameters before state averaging
    options: dict[str, Any] = field(default_factory=dict)  # further CollaborativeConfig fields
    start_peers: int = 0            # wait for this many peers before training (run_threads: the coordinator's initial workers)
    hold_after: int = -1            # once this epoch is done, wait until hold_peers peers are in the swarm (a late
    hold_peers: int = 2             # joiner then always finds this peer there, however slowly it starts)
    wait_for_list: int = -1         # enter this epoch's first matchmaking only once another peer closed it
    stop_file: str = ""             # also stop once this file exists (the test's word that the other peers are done)


def digest(tensors: list[torch.Tensor]) -> float:
    """A position-weighted sum: equal tensors give equal digests, any change almost surely another."""
    total = 0.0
    for t in tensors:
        flat = t.detach().double().reshape(-1)
        total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def build_model(width: int = 32) -> nn.Module:
    """The same initial parameters on every peer, without touching the global RNG (threads share it)."""
    net = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return net


def _optimizer(spec: Spec, run_id: str, coordinator: str, token: str, net: nn.Module,
               extra: list[torch.Tensor]) -> CollaborativeOptimizer:
    cfg = shoal.CollaborativeConfig(
        run_id=run_id, target_batch_size=spec.target, batch_size_per_step=spec.batch, coordinator=coordinator,
        token=token, matchmaking_time=spec.matchmaking, averaging_timeout=spec.averaging_timeout,
        load_state_timeout=spec.load_timeout, auxiliary=spec.role == "aux", client_mode=spec.role == "client",
        heartbeat_timeout=spec.heartbeat,
        state_loading_codec=Cast(torch.float16) if spec.loading_codec == "fp16" else None,
        **{"average_state_every": 0, **spec.options})
    sched: Any = (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, spec.lr_gamma)) if spec.lr_gamma else None
    return CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=1e-2), net.named_parameters(), config=cfg,
                                  scheduler=sched, extra_tensors=extra)


def _stats(opt: CollaborativeOptimizer) -> float | None:
    sq = [opt.optimizer.state[p]["exp_avg_sq"] for p in opt.opt_params if "exp_avg_sq" in opt.optimizer.state.get(p, {})]
    return digest(sq) if sq else None


def _drift(opt: CollaborativeOptimizer, rank: int) -> None:
    """Make this peer's state differ from the others' (as a peer that stepped alone would)."""
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for p in opt.opt_params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.01 * (rank + 1))
            st = opt.optimizer.state.get(p, {})
            if "exp_avg_sq" in st:
                st["exp_avg_sq"].mul_(1.0 + 0.1 * (rank + 1))
        for t in opt.extra:
            t.add_(rank + 1)
        if opt.opt_params is not opt.params:
            for p, q in zip(opt.params, opt.opt_params):
                p.copy_(q)


def _wait_for_list(opt: CollaborativeOptimizer, epoch: int) -> None:
    """This peer reaches epoch ``epoch``'s first attempt only after another peer closed it (a peer that
    ran ahead, alone or with nobody): deterministic parking for the case, whatever the machine's load."""
    real = opt.group.matchmake

    def late(e: int, attempt: int, *args: Any, **kw: Any) -> Any:
        if e == epoch and attempt == 0:
            key, deadline = opt.group.key(f"mm/{e}/0/members"), time.monotonic() + 30.0
            while not opt.group.mm_store.check([key]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody closed epoch {e}'s first attempt within 30 s")
                time.sleep(0.01)
        return real(e, attempt, *args, **kw)
    opt.group.matchmake = late  # type: ignore[method-assign]


def _install_roles(opt: CollaborativeOptimizer, spec: Spec) -> None:
    if spec.wait_for_list >= 0:
        _wait_for_list(opt, spec.wait_for_list)
    if spec.role == "nan":   # lies: declares finite gradients, then sends NaN into the sum
        real = opt._contribution

        def poisoned() -> tuple[torch.Tensor, int, bool]:
            c, w, _ = real()
            return torch.full_like(c, float("nan")), max(w, 1), True
        opt._contribution = poisoned  # type: ignore[method-assign]
    if spec.state_shift:     # what this peer brings to state averaging is far from the swarm's state
        real_avg = opt._average_state

        def shifted(*args: Any, **kw: Any) -> Any:
            with torch.no_grad():
                for p in opt.opt_params:
                    p.add_(spec.state_shift)
            return real_avg(*args, **kw)
        opt._average_state = shifted  # type: ignore[method-assign]
    if spec.role == "epochlie":
        _lie_about_the_epoch(opt)
    if spec.role == "die":   # SIGKILLed in the middle of epoch 2's averaging
        real_mean = opt._robust_mean

        def die(*args: Any, **kw: Any) -> Any:
            if opt.local_epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_mean(*args, **kw)
        opt._robust_mean = die  # type: ignore[method-assign]
    if spec.role == "stall":  # hangs inside the round for longer than the averaging timeout, heartbeat alive
        real_attempt = opt._attempt

        def slow(*args: Any, **kw: Any) -> Any:
            if opt.local_epoch == spec.stall_at:
                time.sleep(spec.averaging_timeout + 1.0)
            return real_attempt(*args, **kw)
        opt._attempt = slow  # type: ignore[method-assign]


EPOCH_LIE = 10**6


def _lie_about_the_epoch(opt: CollaborativeOptimizer) -> None:
    """An authenticated peer claiming an epoch far ahead, wherever it can claim one."""
    real_header = opt._header
    opt._header = lambda my_epoch, weight, finite: real_header(my_epoch + EPOCH_LIE, weight, finite)  # type: ignore[method-assign]
    real_on_step = opt.tracker.on_step
    opt.tracker.settled = lambda: True

    def on_step(samples: int, epoch: int, local_samples: int, force: bool = False) -> None:
        real_on_step(samples, epoch + EPOCH_LIE, local_samples, True)   # a validly signed, lying record
    opt.tracker.on_step = on_step  # type: ignore[method-assign]
    opt.tracker.on_step(0, opt.local_epoch, 0)
    with torch.no_grad():
        for p in opt.opt_params:
            p.add_(100.0)


def _record_epochs(opt: CollaborativeOptimizer, spec: Spec, log: list[dict[str, Any]]) -> None:
    """Record each epoch when its optimizer step is done (whatever thread does it), then drift if asked."""
    real = opt._after_epoch

    def after(report: RoundReport) -> None:
        real(report)
        log.append({"epoch": report.epoch, "outcome": report.outcome, "peers": report.peers,
                    "samples": report.samples, "own": report.own_samples, "excluded": report.excluded,
                    "source": report.source, "local_epoch": opt.local_epoch, "digest": digest(opt.opt_params),
                    "finite": all(bool(torch.isfinite(p).all()) for p in opt.opt_params), "t": time.time(),
                    "took": report.seconds, "lr": opt.param_groups[0]["lr"], "stats": _stats(opt),
                    "votes": opt.group.group.step, "gave_up": opt.group.gave_up,
                    "extra": [float(v) for v in opt.extra[0]] if opt.extra else None,
                    "params": [p.detach().clone() for p in opt.opt_params]})
        if report.epoch in spec.drift_after:
            _drift(opt, spec.rank)
    opt._after_epoch = after  # type: ignore[method-assign]


def train(spec: Spec, run_id: str, coordinator: str, token: str, life: int = 0,
          on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run one peer to ``spec.epochs`` (or ``max_seconds``), then leave the swarm; what it saw.

    ``on_result`` gets the result before the peer lingers (a process saves it there).
    """
    role = "late" if life > 0 else spec.role
    net = build_model(33 if role == "shape" else 32)
    extra = [torch.zeros(3)] if spec.extra else []
    opt = _optimizer(spec, run_id, coordinator, token, net, extra)
    _install_roles(opt, spec)
    log: list[dict[str, Any]] = []
    _record_epochs(opt, spec, log)
    if role != "late":
        # The public start barrier: no peer races through epochs alone while the others start.
        opt.wait_for_peers(max(spec.start_peers, 1), timeout=30.0)
    g = torch.Generator().manual_seed(1000 + spec.rank)
    w_true = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    t_end = time.monotonic() + spec.max_seconds
    stop_at, seen_fewer = spec.epochs, life > 0
    reuse = bool(spec.options.get("reuse_grad_buffers"))
    while (opt.local_epoch < stop_at and time.monotonic() < t_end
           and not (spec.stop_file and os.path.exists(spec.stop_file))):
        if role != "aux":
            x = torch.randn(spec.batch, 16, generator=g)
            F.mse_loss(net(x), torch.tanh(x @ w_true)).backward()
        report = opt.step()
        if report is not None and report.epoch == spec.hold_after:
            opt.wait_for_peers(spec.hold_peers, timeout=60.0)
        if role not in ("aux",) and not reuse:
            opt.zero_grad()
        if spec.pace:
            time.sleep(spec.pace)
        if role == "stall" and opt.rounds and opt.rounds[-1].epoch >= spec.stall_at:
            break            # the stalled peer has shown what it had to: leave
        if report is not None and report.outcome in ("averaged", "loaded") and spec.until_peers:
            seen_fewer = seen_fewer or report.peers < spec.until_peers
            if seen_fewer and report.peers >= spec.until_peers and stop_at == spec.epochs:
                stop_at = report.epoch + 3
    opt.wait_pending()
    result = {"rank": spec.rank, "role": role, "member": opt.member_id, "log": log, "epoch": opt.local_epoch,
              "params": [p.detach().clone() for p in net.parameters()],
              "opt_params": [p.detach().clone() for p in opt.opt_params],
              "state_dict": opt.state_dict(), "progress": opt.swarm_progress(),
              "extra": [t.clone() for t in extra]}
    if on_result is not None:
        on_result(result)
    time.sleep(spec.linger)
    opt.shutdown()
    return result


def run_threads(specs: list[Spec], token: str, hard_limit: float = 60.0, coordinator: Coordinator | None = None,
                run_id: str | None = None) -> list[dict[str, Any] | BaseException]:
    """Run one peer per spec, each in a thread, around an in-process coordinator with ``token``.

    Returns each peer's result, or the exception it raised. Raises TimeoutError if a peer is still
    running after ``hard_limit`` seconds (its thread is a daemon: it cannot outlive the test process).
    With ``coordinator`` and ``run_id`` the threads join that run (other peers may be processes)
    and the caller stops the coordinator.
    """
    torch.set_num_threads(1)
    coord = coordinator or Coordinator(port=0, initial_workers=len(specs), token=token).start()
    specs = [s if s.start_peers else replace(s, start_peers=coord.initial_workers) for s in specs]
    run_id = run_id or uuid.uuid4().hex[:8]
    out: list[dict[str, Any] | BaseException | None] = [None] * len(specs)

    def body(i: int) -> None:
        try:
            out[i] = train(specs[i], run_id, coord.address, token)
        except BaseException as e:  # noqa: BLE001 - handed to the test, which fails with it
            out[i] = e

    threads = [threading.Thread(target=body, args=(i,), name=f"peer{i}", daemon=True) for i in range(len(specs))]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, hard_limit - (time.monotonic() - t0)))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"peers {alive} still running after {hard_limit} s")
    finally:
        if coordinator is None:
            coord.stop()
    return [r if r is not None else RuntimeError("peer returned nothing") for r in out]


def by_epoch(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each epoch this peer went through with the swarm (averaged, or loaded the swarm's result)."""
    return {int(r["epoch"]): r for r in result["log"] if r["outcome"] in ("averaged", "loaded")}


def assert_equal_after_each_round(results: list[dict[str, Any]], logs: str = "") -> set[int]:
    """Every epoch that all these peers went through ended with the same parameters on each."""
    logs_by_epoch = [by_epoch(r) for r in results]
    common = set.intersection(*(set(b) for b in logs_by_epoch))
    assert common, f"no epoch in common\n{logs}"
    for e in sorted(common):
        digests = {b[e]["digest"] for b in logs_by_epoch}
        assert len(digests) == 1, f"epoch {e}: parameters differ between peers: {digests}\n{logs}"
    return common


def finished(results: list[dict[str, Any] | BaseException]) -> list[dict[str, Any]]:
    """The peers' results; fails with the first peer's exception if one raised."""
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"a peer failed: {r!r}") from r
    return results  # type: ignore[return-value]
