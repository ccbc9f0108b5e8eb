"""Elastic training: workers die, join and leave while training goes on.

The training loop stays a plain torch loop; shoal needs to know only where a
step ends, which the optimizer wrapper tells it::

    import shoal, torch
    from shoal.elastic import ElasticGroup, ElasticOptimizer, ElasticSampler

    group = ElasticGroup()                  # joins the run started by `shoal run --elastic` (its token: $SHOAL_TOKEN)
    model = shoal.DistributedDataParallel(net, process_group=group)
    opt = ElasticOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group)
    data = ElasticSampler(len(dataset), group, batch_size=32)
    while group.step < 1000:
        x, y = dataset[data.next_batch()]   # this worker's share of the step's global batch
        opt.zero_grad()
        loss_fn(model(x), y).backward()     # gradients averaged over the live workers
        opt.step()                           # applied, or dropped on every worker alike

Where things happen: the first forward of a step adopts the latest quorum
(rebuilds the group, heals newcomers); ``opt.step()`` votes and then steps or
skips. Averages divide by the number of workers in the step's quorum.
See docs/elastic.md for timeouts, sharding and tuning.

Strategies other than DDP plug in through :func:`run_round` and a
:class:`FailurePolicy`: a round is ``begin_step(); fn(); commit()``.
:class:`ElasticOptimizer` and :class:`ElasticSampler` take any
:class:`~shoal.comm.Group` (on a static one every step commits), so the same
script runs with or without elasticity.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shoal.comm.asks import members_fixed
from shoal.comm.group import Group
from shoal.membership.catchup import OptimizerReplay
from shoal.membership.elastic import BackendSpec, ElasticGroup, ElasticStats, gloo_backend
from shoal.membership.coordinator import Coordinator, Quorum, Timeouts
from shoal.errors import ConfigError
from shoal.steps import open_step
from shoal.strategies.rounds import FailurePolicy, run_round

__all__ = [
    "ElasticGroup", "ElasticOptimizer", "ElasticSampler", "ElasticStats", "Timeouts", "Quorum",
    "Coordinator", "BackendSpec", "gloo_backend", "FailurePolicy", "run_round", "shard",
]


class ElasticOptimizer:
    """Wraps a torch optimizer so that ``step()`` ends an elastic step.

    ``step()`` asks the group for the step's verdict; it runs the inner
    optimizer only on commit and returns whether it did. On a discard the
    gradients are cleared and nothing changes (learning-rate schedulers should
    step only when it returns True). The optimizer's state is registered with
    the group, so newcomers receive it when they heal.

    Example::

        opt = ElasticOptimizer(torch.optim.AdamW(model.parameters()), group)
        if opt.step():
            sched.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Group | ElasticGroup, key: str = "optimizer") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(group, Group):
            raise ConfigError(f"group must be a shoal Group (e.g. an ElasticGroup), got {type(group).__name__}")
        self.optimizer = optimizer
        self.group = group
        name = group.unique_name(key)
        group.register_state(name, optimizer.state_dict, optimizer.load_state_dict)
        group.register_replay(OptimizerReplay(optimizer, name))   # elastic: a background heal replays steps

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """End the step: run the inner optimizer if it commits (always, on a static group); its verdict."""
        if run_round(self.group):
            self.optimizer.step(closure)
            return True
        self.optimizer.zero_grad(set_to_none=True)
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class ElasticSampler:
    """Hands each worker its share of every step's global batch, following membership.

    The run reads one stream of sample indices (a fresh permutation per epoch,
    seeded identically everywhere). A step of a quorum of ``size`` workers
    takes the next ``size * batch_size`` indices; the worker of rank ``r``
    gets the ``r``-th slice. The stream's cursor advances only when a step
    commits, so a discarded step's samples are read again, and it is healed
    into newcomers, so nobody restarts the epoch.

    Args:
        num_samples: length of the dataset.
        group: the elastic group.
        batch_size: samples per worker per step.
        seed: permutation seed (the same on every worker).
        shuffle: False reads the dataset in order.

    Example::

        data = ElasticSampler(len(ds), group, batch_size=32)
        idx = data.next_batch()           # list of 32 indices for this worker
    """

    def __init__(self, num_samples: int, group: Group | ElasticGroup, batch_size: int, seed: int = 0,
                 shuffle: bool = True, key: str = "sampler") -> None:
        for name, v in (("num_samples", num_samples), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.group = group
        self.cursor = 0          # position in the run's index stream of the next step
        self._pending = 0
        self._perm: tuple[int, torch.Tensor] | None = None
        group.register_state(group.unique_name(key), lambda: {"cursor": self.cursor}, self._load)
        group.on_commit(self._advance)

    def _load(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])

    def _advance(self) -> None:
        self.cursor += self._pending
        self._pending = 0

    def epoch(self) -> int:
        return self.cursor // self.num_samples

    def next_batch(self) -> list[int]:
        """This worker's indices for the current step (starts the step: may rebuild and heal)."""
        if self._pending and members_fixed(self.group):
            self._advance()   # a static group's step always commits, whether or not anything voted it
        open_step(self.group)   # no round: the step's quorum gives the slice; the optimizer votes it
        self._pending = self.group.size * self.batch_size
        start = self.cursor + self.group.rank * self.batch_size
        return [self._index(p) for p in range(start, start + self.batch_size)]

    def _index(self, pos: int) -> int:
        epoch, off = divmod(pos, self.num_samples)
        if not self.shuffle:
            return off
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g, device="cpu"))   # host indices
        return int(self._perm[1][off])


def shard(num_samples: int, group: Group | Any) -> range:
    """The indices ``rank, rank + size, ...`` of the group's current quorum.

    For epoch-based loops: call it at each epoch's start (after
    ``group.begin_step()``) to split the epoch over whoever is there now.
    Workers that arrive mid-epoch wait for the next split; prefer
    :class:`ElasticSampler` when membership changes often.

    >>> class G: rank, size = 1, 3
    >>> list(shard(10, G()))
    [1, 4, 7]
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise ConfigError(f"num_samples must be an integer >= 0, got {num_samples!r}")
    return range(group.rank, num_samples, group.size)


