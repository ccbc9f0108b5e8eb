"""Model averagers with torch's call pattern: ``average_parameters(params)`` once per step.

:class:`PeriodicModelAverager` and :class:`HierarchicalModelAverager` take the
arguments of ``torch.distributed.algorithms.model_averaging``'s averagers and
average at exactly the same steps, so swapping the import is the migration.
What shoal adds: the mean travels through a codec (exact by default, or fp16,
int8, ... from :mod:`shoal.codecs`), every collective is tagged for the
group's meter, and every parameter that requires grad is averaged (torch skips
parameters whose ``.grad`` is ``None``, which can desynchronise ranks whose
graphs differ and silently averages nothing after ``zero_grad()``), and a
member whose parameters hold a NaN/Inf is left out of the mean instead of
spreading it (:func:`finite_mean`; ``last_left_out`` says how many were).

Example (after ``loss.backward(); opt.step()`` in each step)::

    averager = shoal.PeriodicModelAverager(period=4, warmup_steps=100)
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
        averager.average_parameters(model.parameters())
"""

from __future__ import annotations

import abc
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from shoal.codecs.base import Codec
from shoal.codecs.identity import Identity
from shoal.comm.asks import members_fixed
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.group import Group
from shoal.comm.rules import by_slot
from shoal.errors import ConfigError, ShoalError

_PERIOD_ONE = (
    "all-reducing parameters every step costs no less than all-reducing gradients "
    "(plain DDP, shoal.DistributedDataParallel), which is cheaper and exact"
)


def as_group(process_group: Any) -> Group:
    """A :class:`Group` from ``None`` (the world), a ProcessGroup or a Group."""
    return process_group if isinstance(process_group, Group) else Group(process_group)


def _check_int(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an int, got {value!r} ({type(value).__name__})")


def params_to_average(params: Iterable[Any]) -> list[torch.Tensor]:
    """Parameters (or an optimizer's param groups) that require grad, in order.

    >>> w = torch.nn.Parameter(torch.zeros(2)); b = torch.zeros(1)
    >>> len(params_to_average([{"params": [w, b]}]))
    1
    """
    out: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, Mapping):
            out.extend(q for q in p["params"] if q.requires_grad)
        elif isinstance(p, torch.Tensor):
            if p.requires_grad:
                out.append(p)
        else:
            raise ConfigError(
                f"expected parameters or optimizer param groups (dicts with 'params'), got {type(p).__name__}"
            )
    return out


@dataclass(frozen=True)
class Periodic:
    """When a periodic averager runs: step ``warmup_steps`` and every ``period`` steps after.

    Steps count calls from 0, as torch's ``PeriodicModelAverager`` does.

    >>> [s for s in range(12) if Periodic(period=4, warmup_steps=2).due(s)]
    [2, 6, 10]
    """

    period: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _check_int(self.period, "period")
        _check_int(self.warmup_steps, "warmup_steps")
        if self.period < 1:
            raise ConfigError(f"period must be >= 1 (steps between averagings), got {self.period}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.period == 1:
            warnings.warn(f"period is 1: {_PERIOD_ONE}", UserWarning, stacklevel=3)

    def due(self, step: int) -> bool:
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0


@dataclass(frozen=True)
class Hierarchy:
    """Levels ``(period, group_size)``: groups of each size average every ``period`` steps.

    At a step (counted from 0) at or after ``warmup_steps`` only the level with
    the largest period dividing the step runs (a larger group's mean includes
    the smaller groups'). Groups of size ``k`` are made of ``k`` consecutive
    ranks. The last level must span the whole group (checked by
    :meth:`check_world`).

    >>> h = Hierarchy.from_dict({2: 2, 4: 4, 8: 8})
    >>> [h.level_at(s) for s in range(9)]
    [2, None, 0, None, 1, None, 0, None, 2]
    """

    levels: tuple[tuple[int, int], ...]
    warmup_steps: int = 0

    @staticmethod
    def from_dict(period_group_size: Mapping[int, int], warmup_steps: int = 0) -> "Hierarchy":
        if not isinstance(period_group_size, Mapping):
            raise ConfigError(f"period_group_size_dict must be a mapping {{period: group_size}}, got {type(period_group_size).__name__}")
        return Hierarchy(tuple(period_group_size.items()), warmup_steps)

    def __post_init__(self) -> None:
        if not self.levels:
            raise ConfigError(
                "period_group_size_dict is empty: give at least one level {period: group_size}, "
                "e.g. {4: ranks_per_host, 16: world_size}"
            )
        for period, size in self.levels:
            _check_int(period, "a period")
            _check_int(size, "a group size")
            if size < 1:
                raise ConfigError(f"group sizes must be >= 1, got {size} for period {period}")
        periods = [p for p, _ in self.levels]
        if min(periods) <= 0:
            raise ConfigError(
                f"the smallest period must be positive (steps between averagings), got {min(periods)} in {periods}"
            )
        if periods != sorted(set(periods)):
            raise ConfigError(f"periods must be strictly increasing (one level per period, finest first), got {periods}")
        _check_int(self.warmup_steps, "warmup_steps")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if periods[-1] == 1:
            warnings.warn(f"the largest period is 1: {_PERIOD_ONE}", UserWarning, stacklevel=3)

    def check_world(self, world_size: int) -> None:
        """Raise unless the last level spans ``world_size`` ranks and every size divides it."""
        last = self.levels[-1][1]
        if last != world_size:
            raise ConfigError(
                f"the last group size in period_group_size_dict is {last} but the process group has "
                f"{world_size} ranks: the last (largest-period) level must average over all of them"
            )
        for period, size in self.levels:
            if world_size % size:
                raise ConfigError(
                    f"group size {size} (period {period}) does not divide the {world_size} ranks: "
                    "groups are made of consecutive ranks and must tile the world"
                )

    def level_at(self, step: int) -> int | None:
        """Index of the level that averages after step ``step``, or ``None``."""
        if step < self.warmup_steps:
            return None
        for i in reversed(range(len(self.levels))):
            if step % self.levels[i][0] == 0:
                return i
        return None


def level_groups(group: Group, hierarchy: Hierarchy) -> list[Group]:
    """This rank's group at each level (collective: every rank calls it, same order)."""
    out: list[Group] = []
    for _, size in hierarchy.levels:
        if size == group.size:
            out.append(group)
            continue
        mine = group.split([list(range(s, s + size)) for s in range(0, group.size, size)])
        if mine is None:  # pragma: no cover - the ranges tile the group
            raise ConfigError(f"rank {group.rank} is in no subgroup of size {size}")
        out.append(mine)
    return out


def finite_mean(codec: Codec, tensors: Sequence[torch.Tensor], names: Sequence[str], group: Group, tag: str,
                strict: bool = True) -> int:
    """``codec``'s mean of ``tensors`` over the members whose tensors are all finite; returns how many were left out.

    A member whose tensors hold a NaN/Inf contributes zeros and the mean is
    rescaled by ``size / finite members``, so every member (the one left out
    included) ends with the mean of the finite ones: a NaN never spreads and
    the member that held it is healed. How many members were finite travels
    in a 4-byte all-reduce (tag ``<tag>/finite``) issued before the mean; its
    result is read once, after the mean's collectives. The only other host
    read is this member's own check, before any collective. An average that
    left someone out counts one ``nonfinite_skips`` under ``<tag>/nonfinite``
    on every member (the verdict is the same everywhere) and warns. Raises
    :class:`~shoal.errors.ShoalError` on every member alike when no member is
    finite (training has diverged everywhere: there is nothing to average),
    unless ``strict`` is False: the tensors are then zeros (for a mean of
    deltas: no change) and ``group.size`` is returned.

    Example::

        left_out = finite_mean(Identity(), list(model.parameters()), names, group, "demo/params")
    """
    if not tensors:
        return 0
    bad = read_flag(nonfinite_flag(tensors))
    finite = torch.full((), 0.0 if bad else 1.0, dtype=torch.float32, device=tensors[0].device)
    count = group.all_reduce(finite, op="sum", tag=f"{tag}/finite")
    if bad:
        torch._foreach_zero_(list(tensors))
    codec.mean(tensors, names, group, tag)
    count.wait()
    live = int(round(float(finite.item())))  # the one read after the collectives
    if live == group.size:
        return 0
    if live == 0 and strict:
        raise ShoalError(
            f"every one of the {group.size} members averaging under {tag!r} holds non-finite (NaN/Inf) values: "
            "training has diverged on all of them and there is nothing finite to average; lower the learning "
            "rate or restart from a checkpoint"
        )
    if live > 0:
        torch._foreach_mul_(list(tensors), group.size / live)
    group.meter.add_nonfinite_skip(f"{tag}/nonfinite")
    warnings.warn(f"{group.size - live} of {group.size} members held non-finite (NaN/Inf) values at an average "
                  f"under {tag!r}: left out, every member now holds the mean of the finite ones; counted in "
                  "nonfinite_skips", RuntimeWarning, stacklevel=3)
    return group.size - live


class ModelAverager(abc.ABC):
    """Step counter, codec and the flat mean shared by both averagers."""

    tag = "averager/params"

    def __init__(self, process_group: Any, codec: Codec | None) -> None:
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a shoal.codecs.Codec, got {type(codec).__name__}")
        self.group = as_group(process_group)
        self.codec: Codec = codec if codec is not None else Identity()
        self.step = 0
        self.last_group: Group | None = None  # the group that averaged at the last call, if any
        self.last_left_out = 0  # members left out of the last average for non-finite parameters

    @abc.abstractmethod
    def _group_at(self, step: int) -> tuple[Group, str] | None:
        """The group that averages at ``step`` and its tag, or None."""

    def average_parameters(self, params: Iterable[Any]) -> None:
        """Average ``params`` (a model's parameters or an optimizer's param groups) if due, then count the step."""
        tensors = params_to_average(params)
        self.average_named(tensors, [str(i) for i in range(len(tensors))])

    def average_named(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> Group | None:
        """Like :meth:`average_parameters` with names for the codec's state; returns the group used."""
        due = self._group_at(self.step)
        self.step += 1
        self.last_group = None
        self.last_left_out = 0
        if due is None:
            return None
        group, tag = due
        with torch.no_grad():
            self.last_left_out = finite_mean(self.codec, tensors, names, group, tag)
        self.last_group = group
        return group

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "codec": self.codec.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.codec.load_state_dict(dict(state["codec"]))


class PeriodicModelAverager(ModelAverager):
    """Average parameters every ``period`` steps, starting at step ``warmup_steps``.

    Same arguments and schedule as torch's
    ``model_averaging.averagers.PeriodicModelAverager`` (C1); ``codec`` is
    shoal's addition. Meter tag: ``localsgd/params``.

    Args:
        period: steps between averagings (1 warns: use DDP instead).
        warmup_steps: calls before the first averaging.
        process_group: ``None`` (world), a ProcessGroup or a :class:`shoal.Group`.
        codec: how the mean travels (default exact :class:`~shoal.codecs.Identity`).

    Example::

        averager = shoal.PeriodicModelAverager(period=8, codec=shoal.codecs.Cast())
        opt.step(); averager.average_parameters(opt.param_groups)
    """

    tag = "localsgd/params"

    def __init__(self, period: int, warmup_steps: int = 0, process_group: Any = None,
                 codec: Codec | None = None) -> None:
        self.schedule = Periodic(period, warmup_steps)
        super().__init__(process_group, codec)
        self.period, self.warmup_steps = period, warmup_steps

    def _group_at(self, step: int) -> tuple[Group, str] | None:
        return (self.group, self.tag) if self.schedule.due(step) else None


class HierarchicalModelAverager(ModelAverager):
    """Hierarchical SGD: groups of each size average every ``period`` steps (C3).

    Same arguments and schedule as torch's ``HierarchicalModelAverager``: at a
    step (from 0, once ``step >= warmup_steps``) only the level with the
    largest period dividing the step averages. Subgroups of ``k`` consecutive
    ranks are formed once, here (every rank must construct it). Meter tag:
    ``hierarchical/params/g<size>``.

    Raises :class:`~shoal.errors.ConfigError` for an empty map, a non-positive
    smallest period, a last group size different from the group's size,
    negative ``warmup_steps``; warns when the largest period is 1.

    Example::

        averager = shoal.HierarchicalModelAverager({4: 8, 16: 32}, warmup_steps=100)
        opt.step(); averager.average_parameters(model.parameters())
        print(averager.last_group)   # the group that just averaged, or None
    """

    tag = "hierarchical/params"

    def __init__(self, period_group_size_dict: Mapping[int, int], warmup_steps: int = 0,
                 process_group: Any = None, codec: Codec | None = None) -> None:
        self.hierarchy = Hierarchy.from_dict(period_group_size_dict, warmup_steps)
        super().__init__(process_group, codec)
        self.hierarchy.check_world(self.group.size)
        self.warmup_steps = warmup_steps
        self.groups = level_groups(self.group, self.hierarchy)

    def _group_at(self, step: int) -> tuple[Group, str] | None:
        level = self.hierarchy.level_at(step)
        if level is None:
            return None
        size = self.hierarchy.levels[level][1]
        return self.groups[level], f"{self.tag}/g{size}"


class Levels(ModelAverager):
    """The schedule of :class:`HierarchicalModelAverager` over ``group.subgroup(by_slot(size))`` levels.

    What the strategies :class:`shoal.Hierarchical` and :class:`shoal.PostLocalSGD`
    average over, on any group. Level ``i`` below the last is this worker's
    subgroup of launch slots ``by_slot(size)``: on a static group the groups
    of ``size`` consecutive ranks (checked to tile the group); on an elastic
    group the same groups in each quorum, shrunk by lost workers, rejoined by
    restarted ones (same ``$RANK``, which must then be set). The last level
    is the group itself. Meter tags: ``hierarchical/params/g<size>``.

    Example::

        levels = Levels(Hierarchy.from_dict({2: 4, 8: 16}), group, codec=None)
        group_and_tag = levels._group_at(step)     # None when no level averages at ``step``
    """

    tag = "hierarchical/params"

    def __init__(self, hierarchy: Hierarchy, group: Group, codec: Codec | None, who: str = "Hierarchical") -> None:
        super().__init__(group, codec)
        self.hierarchy = hierarchy
        if members_fixed(self.group):
            hierarchy.check_world(self.group.size)
        else:
            check_slots(hierarchy, who)
        last = len(hierarchy.levels) - 1
        self.groups: list[Any] = [
            self.group if i == last else self.group.subgroup(by_slot(size), f"levels/{i}")
            for i, (_, size) in enumerate(hierarchy.levels)
        ]

    def _group_at(self, step: int) -> tuple[Group, str] | None:
        level = self.hierarchy.level_at(step)
        if level is None:
            return None
        return self.groups[level], f"{self.tag}/g{self.hierarchy.levels[level][1]}"


def check_slots(hierarchy: Hierarchy, who: str) -> None:
    """Level groups on an elastic group are launch slots (``$RANK``): it must be set; the map is
    checked against ``$WORLD_SIZE`` (the launched world) when that is set."""
    check_slot(who)
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit():
        hierarchy.check_world(int(world))


def check_slot(who: str) -> None:
    """Groups by launch slot on an elastic group (``by_slot``) need ``$RANK``: raise unless it is set."""
    slot = os.environ.get("RANK", "")
    nnodes = os.environ.get("SHOAL_SLOTS_INTERLEAVED", "")
    if nnodes:
        raise ConfigError(
            f"{who} on an ElasticGroup places each worker in its level groups by its launch RANK, but this "
            f"elastic run spans {nnodes} machines, whose launchers label workers RANK = i * nnodes + node_rank "
            "(machines may start different numbers of workers at different times), so groups of consecutive "
            "RANKs would mix machines instead of keeping the fast links inside one; run these groups within one "
            "machine (`shoal run --elastic` without --nnodes) or as a static run across machines, or average "
            "over the whole group (no local_group_size, an int period)"
        )
    if not slot.isdigit():
        raise ConfigError(
            f"{who} on an ElasticGroup places each worker in its level groups by its launch RANK "
            f"(stable across restarts), but RANK is {slot!r}; launch with `shoal run --elastic` or set "
            "RANK to the worker's slot 0..N-1"
        )
