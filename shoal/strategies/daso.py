"""DASO (Heat's Distributed Asynchronous and Selective Optimization, SPEC E2).

Inside each host, gradients are averaged synchronously every step (shoal's
DDP over the host's ranks). Between hosts, only the host leaders talk, and
only every ``global_skips`` steps: each leader sends how far its parameters
moved since the last global agreement, downcast to ``downcast_type`` (bf16 by
default), the leaders average these deltas in the background, and the result
lands ``global_skips // 4`` steps later. On landing a host keeps the progress
it made meanwhile: ``params = agreed + (params_now - params_at_launch)``; then
the leader broadcasts the parameters inside its host. During the warm-up and
cool-down epochs the global sync happens every step and is blocking. In
between, ``global_skips`` doubles (up to ``max_global_skips``) after every
epoch whose world-mean loss stays within ``stability_level`` (relative) of the
previous epoch's, and drops back to 1 when the loss moves by more.

Sending deltas rather than parameters (Heat sends the parameters) keeps bf16
rounding off the parameters themselves: a bf16 parameter would swallow
updates smaller than 1/256 of its magnitude. See docs/daso.md.
"""

from __future__ import annotations

import math
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from shoal.averagers import finite_mean
from shoal.codecs.base import Codec
from shoal.codecs.cast import Cast
from shoal.codecs.identity import Identity
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.group import Group
from shoal.comm.streams import SideStream
from shoal.comm.topology import HostGroups
from shoal.errors import ConfigError, ShoalError
from shoal.strategies.base import Strategy, broadcast_module

if TYPE_CHECKING:
    from shoal.strategies.daso_elastic import ElasticDASO

TAG = "daso/global"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class DASOConfig:
    """DASO's knobs, with Heat's names and defaults.

    Args:
        total_epochs: length of training (the cool-down is its last epochs).
        steps_per_epoch: optimizer steps per epoch (Heat's ``last_batch``).
        warmup_epochs: first epochs with a blocking global sync every step.
        cooldown_epochs: last epochs with a blocking global sync every step.
        max_global_skips: the most steps between two global syncs.
        stability_level: relative loss change below which an epoch counts as a plateau.
        downcast_type: dtype of the deltas on the wire between hosts.

    >>> DASOConfig(total_epochs=10, steps_per_epoch=100).max_global_skips
    8
    """

    total_epochs: int
    steps_per_epoch: int
    warmup_epochs: int = 4
    cooldown_epochs: int = 4
    max_global_skips: int = 8
    stability_level: float = 0.05
    downcast_type: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("total_epochs", "steps_per_epoch", "max_global_skips"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("warmup_epochs", "cooldown_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        if not (isinstance(self.stability_level, (int, float)) and 0 <= self.stability_level < 1):
            raise ConfigError(f"stability_level must be in [0, 1) (a relative loss change), got {self.stability_level!r}")
        if self.downcast_type not in _DTYPES:
            raise ConfigError(f"downcast_type must be one of {_DTYPES}, got {self.downcast_type!r}")


@dataclass
class DASOSchedule:
    """When to launch a global sync and when it lands; no communication (testable alone).

    Call :meth:`after_step` once per optimizer step: it returns ``(launch,
    land)`` for the step just taken. At an epoch's last step it also adapts
    ``global_skips`` from the epoch's loss given to :meth:`record_loss`
    (world mean). ``events`` logs ``(step, "launch" | "land", global_skips)``.

    >>> s = DASOSchedule(DASOConfig(total_epochs=3, steps_per_epoch=2, warmup_epochs=1, cooldown_epochs=1))
    >>> [s.after_step() for _ in range(2)]
    [(True, True), (True, True)]
    """

    config: DASOConfig
    step: int = 0
    global_skips: int = 1
    land_at: int | None = None
    last_loss: float | None = None
    epoch_loss: list[float] = field(default_factory=list)
    events: list[tuple[int, str, int]] = field(default_factory=list)

    @property
    def epoch(self) -> int:
        return self.step // self.config.steps_per_epoch

    def synchronous(self, epoch: int) -> bool:
        """Warm-up and cool-down epochs sync globally, blocking, every step."""
        c = self.config
        return epoch < c.warmup_epochs or epoch >= c.total_epochs - c.cooldown_epochs

    @property
    def batches_to_wait(self) -> int:
        return 0 if self.synchronous(self.epoch) else self.global_skips // 4

    def record_loss(self, value: float) -> None:
        self.epoch_loss.append(float(value))

    def after_step(self) -> tuple[bool, bool]:
        spe = self.config.steps_per_epoch
        b = self.step % spe
        gs = 1 if self.synchronous(self.epoch) else self.global_skips
        launch = self.land_at is None and b % gs == 0
        if launch:
            self.land_at = min(b + self.batches_to_wait, spe - 1)  # never across an epoch's end
            self.events.append((self.step, "launch", gs))
        land = self.land_at is not None and b == self.land_at
        if land:
            self.land_at = None
            self.events.append((self.step, "land", gs))
        self.step += 1
        if self.step % spe == 0:
            self._end_epoch()
        return launch, land

    def _end_epoch(self) -> None:
        loss = sum(self.epoch_loss) / len(self.epoch_loss) if self.epoch_loss else None
        self.epoch_loss = []
        if self.synchronous(self.epoch) or self.synchronous(self.epoch - 1) or loss is None or self.last_loss is None:
            self.global_skips = 1
        elif abs(loss - self.last_loss) <= self.config.stability_level * abs(self.last_loss):
            self.global_skips = min(2 * self.global_skips, self.config.max_global_skips)  # plateau
        else:
            self.global_skips = 1  # the loss moved: sync often again
        if loss is not None:
            self.last_loss = loss

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "global_skips": self.global_skips, "land_at": self.land_at,
                "last_loss": self.last_loss, "epoch_loss": list(self.epoch_loss)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step, self.global_skips = int(state["step"]), int(state["global_skips"])
        self.land_at, self.last_loss = state["land_at"], state["last_loss"]
        self.epoch_loss = list(state["epoch_loss"])


class _GlobalSync:
    """The leaders' background averaging of parameter deltas, and the landing."""

    def __init__(self, params: list[nn.Parameter], levels: HostGroups, codec: Codec) -> None:
        self.params, self.levels, self.codec = params, levels, codec
        self.active = levels.topology.num_hosts > 1  # one host: DDP inside it is all there is
        numel = sum(p.numel() for p in params)
        device = params[0].device
        self.ref = self._flat_params(torch.empty(numel, dtype=torch.float32, device=device))  # last agreed
        self.at_launch = torch.empty_like(self.ref)
        self.delta = torch.empty_like(self.ref)
        self._thread: ThreadPoolExecutor | None = None
        self._work: ThreadFuture | None = None
        self._side = SideStream(device)   # CUDA: the background mean's own stream, events both ways

    def _flat_params(self, out: torch.Tensor) -> torch.Tensor:
        torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params], out=out)
        return out

    def _write_params(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()

    def launch(self) -> None:
        leaders = self.levels.leaders
        if leaders is None or not self.active:
            return
        self._flat_params(self.at_launch)
        torch.sub(self.at_launch, self.ref, out=self.delta)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-daso")
        codec, delta = self.codec, self.delta
        # A host whose delta holds a NaN/Inf is left out of the mean (see finite_mean); lenient: when
        # every host is, the mean is zero and every host restarts from the last agreed parameters.
        self._work = self._thread.submit(self._side.run, self._side.ready(),
                                         lambda: finite_mean(codec, [delta], ["params"], leaders, TAG, strict=False))

    @torch.no_grad()
    def land(self) -> None:
        """Agreed params + this host's progress since launch; then every host rank gets the leader's."""
        if not self.active:
            return
        if self.levels.leaders is not None:
            if self._work is None:
                raise ShoalError("DASO: a global sync lands that was never launched")
            _, done = self._work.result()
            self._work = None
            self._side.join(done)                           # CUDA: read the mean after it is written
            self.ref.add_(self.delta)                       # the agreed parameters at launch
            now = self._flat_params(self.delta)             # reuse the buffer: parameters now
            now.sub_(self.at_launch).add_(self.ref)         # + progress since launch
            if read_flag(nonfinite_flag([now])):            # this host's progress is not finite: drop it
                now.copy_(self.ref)
            self._write_params(now)
        self._broadcast_in_host()

    def _broadcast_in_host(self) -> None:
        local = self.levels.local
        if local.size == 1:
            return
        flat = self._flat_params(self.at_launch)
        local.broadcast(flat, src=0, tag="daso/local-bcast").wait()
        self._write_params(flat)  # only leaders keep a reference: theirs makes the next delta

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class DASO(Strategy):
    """DASO as a strategy: host-synchronous, globally skipping and delayed, loss-adaptive.

    Args: those of :class:`DASOConfig` (Heat's names).

    With :func:`shoal.wrap` the module returned is
    :class:`shoal.DistributedDataParallel` over the ranks of this rank's host
    (exact gradient averaging every step); the global schedule runs after
    each ``optimizer.step()``. Give it each step's loss with
    :meth:`report_loss` so the skips can adapt (without losses they stay at
    1). Hosts come from :mod:`shoal.comm.topology`.

    On an :class:`~shoal.elastic.ElasticGroup` hosts and leaders follow each
    quorum, every step is voted (a failed one is dropped), and each global
    sync is a blocking elastic round re-run with the survivors (its result
    still lands ``global_skips // 4`` steps later); newcomers heal from the
    run and then from their host. See :mod:`shoal.strategies.daso_elastic`.

    NaN/Inf (SPEC G5): a host whose averaged gradients are non-finite skips
    that step on all its ranks; a host whose delta is non-finite is left out
    of the leaders' mean and restarts from the agreed parameters when it
    lands. Counted in ``comm_stats().total.nonfinite_skips`` (see docs/daso.md).

    Example::

        daso = shoal.DASO(total_epochs=20, steps_per_epoch=len(loader))
        model, opt = shoal.wrap(model, opt, daso)
        for epoch in range(20):
            for x, y in loader:
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step(); opt.zero_grad()
                daso.report_loss(loss.item())
    """

    name = "daso"

    def __init__(self, total_epochs: int, steps_per_epoch: int, warmup_epochs: int = 4, cooldown_epochs: int = 4,
                 max_global_skips: int = 8, stability_level: float = 0.05,
                 downcast_type: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.config = DASOConfig(total_epochs, steps_per_epoch, warmup_epochs, cooldown_epochs,
                                 max_global_skips, stability_level, downcast_type)
        self.schedule = DASOSchedule(self.config)
        self.levels: HostGroups | None = None
        self._sync: _GlobalSync | None = None
        self.elastic: "ElasticDASO | None" = None
        self._loss_sum = 0.0
        self._loss_count = 0

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        from shoal.comm.elastic import ElasticGroup
        from shoal.parallel import DistributedDataParallel, check_same_model

        self._bind(model, optimizer, group)
        dtype = self.config.downcast_type
        codec: Codec = Identity() if dtype == torch.float32 else Cast(dtype)
        if isinstance(group, ElasticGroup):
            from shoal.strategies.daso_elastic import ElasticDASO

            self.elastic = ElasticDASO(group, model, optimizer, self.params, self.schedule, codec, self._take_losses)
            self.elastic.join()
            self._mark_step()
            return self.elastic.ddp
        check_same_model(group, list(zip(self.names, self.params)))
        broadcast_module(model, group, tag="daso/init")
        self.levels = HostGroups.build(group)
        self._sync = _GlobalSync(self.params, self.levels, codec)
        return DistributedDataParallel(model, process_group=self.levels.local, hierarchical=False)

    def _take_losses(self) -> tuple[float, int]:
        total, count = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = 0.0, 0
        return total, count

    def before_step(self) -> bool | None:
        """On an elastic group: the step's vote (a failed step is dropped on every worker)."""
        return self.elastic.before_step() if self.elastic is not None else None

    def report_loss(self, loss: float | torch.Tensor) -> None:
        """This step's training loss on this rank (the schedule adapts to the world's epoch mean)."""
        self._loss_sum += float(loss)
        self._loss_count += 1

    def after_step(self) -> None:
        if self.elastic is not None:
            self.elastic.after_step()
            self._mark_step()
            return
        if self._sync is None or self.group is None:
            raise ShoalError("DASO is not set up: pass it to shoal.wrap(model, optimizer, strategy) first")
        if (self.schedule.step + 1) % self.config.steps_per_epoch == 0:
            self._share_epoch_loss(self.group)
        launch, land = self.schedule.after_step()
        if launch:
            self._sync.launch()
        if land:
            self._sync.land()
        self._mark_step()

    def _share_epoch_loss(self, group: Group) -> None:
        """World mean of the epoch's reported losses (every rank decides the same schedule)."""
        # On the group's device: an NCCL group cannot reduce a CPU tensor.
        t = torch.tensor([self._loss_sum, float(self._loss_count)], dtype=torch.float64, device=group.device)
        group.all_reduce(t, op="sum", tag="daso/control").wait()
        self._loss_sum, self._loss_count = 0.0, 0
        total, count = t.tolist()   # the one host read, after the collective
        if count > 0:
            self.schedule.record_loss(total / count)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])

    def close(self) -> None:
        """Stop the background thread (epochs end with nothing in flight)."""
        if self._sync is not None:
            self._sync.close()


def expected_global_bytes(numel: int, hosts: int, dtype: torch.dtype) -> int:
    """Bytes a leader sends per global sync (ring all-reduce of the deltas among ``hosts``).

    >>> expected_global_bytes(1000, 2, torch.bfloat16)
    2000
    """
    size = dtype.itemsize
    return math.floor(2 * (hosts - 1) * numel * size / hosts) if hosts > 1 else 0
