"""What a training step needs from membership, on every group: the step interface.

:class:`StepInterface` is a closed protocol that every group implements
by itself (no shared base class, no mixin): :class:`~shoal.comm.Group` with
the trivial static answers (no member can join or leave, a failed collective
raises), :class:`~shoal.membership.elastic.ElasticGroup` with quorums, heals
and votes. Strategies run the same code on static and elastic groups. The
one piece both keep is the registry of state and hooks, :class:`StepHooks`,
which each group holds as a component:

``begin_step()``
    Begin a step (elastic: adopt the latest quorum, heal newcomers, snapshot
    rollback state). Idempotent within a step; hooks registered with
    :meth:`before_begin_step` run first.
``commit() -> bool``
    End it: the same verdict on every member (static: always True). On True
    the :meth:`on_commit` hooks run; on False (elastic only) rollback state is
    restored.
``step``
    How many steps committed (static: counted by ``commit``; elastic: the
    run's count, which a newcomer receives when it heals).
``newcomers``
    Ranks healed in this step's ``begin_step``: they hold a copy of a peer's
    progress, not their own (static: none).
``register_state(name, get, load, rollback=...)``
    State that newcomers receive when they heal and, with ``rollback=True``,
    that a discarded step restores (static: kept, never used).
``error`` / ``report_error(err)``
    This step's first failure (static: always None) / make the step fail on
    every member (static: raises ``err`` at once, as a failed collective does).
``start_state(module, named_params, tag)``
    Give every member the same starting model (static: check that every rank
    built the same model, then broadcast rank 0's; elastic: nothing, the first
    quorum's heal does it).
``traits``
    The few real differences (:class:`~shoal.comm.start.Traits`), read only
    where a feature refuses a kind of group.
``subgroup(rule, name)`` / ``host_groups(name)``
    Subgroups by a partition rule (:mod:`shoal.comm.rules`), and the two
    levels of a host-aware mean, recomputed with each quorum on an elastic
    group.

Example (a step that works on any group)::

    group.register_state("optimizer", opt.state_dict, opt.load_state_dict)
    group.begin_step()
    group.all_reduce(flat_grad, op="avg", tag="grad").wait()
    if group.commit():
        opt.step()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torch import nn

from shoal.comm.rules import MemberInfo
from shoal.comm.start import Traits
from shoal.comm.topology import HostGroups
from shoal.errors import ConfigError, ShoalError


@dataclass
class StateEntry:
    """One registered state: how to read it, load it, and (optionally) heal and snapshot it."""

    get: Callable[[], Any]
    load: Callable[[Any], Any]
    rollback: bool = False
    heal_load: Callable[[Any], Any] | None = None
    snapshot: Callable[[], Any] | None = None


class StepInterface(Protocol):
    """The step interface (see the module docstring); every group implements it."""

    @property
    def traits(self) -> Traits: ...

    @property
    def step(self) -> int: ...

    @property
    def newcomers(self) -> tuple[int, ...]: ...

    @property
    def error(self) -> BaseException | None: ...

    def begin_step(self) -> None: ...

    def commit(self) -> bool: ...

    def report_error(self, err: BaseException) -> None: ...

    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any],
                       rollback: bool = False, heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None: ...

    def start_state(self, module: nn.Module, named_params: list[tuple[str, Any]] | None = None,
                    tag: str = "init", buffers: bool = True) -> None: ...

    def contribution(self) -> tuple[bool, int]: ...

    def shortfall(self) -> float: ...

    def out_ranks(self) -> frozenset[int]: ...

    def register_replay(self, replayer: Any) -> None: ...

    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None: ...


@dataclass
class StepHooks:
    """A group's registry: its registered states, its step hooks and the subgroup names it gave out.

    Each group holds one (``group.hooks``); an elastic group heals and rolls
    back exactly the states registered here.

    Example::

        hooks = StepHooks()
        hooks.register("model", model.state_dict, model.load_state_dict)
        hooks.on_commit.append(lambda: print("committed"))
        hooks.run_on_commit()
    """

    states: dict[str, StateEntry] = field(default_factory=dict)
    on_commit: list[Callable[[], None]] = field(default_factory=list)
    before_begin: list[Callable[[], None]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)        # subgroup and level names taken
    infos: list[MemberInfo] | None = None                # static members' slots and hosts (gathered once)

    def register(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any], rollback: bool = False,
                 heal_load: Callable[[Any], Any] | None = None, snapshot: Callable[[], Any] | None = None) -> None:
        """Add a state (``register_state`` of a group documents the arguments); a key twice: ConfigError."""
        if key in self.states:
            raise ConfigError(f"state {key!r} is already registered on this group")
        self.states[key] = StateEntry(get, load, rollback, heal_load, snapshot)

    def run_before_begin(self) -> None:
        """Call the ``before_begin_step`` hooks, in registration order."""
        for fn in list(self.before_begin):
            fn()

    def run_on_commit(self) -> None:
        """Call the ``on_commit`` hooks, in registration order."""
        for fn in list(self.on_commit):
            fn()

    def unique_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``... if taken (every worker asks in the same order)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"subgroup name must be a non-empty string, got {name!r}")
        base, n = name, 1
        while name in self.names:
            n += 1
            name = f"{base}-{n}"
        self.names.add(name)
        return name


class Outside:
    """What ``Group.subgroup`` returns to a worker that the rule leaves out (``member`` is False).

    Anything but ``member`` raises: a worker outside a subgroup must check
    ``.member`` before using it.
    """

    member = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):   # copy/pickle probes
            raise AttributeError(attr)
        name = self.__dict__.get("name", "?")
        raise NotAMemberError(f"this worker is not a member of subgroup {name!r}: check .member before "
                              f"using it (asked for .{attr})")


class NotAMemberError(ShoalError, AttributeError):
    """Raised by an :class:`Outside` subgroup; an AttributeError too, so ``getattr(x, name, default)``,
    ``hasattr`` and ``copy`` treat its attributes as absent."""


class Levels(Protocol):
    """What ``host_groups`` returns: this step's two levels of a host-aware mean."""

    def current(self) -> HostGroups:
        """This step's layout and subgroups."""
        ...


class StaticLevels:
    """The two levels of a host-aware mean on a static group: built once, the same every step."""

    def __init__(self, levels: HostGroups) -> None:
        self.levels = levels

    def current(self) -> HostGroups:
        """This step's layout and subgroups (always the same on a static group)."""
        return self.levels
