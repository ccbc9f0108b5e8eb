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
from shoal.errors import ConfigError, ShoalError
from shoal.steps import open_step
from shoal.strategies.rounds import FailurePolicy, run_round

__all__ = [
    "ElasticGroup", "ElasticOptimizer", "ElasticSampler", "ElasticStats", "Timeouts", "Quorum",
    "Coordinator", "BackendSpec", "gloo_backend", "FailurePolicy", "run_round", "shard", "global_share",
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
    seeded identically everywhere). A step takes the next indices of the
    stream for the workers whose data counts in it (its *contributors*: every
    worker, except joiners still catching up in the background, whose
    gradients count zero); the contributor of order ``i`` among them (by rank)
    gets the ``i``-th slice. A joiner catching up gets the slice after them
    (samples the next step reads again), so no sample is skipped on its
    account. The stream's cursor advances only when a step commits, so a
    discarded step's samples are read again, and it is healed into
    newcomers, so nobody restarts the epoch.

    Two ways to size a step (give exactly one):

    - ``batch_size``: samples per worker per step; the global batch shrinks
      when a worker dies (and while a joiner catches up) and grows back.
    - ``global_batch``: samples per step over the whole run; each contributor
      takes ``ceil(global_batch / contributors)`` (:func:`global_share`), so
      the survivors of a kill take over its share and the step's global batch
      stays ``global_batch`` (rounded up to a multiple of the contributors:
      equal shares keep the gradient mean exact). For loops bound by a slow
      network, where the extra samples cost little; a step's sample count is
      :attr:`last_global` after :meth:`next_batch`.

    A joiner catching up reads a contributor's share by default, to train on
    and throw away: its step then has the shape of every other (a compiled
    model or a CUDA graph sees one batch size). ``joiner_batch=n`` gives it
    at most ``n`` samples instead (the first of that slice): its forward and
    backward still run, so it takes part in every gradient all-reduce, but it
    computes ``n`` samples a step, not a full share, for as long as its
    download lasts. Where workers share a machine's processors (several
    workers a host, or an emulated cluster) that compute is the other
    workers', and after a kill, when the survivors take over the dead
    worker's share, it is theirs to lose. Give at least 2 with BatchNorm in
    training mode (a batch of one has no variance).

    Args:
        num_samples: length of the dataset.
        group: the elastic group.
        batch_size: samples per worker per step.
        seed: permutation seed (the same on every worker).
        shuffle: False reads the dataset in order.
        global_batch: samples per step over all contributors (instead of ``batch_size``).
        joiner_batch: at most this many samples a step for a joiner catching up (None: a contributor's share).

    Example::

        data = ElasticSampler(len(ds), group, batch_size=32)
        idx = data.next_batch()           # list of 32 indices for this worker
        data = ElasticSampler(len(ds), group, global_batch=128)
        idx = data.next_batch()           # 32 of 4 workers, 43 of 3 survivors
        data = ElasticSampler(len(ds), group, global_batch=128, joiner_batch=2)
        idx = data.next_batch()           # 2 indices while this worker catches up, then its share
    """

    def __init__(self, num_samples: int, group: Group | ElasticGroup, batch_size: int | None = None, seed: int = 0,
                 shuffle: bool = True, key: str = "sampler", *, global_batch: int | None = None,
                 joiner_batch: int | None = None) -> None:
        if (batch_size is None) == (global_batch is None):
            raise ConfigError("ElasticSampler takes exactly one of batch_size (samples per worker per step) and "
                              f"global_batch (samples per step over all workers), got batch_size={batch_size!r}, "
                              f"global_batch={global_batch!r}")
        sized = ("batch_size", batch_size) if batch_size is not None else ("global_batch", global_batch)
        for name, v in (("num_samples", num_samples), sized):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        _check_joiner_batch(joiner_batch)
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.global_batch, self.joiner_batch = global_batch, joiner_batch
        self.group = group
        self.cursor = 0          # position in the run's index stream of the next step
        self.last_global = 0     # samples the current step's contributors read (after next_batch)
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
        order, contributors = _contributor_order(self.group)
        if self.global_batch is not None:
            per = _per_contributor(self.global_batch, contributors)
        else:
            assert self.batch_size is not None   # __init__ took exactly one of the two
            per = self.batch_size
        self._pending = self.last_global = contributors * per
        start = self.cursor + order * per   # a joiner catching up (order == contributors): read again next step
        n = _joiner_share(per, self.joiner_batch) if order == contributors else per
        return [self._index(p) for p in range(start, start + n)]

    def _index(self, pos: int) -> int:
        epoch, off = divmod(pos, self.num_samples)
        if not self.shuffle:
            return off
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g, device="cpu"))   # host indices
        return int(self._perm[1][off])


def _contributor_order(group: Group | Any) -> tuple[int, int]:
    """(this worker's order among the step's contributors, or their count if it is not one; their count)."""
    out = group.out_ranks()
    contributors = group.size - len(out)
    if contributors < 1:
        raise ShoalError(f"no member of this step's quorum contributes (size {group.size}, catching up: "
                         f"{sorted(out)}): the group's catch-up state is inconsistent")
    if group.rank in out:
        return contributors, contributors
    return group.rank - sum(1 for r in out if r < group.rank), contributors


def _per_contributor(global_batch: int, contributors: int) -> int:
    return -(-global_batch // contributors)   # ceil: equal shares, so the gradient mean stays exact


def _check_joiner_batch(joiner_batch: int | None) -> None:
    if joiner_batch is not None and (isinstance(joiner_batch, bool) or not isinstance(joiner_batch, int)
                                     or joiner_batch < 1):
        raise ConfigError(f"joiner_batch must be an integer >= 1 or None (a contributor's share), got {joiner_batch!r}")


def _joiner_share(per: int, joiner_batch: int | None) -> int:
    """The samples a joiner catching up reads: a contributor's share, or at most ``joiner_batch``."""
    return per if joiner_batch is None else min(per, joiner_batch)


def global_share(group: Group | Any, global_batch: int, joiner_batch: int | None = None) -> int:
    """Samples this worker takes in the current step so that the step's contributors together take
    ``global_batch``: ``ceil(global_batch / contributors)``, the same on every member (a joiner catching up,
    whose gradients count zero, gets the same number, to train on and throw away, or at most
    ``joiner_batch``: see :class:`ElasticSampler`).

    It starts the step first (:func:`~shoal.steps.open_step`: adopts the latest quorum, as the first
    forward of shoal's DDP would; in a step already begun it stays in it), since the share depends on who
    is in it. :class:`ElasticSampler` with ``global_batch`` does the same and also picks the indices. For
    loops that draw their own samples::

        n = global_share(group, 128)         # 32 of 4 workers, 43 of 3 survivors
        loss_fn(model(*draw(n))).backward()
        opt.step()
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    _check_joiner_batch(joiner_batch)
    open_step(group)
    order, contributors = _contributor_order(group)
    per = _per_contributor(global_batch, contributors)
    return _joiner_share(per, joiner_batch) if order == contributors else per


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


