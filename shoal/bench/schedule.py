"""The inner learning-rate schedule of ``shoal bench``: the same for every strategy.

The schedule is a function of the global step count only (step *t* means the
same samples for every strategy, :mod:`shoal.bench.data`), so at equal samples
every strategy trains with the same learning rate at every step: DDP's
baseline included, or the comparison would flatter whichever strategy got the
better schedule. The worker (:mod:`shoal.bench.worker`) sets it on every
optimizer the bench's optimizer factory built for the strategy (DiLoCo's
inner AdamW, collaborative training's, ZeRO's) and on the optimizer the
strategy hands back (ZeRO's, which copies its groups into its shards' at the
start of each step), before each step's forward. Optimizers a strategy builds
for itself (DiLoCo's outer SGD) keep their own learning rate.

* ``constant``: the base learning rate at every step (the bench's default).
* ``cosine``: linear warm-up from ``lr / warmup_steps`` to ``lr`` over the
  first ``warmup_steps`` steps, then a half cosine from ``lr`` down to
  ``final_ratio * lr`` at the last step (``total_steps - 1``).

Example:
    >>> s = LRSchedule("cosine", total_steps=100, warmup_steps=5, final_ratio=0.1)
    >>> [round(s.factor(t), 3) for t in (0, 4, 5, 99)]
    [0.2, 1.0, 1.0, 0.1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from shoal.errors import ConfigError

KINDS = ("constant", "cosine")
DEFAULT_WARMUP_FRACTION = 0.05   # --warmup-steps default: 5 % of the run's steps
DEFAULT_FINAL_RATIO = 0.1        # cosine decays to 10 % of the base learning rate


def default_warmup(total_steps: int) -> int:
    """The default warm-up: 5 % of ``total_steps`` (at least one step).

    Example:
        >>> default_warmup(1000), default_warmup(10)
        (50, 1)
    """
    return max(1, round(DEFAULT_WARMUP_FRACTION * total_steps))


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate multiplier per global step (see the module docstring).

    ``total_steps`` is the schedule's horizon (the run's step count); a
    cosine schedule needs it, and past it the factor stays at ``final_ratio``
    (a time-budgeted run that outlives its horizon). ``warmup_steps`` must
    leave at least one step of decay.

    Example:
        >>> LRSchedule().factor(12345)
        1.0
    """

    kind: str = "constant"
    total_steps: int | None = None
    warmup_steps: int = 0
    final_ratio: float = DEFAULT_FINAL_RATIO

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"lr schedule must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.final_ratio, (int, float)) or not 0 <= self.final_ratio <= 1:
            raise ConfigError(f"the final lr ratio must be in [0, 1], got {self.final_ratio!r}")
        if self.kind == "constant":
            if self.warmup_steps:
                raise ConfigError("warm-up steps need --lr-schedule cosine (the constant schedule has none)")
            return
        if self.total_steps is None:
            raise ConfigError("a cosine lr schedule needs the run's step count (--steps): it decays over it")
        if self.total_steps < 1:
            raise ConfigError(f"the schedule's step count must be >= 1, got {self.total_steps}")
        if self.warmup_steps >= self.total_steps:
            raise ConfigError(f"warmup steps ({self.warmup_steps}) must be fewer than the run's "
                              f"{self.total_steps} steps: the cosine decay needs at least one step")

    def factor(self, step: int) -> float:
        """The multiplier of the base learning rate for the step after ``step`` steps done (0-based)."""
        if self.kind == "constant":
            return 1.0
        assert self.total_steps is not None   # checked in __post_init__
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = self.total_steps - 1 - self.warmup_steps
        progress = 1.0 if span <= 0 else min(1.0, (step - self.warmup_steps) / span)
        return self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class ScheduledLR:
    """Sets ``base_lr * schedule.factor(step)`` on every group of the optimizers it was given.

    :meth:`track` wraps the bench's optimizer factory so that every optimizer
    a strategy builds through it is scheduled; :meth:`add` adds the optimizer a
    strategy hands back (a no-op if it is one of those, or has no groups).

    Example:
        >>> import torch.nn as nn
        >>> sched = ScheduledLR(LRSchedule("cosine", total_steps=10, warmup_steps=2), base_lr=1.0)
        >>> make = sched.track(lambda ps: torch.optim.SGD(ps, lr=1.0))
        >>> opt = make(nn.Linear(2, 1).parameters())
        >>> sched.apply(0), opt.param_groups[0]["lr"]
        (0.5, 0.5)
    """

    def __init__(self, schedule: LRSchedule, base_lr: float) -> None:
        self.schedule, self.base_lr = schedule, base_lr
        self.optimizers: list[Any] = []

    def add(self, optimizer: Any) -> None:
        if getattr(optimizer, "param_groups", None) is not None and all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    def track(self, factory: Any) -> Any:
        def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
            opt = factory(params)
            self.add(opt)
            return opt
        return make

    def apply(self, step: int) -> float:
        """Set the learning rate of the step after ``step`` steps done; return it."""
        lr = self.base_lr * self.schedule.factor(step)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        return lr
