"""What a training step needs from membership, on every group: the step interface.

Every :class:`~shoal.comm.Group` has it. On a static group it is trivial (no
member can join or leave, a failed collective raises), so strategies run the
same code on static and elastic groups, and only
:class:`~shoal.membership.elastic.ElasticGroup` gives it weight:

``begin_step()``
    Begin a step (elastic: adopt the latest quorum, heal newcomers, snapshot
    rollback state). Idempotent within a step; hooks registered with
    :meth:`before_begin_step` run first.
``commit() -> bool``
    End it: the same verdict on every member (static: always True). On True
    the :meth:`on_commit` hooks run; on False (elastic only) rollback state is
    restored.
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
from typing import TYPE_CHECKING, Any, Callable, Protocol

from torch import nn

from shoal.comm.rules import MemberInfo, Partition
from shoal.comm.start import STATIC, Traits, broadcast_module, check_same_model
from shoal.comm.topology import HostGroups, discover
from shoal.errors import ConfigError, ShoalError

if TYPE_CHECKING:
    from shoal.comm.group import Group


@dataclass
class StateEntry:
    """One registered state: how to read it, load it, and (optionally) heal and snapshot it."""

    get: Callable[[], Any]
    load: Callable[[Any], Any]
    rollback: bool = False
    heal_load: Callable[[Any], Any] | None = None
    snapshot: Callable[[], Any] | None = None


@dataclass
class _Hooks:
    states: dict[str, StateEntry] = field(default_factory=dict)
    on_commit: list[Callable[[], None]] = field(default_factory=list)
    before_begin: list[Callable[[], None]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)        # subgroup and level names taken
    infos: list[MemberInfo] | None = None                # static members' slots and hosts (gathered once)


class Outside:
    """What :meth:`Stepping.subgroup` returns to a worker that the rule leaves out (``member`` is False).

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
    """What :meth:`Stepping.host_groups` returns: this step's two levels of a host-aware mean."""

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


class Stepping:
    """The step interface with its static implementation (see the module docstring).

    :class:`~shoal.comm.Group` inherits it; :class:`~shoal.membership.elastic.ElasticGroup`
    overrides what membership changes.
    """

    elastic = False       # True on groups whose members change between steps
    traits: Traits = STATIC
    newcomers: tuple[int, ...] = ()
    rank: int
    size: int

    def _hooks(self) -> _Hooks:
        hooks = self.__dict__.get("_step_hooks")
        if hooks is None:
            hooks = self.__dict__["_step_hooks"] = _Hooks()
        return hooks

    @property
    def member(self) -> bool:
        """Whether this worker belongs to this group (False only for a subgroup whose rule leaves it out)."""
        return True

    # --- the step -------------------------------------------------------------
    def begin_step(self) -> None:
        """Begin a step (see the module docstring); on a static group only the hooks run."""
        for fn in list(self._hooks().before_begin):
            fn()

    def commit(self) -> bool:
        """End the step; True on every member of a static group (the hooks of :meth:`on_commit` run)."""
        for fn in list(self._hooks().on_commit):
            fn()
        return True

    @property
    def quorum_pending(self) -> bool:
        """Whether the next :meth:`begin_step` adopts a new membership (never, on a static group)."""
        return False

    @property
    def error(self) -> BaseException | None:
        """This step's first failure; always None on a static group (a failed collective raises there)."""
        return None

    def report_error(self, err: BaseException) -> None:
        """Make this step fail on every member; a static group cannot vote, so ``err`` is raised at once."""
        raise err

    def start_state(self, module: nn.Module, named_params: list[tuple[str, Any]] | None = None,
                    tag: str = "init", buffers: bool = True) -> None:
        """Give every member rank 0's model (collective): check that every rank built the same model, then broadcast.

        ``named_params`` (default: the module's parameters that require grad)
        are the ones compared; ``buffers=False`` broadcasts parameters only
        (torch DDP's ``broadcast_buffers=False`` at start). An elastic group does nothing here: it has no
        members yet, and its first quorum's heal gives newcomers the state.

        Example::

            group.start_state(model, tag="mystrategy/init")
        """
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad] \
            if named_params is None else named_params
        check_same_model(self._as_group(), named)
        broadcast_module(module, self._as_group(), tag=tag, buffers=buffers)

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every committed step (e.g. to advance a data cursor)."""
        self._hooks().on_commit.append(fn)

    def before_begin_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the top of every :meth:`begin_step` (e.g. to end a lazily ended step)."""
        self._hooks().before_begin.append(fn)

    # --- state -------------------------------------------------------------------
    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any],
                       rollback: bool = False, heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None:
        """Add state that newcomers receive when they heal (and, with ``rollback``, that a discard restores).

        ``get()`` returns something ``torch.save`` can write; ``load(x)``
        restores it. With ``rollback=True`` it is also snapshotted at each
        step start and restored when the step is discarded (e.g. a codec's
        error feedback, which a failed step may have half-updated); then
        ``get()`` must return a copy, not views of live tensors (codecs'
        ``state_dict()`` do), because it is called every step and copying
        it again would double the cost.
        ``heal_load(x)``, if given, replaces ``load`` when the state comes
        from a peer rather than from a rollback snapshot: state that is the
        peer's own and must not be copied (an error-feedback residual, see
        :meth:`shoal.codecs.Codec.newcomer_state`) is dropped there.
        ``snapshot()``, if given, replaces ``get`` for the per-step rollback
        snapshot: something cheaper that ``load`` accepts and that stays valid
        through one step (a codec's :meth:`~shoal.codecs.Codec.rollback_state`
        holds its tensors by reference and never overwrites them in place).
        Every member must register the same keys (a key twice: ConfigError).
        On a static group nothing heals and nothing is discarded: the
        registration is checked and kept, never used. This is the group's one
        registry: an elastic group heals and rolls back exactly these states.
        """
        states = self._hooks().states
        if key in states:
            raise ConfigError(f"state {key!r} is already registered on this group")
        states[key] = StateEntry(get, load, rollback, heal_load, snapshot)

    # --- structure -----------------------------------------------------------------
    def unique_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``... if taken on this group (every worker asks in the same order)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"subgroup name must be a non-empty string, got {name!r}")
        taken, base, n = self._hooks().names, name, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        return name

    def member_infos(self) -> list[MemberInfo]:
        """Every member's slot (its rank here) and host identity, by rank (collective the first time)."""
        hooks = self._hooks()
        if hooks.infos is None:
            topo = discover(self._as_group())
            hosts = {r: i for i, h in enumerate(topo.hosts) for r in h}
            hooks.infos = [MemberInfo(r, f"host-{hosts[r]}") for r in range(self.size)]
        return hooks.infos

    def subgroup(self, rule: Partition, name: str) -> "Group | Outside":
        """This worker's subgroup under ``rule`` (collective: every member calls it, in the same order).

        On a static group the rule is applied once; a worker that the rule
        leaves out gets an :class:`Outside` (``member`` False).
        """
        name = self.unique_name(name)
        parts = rule(self.member_infos())
        mine = self._as_group().split(parts)
        return mine if mine is not None else Outside(name)

    def host_groups(self, name: str) -> Levels:
        """The subgroups of a two-level mean (``.current()`` -> :class:`~shoal.comm.topology.HostGroups`)."""
        self.unique_name(name)
        return StaticLevels(HostGroups.build(self._as_group()))

    def _as_group(self) -> "Group":
        return self  # type: ignore[return-value]
