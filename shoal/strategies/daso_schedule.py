"""DASO's configuration, its schedule (when a global synchronisation runs, how many batches it may lag), and the layouts it accepts.

Split from :mod:`shoal.strategies.daso` (the strategy, its rounds and the
global averaging), which re-exports both. Pure bookkeeping: no collective.

Example::

    sched = DASOSchedule(DASOConfig(total_epochs=10, steps_per_epoch=100))
    launch, land = sched.after_step()   # after each optimizer step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from shoal.comm.rules import MemberInfo, by_host
from shoal.errors import ConfigError

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


def check_hosts(members: Sequence[MemberInfo]) -> None:
    """Refuse a layout in which some host, among several, has a single worker.

    Between two global syncs DASO's hosts train on their own, each on the
    exact average of its workers' gradients; a host of one worker takes
    single-worker steps instead, whose noise the next global average has to
    undo. On the ``lm`` bench task with 4 hosts x 1 worker (AdamW, 8 windows
    a worker), each replica's validation loss rose 0.1-0.3 above the average
    of the replicas within the 2-8 unsynchronised steps (docs/daso.md): DASO
    then trails plain local SGD. One host (everything is DDP) is accepted.

    >>> check_hosts([MemberInfo(0, "a"), MemberInfo(1, "a"), MemberInfo(2, "b"), MemberInfo(3, "b")])
    >>> check_hosts([MemberInfo(0, "a"), MemberInfo(1, "b")])
    Traceback (most recent call last):
    ...
    shoal.errors.ConfigError: DASO needs at least 2 workers on every host ...
    """
    hosts = by_host(members)
    lone = [m for h in hosts if len(h) == 1 for m in h]
    if len(hosts) > 1 and lone:
        raise ConfigError(
            f"DASO needs at least 2 workers on every host (it averages gradients exactly inside a host every "
            f"step and only syncs between hosts every few steps); got {len(hosts)} hosts with "
            f"{sorted(len(h) for h in hosts)} workers, rank(s) {lone} alone on their host. Launch several "
            "workers per host (--procs-per-host / --nproc-per-node), or use shoal.LocalSGD or shoal.DiLoCo "
            "for one worker per host. Hosts come from SHOAL_HOST_ID, else the hostname."
        )
