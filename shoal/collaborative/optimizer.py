"""CollaborativeOptimizer: hivemind-style training across unreliable peers.

Each ``step()`` adds this peer's gradients to a local accumulator and its
batch to the swarm's sample counter. When the swarm's samples for the epoch
reach ``target_batch_size``, the peers ready within ``matchmaking_time``
average their accumulated gradients, weighted by samples, through the
gradient codec, and all step their optimizers: the epoch advances. What can
go wrong, and what happens:

- a peer dies mid-round: the collective fails at once, the vote discards,
  and the survivors match again and average among themselves (within
  ``averaging_timeout``);
- averaging cannot finish in ``averaging_timeout``: this peer steps with its
  own gradients and logs it;
- a peer is behind (joined late, missed rounds): it takes part in the next
  round with weight 0 and receives parameters, optimizer state, scheduler
  state and epoch from an up-to-date, non-client peer;
- a peer sends a header it cannot back (wrong shapes or dtypes, absurd
  weight) or non-finite data: it is excluded from the round (see
  :mod:`shoal.collaborative.validate` for how) and logged; a header
  violation also bans it from this peer's later rounds (not waited for,
  not listed, and a round it closed alone does not leave this peer behind);
- a peer caught sending NaN/Inf is also left out of the round's state
  averaging and does not serve state in it;
- a peer declares an epoch ahead of the round's (to be the one others load
  state from): excluded; the swarm's epoch is what a strict majority of the
  settled peers' signed progress records say (progress.py, records.py);
- this peer's own gradients are NaN/Inf: its contribution is dropped (weight 0).

Example::

    opt = shoal.CollaborativeOptimizer(
        lambda params: torch.optim.Adam(params, lr=1e-3), params=model.named_parameters(),
        config=shoal.CollaborativeConfig(run_id="mlp", target_batch_size=4096, batch_size_per_step=64,
                                         coordinator="10.0.0.1:29400", token="s3cret-token"))
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()              # accumulates; steps the optimizer when the swarm reaches 4096 samples
        opt.zero_grad()
    opt.shutdown()
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import os
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from shoal.comm.streams import SideStream

from shoal.codecs.base import Codec
from shoal.codecs.identity import Identity
from shoal.collaborative.config import CollaborativeConfig
from shoal.collaborative.progress import ProgressTracker, SwarmProgress
from shoal.collaborative.records import RecordBook
from shoal.collaborative.loading import StateMixin, Throttle
from shoal.collaborative.rounds import RoundGroup, RoundReport
from shoal.collaborative.validate import (FLAG_AUX, FLAG_CLIENT, FLAG_FRESH, HEADER_LEN, encode_header,
                                          judge_headers, layout_digest)
from shoal.errors import ConfigError, ShoalError

log = logging.getLogger("shoal.collaborative")

OptimizerOrFactory = torch.optim.Optimizer | Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class CollaborativeOptimizer(StateMixin):
    """Wraps a torch optimizer for training with peers that come and go; see the module docstring.

    Args:
        optimizer_or_factory: a torch optimizer, or ``f(params) -> optimizer``
            (needed with ``offload_optimizer``, which hands it host copies).
        params: the parameters, as ``named_parameters()`` pairs (names are
            the codec's state keys) or tensors; default: the optimizer's.
        config: a :class:`CollaborativeConfig`.
        scheduler: a learning-rate scheduler or ``f(optimizer) -> scheduler``; stepped once per epoch.
        extra_tensors: tensors averaged with the state and sent to peers that load
            state (e.g. batch-norm statistics).
    """

    def __init__(self, optimizer_or_factory: OptimizerOrFactory,
                 params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None, *,
                 config: CollaborativeConfig, scheduler: Any = None,
                 extra_tensors: Sequence[torch.Tensor] = ()) -> None:
        if not isinstance(config, CollaborativeConfig):
            raise ConfigError(f"config must be a shoal.CollaborativeConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.names, self.params = self._params(optimizer_or_factory, params)
        # Accumulators live with the parameters (whose gradients they sum); what travels is
        # staged on the round group's device (the CPU: its groups are gloo).
        self._device = self.params[0].device
        self.extra = [t for t in extra_tensors]
        if cfg.offload_optimizer:
            if isinstance(optimizer_or_factory, torch.optim.Optimizer):
                raise ConfigError("offload_optimizer=True needs an optimizer factory (params -> optimizer): the "
                                  "optimizer must be built over the host copies, not the model's parameters")
            self.opt_params = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_(True)
                               for p in self.params]
        else:
            self.opt_params = self.params
        self.optimizer = optimizer_or_factory if isinstance(optimizer_or_factory, torch.optim.Optimizer) \
            else optimizer_or_factory(self.opt_params)
        self.scheduler = scheduler(self.optimizer) if callable(scheduler) and not hasattr(scheduler, "step") \
            else scheduler
        self.grad_codec: Codec = cfg.grad_codec or Identity()
        self.state_codec: Codec = cfg.state_averaging_codec or Identity()
        self.local_epoch = 0
        self.last_round: RoundReport | None = None
        self.rounds: list[RoundReport] = []
        self._numel = sum(p.numel() for p in self.params)
        # The gradient accumulator; with reuse_grad_buffers the parameters' .grad are the accumulator
        # and no model-sized buffer is kept between epochs.
        self._acc: torch.Tensor | None = None if cfg.reuse_grad_buffers else self._zeros()
        self._acc_views = self._views(self._acc) if self._acc is not None else []
        self._samples = 0
        self._micro = 0
        self._fresh = True           # holds no swarm state yet (its header says so)
        self._left_out = False       # a round it tried to join closed without it: the swarm is ahead
        self._alone = False          # said that it trains alone (once, until a round with others)
        self._throttle = Throttle()  # repeated warnings: one line per 10 s
        self._scaler_good = 0
        self._digest = layout_digest(self.names, self.params)
        role = {"aux": cfg.auxiliary, "client": cfg.client_mode, "pid": os.getpid()}
        if cfg.verbose:
            _enable_verbose_log()
        self.group = RoundGroup(cfg.run_id, cfg.coordinator, cfg.timeouts(), cfg.token, cfg.matchmaking_time, role)
        self.member_id = self.group.client.member_id
        store = self.group.client.store.clone()  # type: ignore[attr-defined]
        self.tracker = ProgressTracker(store, cfg.run_id, self.member_id, cfg.target_batch_size,
                                       book=RecordBook(store, cfg.run_id, self.member_id, cfg.token),
                                       settled=lambda: not self._fresh,
                                       role="auxiliary" if cfg.auxiliary else "client" if cfg.client_mode else "peer")
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="shoal-collab") if cfg.delay_optimizer_step else None
        self._side = SideStream(self._device)   # CUDA: the delayed step's own stream, events both ways
        self._pending: cf.Future[tuple[None, Any]] | None = None

    # --- construction helpers --------------------------------------------------
    @staticmethod
    def _params(opt: Any, params: Any) -> tuple[list[str], list[torch.Tensor]]:
        if params is None:
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError("params are required when an optimizer factory is given")
            items: list[Any] = [p for g in opt.param_groups for p in g["params"]]
        else:
            items = list(params)
        named = [(f"p{i}", x) if isinstance(x, torch.Tensor) else x for i, x in enumerate(items)]
        for n, p in named:
            if not isinstance(n, str) or not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise ConfigError(f"params must be floating tensors or (name, tensor) pairs, got {n!r}")
        if not named:
            raise ConfigError("CollaborativeOptimizer got no parameters to train")
        devices = sorted({str(p.device) for _, p in named})
        if len(devices) > 1:
            raise ConfigError(f"the parameters live on several devices ({', '.join(devices)}); "
                              "CollaborativeOptimizer sums their gradients in one flat buffer: move the model first")
        return [n for n, _ in named], [p for _, p in named]

    # --- the user's API ----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (not allowed with ``reuse_grad_buffers``: shoal owns them then)."""
        if self.config.reuse_grad_buffers:
            raise ShoalError("zero_grad() with reuse_grad_buffers=True would erase the accumulated gradients: "
                             "shoal zeroes .grad itself after each epoch; remove the zero_grad() call")
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> int:
        """Wait until at least ``n`` peers (this one included) are in the swarm; returns how many are.

        A start barrier: without one the first peer to start trains alone until the others come
        (each later one then loads its state). ShoalError if fewer than ``n`` are there after ``timeout`` s.

        Example::

            opt.wait_for_peers(4, timeout=120)   # all four peers start training together
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"wait_for_peers(n=...) must be an integer >= 1 (this peer included), got {n!r}")
        deadline = time.monotonic() + timeout
        while True:
            count = len(self.group.live_others()) + 1
            if count >= n:
                return count
            if time.monotonic() > deadline:
                raise ShoalError(f"only {count} of {n} peers are in run {self.config.run_id!r} after {timeout} s: "
                                 "start the others (same run_id, coordinator and token), or wait for fewer")
            time.sleep(0.05)

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None,
             grad_scaler: Any = None) -> RoundReport | None:
        """Accumulate this step's gradients; average and step when the swarm reaches the target.

        Returns the round's report at the steps that end an epoch, else None.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._apply_pending()
        if self.config.auxiliary:
            return self._aux_step()
        bs = batch_size if batch_size is not None else self.config.batch_size_per_step
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ConfigError(f"batch size must be an integer >= 1 (pass batch_size= or set "
                              f"CollaborativeConfig.batch_size_per_step), got {bs!r}")
        if self._fresh and self.local_epoch < self._catch_up_epoch():
            return self._catch_up()
        if not self._accumulate(bs, grad_scaler):
            return None
        total = self.tracker.add_samples(self.local_epoch, bs)
        self.tracker.on_step(bs, self.local_epoch, self._samples)
        if total < self.config.target_batch_size:
            return None
        # The previous epoch's background work must land first (as in hivemind): otherwise a peer
        # that computes faster than it averages keeps accumulating, and a weight above the header
        # bound (4x the target) gets it excluded from every round.
        self.wait_pending()
        return self._end_epoch()

    def _accumulate(self, bs: int, scaler: Any) -> bool:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        inv = 1.0
        if scaler is not None and scaler.is_enabled():
            if self._acc is None:
                raise ConfigError("step(grad_scaler=...) cannot be used with reuse_grad_buffers=True: every batch's "
                                  "scaled gradients are summed in .grad, so a batch that overflowed cannot be "
                                  "skipped and a scale change would mix scales; set reuse_grad_buffers=False")
            scale = float(scaler.get_scale())
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                scaler.update(scale * scaler.get_backoff_factor())   # overflow: skip this batch, as torch does
                self._scaler_good = 0
                return False
            self._scaler_good += 1
            if self._scaler_good >= scaler.get_growth_interval():
                scaler.update(scale * scaler.get_growth_factor())
                self._scaler_good = 0
            inv = 1.0 / scale
        if self.config.reuse_grad_buffers:
            self._micro += 1            # .grad sums the batches' mean gradients; read at the epoch's end
        else:
            torch._foreach_add_(self._acc_views, [g.detach().float() for g in grads], alpha=bs * inv)
        self._samples += bs
        return True

    def _contribution(self) -> tuple[torch.Tensor, int, bool]:
        """This peer's weighted gradient sum (flat fp32), its weight in samples, and whether it is finite."""
        if self._acc is None:       # reuse_grad_buffers: .grad holds the sum of the batches' mean gradients
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            contrib = torch.cat([g.detach().reshape(-1).float() for g in grads])
            contrib.mul_(self._samples / self._micro if self._micro else 0.0)
        else:
            contrib = self._acc.clone()
        if not bool(torch.isfinite(contrib).all()):
            log.warning("epoch %d: this peer's gradients contain NaN/Inf; its contribution is dropped this round",
                        self.local_epoch)
            return self._zeros(), 0, False
        return contrib, self._samples, True

    def _reset_accumulators(self) -> None:
        if self._acc is not None:
            self._acc.zero_()
        self._samples = self._micro = 0
        if self.config.reuse_grad_buffers:
            for p in self.params:
                p.grad = None

    # --- epoch end ----------------------------------------------------------------
    def _end_epoch(self) -> RoundReport | None:
        contrib, weight, finite = self._contribution()
        epoch = self.local_epoch
        self._reset_accumulators()
        if self._pool is not None and self.config.delay_grad_averaging:
            self.local_epoch += 1        # the next batches count towards the next epoch already
            self._pending = self._pool.submit(self._side.run, self._side.ready(),
                                              lambda: self._finish_round(epoch, contrib, weight, finite))
            return None
        report, averaged = self._round(epoch, epoch, contrib, weight, finite, self.config.averaging_timeout)
        if self._pool is not None and report.outcome != "behind":
            self.local_epoch = report.epoch + 1
            self._pending = self._pool.submit(self._side.run, self._side.ready(),
                                              lambda: self._apply(report, averaged, contrib, weight))
        else:
            self._apply(report, averaged, contrib, weight)
            self._copy_back()
        return report

    def _finish_round(self, epoch: int, contrib: torch.Tensor, weight: int, finite: bool) -> None:
        report, averaged = self._round(epoch, epoch, contrib, weight, finite, self.config.averaging_timeout)
        self._apply(report, averaged, contrib, weight)

    def _apply(self, report: RoundReport, averaged: torch.Tensor | None, contrib: torch.Tensor, weight: int) -> None:
        """Step with the round's mean (or, after a failed round, this peer's own gradients); advance the epoch."""
        if report.outcome == "local" and averaged is None and weight > 0:
            averaged = contrib / weight
        if report.outcome == "behind":
            self._left_behind(report.epoch)
        else:
            if averaged is not None:
                for p, g in zip(self.opt_params, self._views(averaged)):
                    p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
            self.local_epoch = report.epoch + 1
        self._after_epoch(report)

    def _apply_pending(self) -> None:
        if self._pending is not None and self._pending.done():
            fut, self._pending = self._pending, None
            _, done = fut.result()
            self._side.join(done)
            self._copy_back()

    def _copy_back(self) -> None:
        if self.opt_params is not self.params:
            with torch.no_grad():
                for p, q in zip(self.params, self.opt_params):
                    p.copy_(q)

    def _after_epoch(self, report: RoundReport) -> None:
        self.tracker.on_step(0, self.local_epoch, self._samples, force=True)
        self.tracker.ema.pause()
        self.last_round = report
        self.rounds.append(report)
        if self.config.verbose:
            view = self.swarm_progress()
            log.info("epoch %d: %d peers, %d/%d samples, %.0f samples/s, %s with %d peers in %.1f s",
                     report.epoch, view.num_peers, report.samples, self.config.target_batch_size,
                     view.samples_per_second, report.outcome, report.peers, report.seconds)

    # --- rounds ---------------------------------------------------------------------
    def _round(self, epoch: int, my_epoch: int, contrib: torch.Tensor, weight: int, finite: bool,
               timeout: float) -> tuple[RoundReport, torch.Tensor | None]:
        """Average ``contrib`` with the peers ready for ``epoch``; retry without lost peers until ``timeout``."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        excluded: set[int] = set()
        attempt = skips = 0
        while time.monotonic() < deadline:
            q = self.group.matchmake(epoch, attempt, weight > 0, excluded, deadline)
            attempt += 1
            if q is None and self.group.skipped:   # a banned peer closed it alone: the next, with the others,
                skips += 1                          # after a wait that grows (rounds.py, skip_backoff)
                wait = self.group.skip_backoff(skips)
                if wait is None:
                    log.warning("epoch %d: %d attempts closed without a peer this one trusts (banned peers %s); "
                                "stepping with local gradients", epoch, skips, sorted(self.group.banned))
                    break
                time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                continue
            if q is None and not self.group.gave_up:
                log.debug("epoch %d: the round closed without this peer", epoch)
                self._fresh = self._left_out = True
                return RoundReport(epoch, "behind", 0, 0, time.monotonic() - t0), None
            if q is None:
                log.warning("epoch %d: no averaging group formed within %.1f s; stepping with local gradients",
                            epoch, timeout)
                break
            if not self.group.enter(q, deadline):
                continue
            outcome = self._attempt(epoch, my_epoch, contrib, weight, finite, excluded, t0)
            if outcome is not None:
                return outcome
        else:
            log.warning("epoch %d: averaging did not finish within %.1f s; stepping with local gradients",
                        epoch, timeout)
        return RoundReport(epoch, "local", 1, weight, time.monotonic() - t0, own_samples=weight), None

    def _header(self, my_epoch: int, weight: int, finite: bool) -> torch.Tensor:
        flags = (FLAG_AUX if self.config.auxiliary else 0) | (FLAG_CLIENT if self.config.client_mode else 0) \
            | (FLAG_FRESH if self._fresh else 0)
        return encode_header(self.member_id, my_epoch, weight, finite, self._digest, self._numel, flags,
                             self.group.device)

    def _attempt(self, epoch: int, my_epoch: int, contrib: torch.Tensor, weight: int, finite: bool,
                 excluded: set[int], t0: float) -> tuple[RoundReport, torch.Tensor | None] | None:
        g = self.group
        table = torch.empty(HEADER_LEN * g.size, dtype=torch.int64, device=g.device)
        g.group.all_gather_into(table, self._header(my_epoch, weight, finite), tag="collab/header").wait()
        if g.error is not None:
            g.vote()
            return None
        members = g.quorum.members if g.quorum else ()
        verdict = judge_headers(list(table.view(g.size, HEADER_LEN)), members, 4 * self.config.target_batch_size,
                                round_epoch=epoch)
        if verdict.violators:
            for r in verdict.violators:
                log.warning("epoch %d: excluding member %d from the round: it %s", epoch, members[r], verdict.reasons[r])
            excluded.update(members[r] for r in verdict.violators)
            self.group.ban({members[r] for r in verdict.violators})
            g.drop()
            if g.rank in verdict.violators:
                return RoundReport(epoch, "local", 1, weight, time.monotonic() - t0, (self.member_id,)), None
            return None
        if verdict.weights[g.rank] == 0:
            contrib = torch.zeros_like(contrib)
        averaged, bad = self._robust_mean(contrib, verdict.weights, self.grad_codec, "collab/grad")
        # A member caught sending bad data is out of the rest of the round: it does not serve
        # state (the next candidate does) and its tensors are left out of state averaging.
        verdict = verdict.without(bad)
        behind = g.rank in verdict.behind           # receives state (behind, or fresh)
        stale = behind and verdict.weights[g.rank] == 0   # behind: its gradients are for old parameters
        loaded = self._exchange_state(verdict)
        if not g.vote():
            return None
        if self.config.average_state_every and (verdict.epoch + 1) % self.config.average_state_every == 0:
            # Left out: members caught sending bad data, and members behind (weight 0: they sent zeros, so
            # nothing about them could be caught, and what they hold is a copy of the source's state or stale).
            self._average_state(sorted(set(bad) | set(verdict.behind)))
        ex = tuple(sorted({members[r] for r in bad} | excluded))
        took = time.monotonic() - t0
        peers, samples = g.size, sum(verdict.weights)
        src = members[verdict.source] if verdict.behind and verdict.source is not None else None
        if behind and not loaded:
            return RoundReport(verdict.epoch, "behind", peers, samples, took, ex, 0, src), None
        if stale:
            self._fresh = self._left_out = False
            return RoundReport(verdict.epoch, "loaded", peers, samples, took, ex, 0, src), averaged
        if loaded:
            log.info("epoch %d: loaded the parameters of member %d (this peer started fresh)", epoch,
                     members[verdict.source or 0])
        self._fresh = self._left_out = False
        if g.size == 1:    # nobody else was ready: honest about it (see RoundReport.outcome)
            self._say_alone("no other peer was ready for the round")
        self._alone = g.size == 1
        return RoundReport(verdict.epoch, "averaged" if g.size > 1 else "local", g.size, samples, took, ex, verdict.weights[g.rank], src), averaged

    # --- progress, checkpoints, shutdown -------------------------------------------------
    def swarm_progress(self) -> SwarmProgress:
        """The swarm's global view: epoch, samples, peers, samples/s, estimated time to the next epoch."""
        return self.tracker.swarm(sorted(self.group.live_members()))

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state plus ``local_epoch`` (and the scheduler's)."""
        self.wait_pending()
        return {"optimizer": self.optimizer.state_dict(), "local_epoch": self.local_epoch,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the argument is not modified)."""
        if not isinstance(state, dict) or "optimizer" not in state or "local_epoch" not in state:
            raise ConfigError("expected a dict from CollaborativeOptimizer.state_dict() with 'optimizer' and "
                              f"'local_epoch', got {type(state).__name__} with keys {sorted(state) if isinstance(state, dict) else '-'}")
        state = copy.deepcopy(state)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = int(state["local_epoch"])
        self._fresh = self._left_out = False

    def wait_pending(self) -> None:
        """Wait for a background averaging or optimizer step, and apply it."""
        if self._pending is not None:
            self._pending.result()
            self._apply_pending()

    def shutdown(self) -> None:
        """Finish background work and leave the swarm (the others go on without this peer)."""
        try:
            self.wait_pending()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self.group.leave()

    def __repr__(self) -> str:
        return (f"CollaborativeOptimizer(run={self.config.run_id!r}, member={self.member_id}, "
                f"epoch={self.local_epoch}, samples={self._samples})")


def _enable_verbose_log() -> None:
    """Let INFO lines through; print them to stderr unless the application configured logging (no duplicates)."""
    if not log.hasHandlers():
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s shoal.collaborative: %(message)s", "%H:%M:%S"))
        log.addHandler(h)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
