"""Subgroups of an :class:`~shoal.membership.elastic.ElasticGroup`, rebuilt with every quorum.

An elastic group cannot be :meth:`~shoal.comm.group.Group.split` once: its
members change from one quorum to the next. An :class:`ElasticSubgroup` is a
*view* over the parent's quorums instead: a *rule* ("the members of my
host", "one leader per host", "the members whose launch ``RANK`` divided by
4 equals mine"), applied to each quorum as it is adopted. It stays the same Python object (a DDP built over it
keeps working), while under it:

- the layout is recomputed from the quorum's members and their join records
  (each member publishes its host identity and launch ``RANK`` when it
  joins), with no collective: every member computes the same partition;
- its own gloo group is built under ``<quorum prefix>sub/<name>/<index>/``
  at its first collective in that quorum, through a
  :class:`~shoal.membership.rendezvous.Rendezvous` over its members (a store
  barrier, then the parent's backend factory on a helper thread, so fault
  plans apply to it too; each gives up at the parent's abort flag, a
  subgroup member's stopped heartbeat, this step's failure or its own
  ``Timeouts.op``; not at a newer quorum, which the step's verdict names
  and the next step adopts);
- failures are the parent's: a collective of the subgroup that fails records
  the error on the parent and raises its abort flag, so the whole step fails
  on every member of the quorum, and the parent's vote discards it; the
  subgroup's process group is abandoned together with the parent's.

The step interface (``begin_step``, ``commit``, ``register_state``,
``on_commit``, ``quorum_pending``) is the parent's; :attr:`ElasticSubgroup.newcomers`
lists the *subgroup* ranks healed in this step. The collectives and their
failure handling are those of :mod:`shoal.membership.transport`, over the
subgroup's own process group and the parent's :class:`~shoal.membership.transport.Link`
(its failures and backend factory; it lets go of abandoned groups), which the view shares.

Example::

    group = ElasticGroup()
    host = group.subgroup(by_host, "host")              # this worker's host, in every quorum
    leaders = group.subgroup(host_leaders, "leaders")   # (or ElasticSubgroup(group, "leaders", host_leaders))
    group.begin_step()
    host.all_reduce(grad, op="avg", tag="grad/intra").wait()
    if leaders.member:
        leaders.all_reduce(delta, op="avg", tag="delta/inter").wait()
    group.commit()
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol, Sequence, cast

from shoal.membership.transport import ElasticCollectives, ElasticStats, Link
from shoal.comm.group import Group
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, Timeouts
from shoal.membership.rendezvous import Circle, Rendezvous
from shoal.comm.meter import Meter
from shoal.comm.rules import MemberInfo, Partition, by_host, by_slot, host_leaders, whole_quorum
from shoal.comm.topology import HostGroups, Topology
from shoal.errors import ConfigError, PeerLostError, ShoalError

__all__ = ["ElasticSubgroup", "ElasticHostGroups", "member_infos", "MemberInfo", "Partition", "by_host",
           "host_leaders", "whole_quorum", "by_slot"]


class QuorumParent(Protocol):
    """What a subgroup view reads from its parent, an :class:`~shoal.membership.elastic.ElasticGroup`."""

    link: Link
    meter: Meter
    timeout: float | None
    quorum: Quorum | None
    step: int
    stats: ElasticStats
    newcomers: tuple[int, ...]

    @property
    def rank(self) -> int: ...
    @property
    def quorum_pending(self) -> bool: ...
    def begin_step(self) -> None: ...
    def commit(self) -> bool: ...
    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any], rollback: bool = False,
                       heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None: ...
    def on_commit(self, fn: Callable[[], None]) -> None: ...
    def before_begin_step(self, fn: Callable[[], None]) -> None: ...
    def unique_name(self, name: str) -> str: ...
    def leave(self, finished: bool | None = None) -> None: ...
    @property
    def size(self) -> int: ...
    def contribution(self) -> tuple[bool, int]: ...
    def shortfall(self) -> float: ...
    def out_ranks(self) -> frozenset[int]: ...
    def register_replay(self, replayer: Any) -> None: ...
    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None: ...
    def watch_peers(self) -> None: ...
    def renew_if_dissolved(self) -> bool: ...


def member_infos(client: MemberClient, q: Quorum) -> list[MemberInfo]:
    """The quorum's members' join records, by quorum rank (one store read, no collective)."""
    out = []
    for m, found in zip(q.members, client.join_infos(q.members)):
        info = found or {}    # a record that does not verify counts as none (see MemberClient.join_infos)
        rank = str(info.get("rank", ""))
        out.append(MemberInfo(int(rank) if rank.isdigit() else None, str(info.get("host") or f"member-{m}")))
    return out


class ElasticSubgroup(ElasticCollectives):
    """One subgroup of an elastic group per quorum, by a :data:`Partition` rule (see the module docstring).

    Args:
        parent: the elastic group.
        name: unique among the parent's subgroups (names the store prefix).
        partition: the rule, e.g. :func:`by_host`, :func:`host_leaders`, ``by_slot(4)``.

    :attr:`member` is False when this worker is in none of the quorum's
    groups (e.g. a non-leader for :func:`host_leaders`); collectives then raise.
    """

    def __init__(self, parent: QuorumParent, name: str, partition: Partition) -> None:
        if isinstance(parent, ElasticSubgroup) or not isinstance(parent, ElasticCollectives):
            raise ConfigError(f"parent must be a shoal ElasticGroup, got {type(parent).__name__}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"subgroup name must be a non-empty string, got {name!r}")
        super().__init__(parent.link, parent.meter, parent.timeout)
        self.parent, self.name, self.partition = parent, name, partition
        self.pg: Any = None
        self._qid = -1              # quorum whose layout is current
        self._pg_qid = -1           # quorum whose subgroup self.pg is
        self._dropped = -1          # quorum whose subgroup was abandoned (never rebuilt)
        self._ranks: tuple[int, ...] = (0,)
        self._index = 0
        self._member = True
        self._connect_lock = threading.Lock()
        self.link.on_abandon.append(self._drop)

    # --- the parent's -------------------------------------------------------------
    @property
    def quorum(self) -> Quorum | None:
        """The parent's quorum."""
        return self.parent.quorum

    @property
    def step(self) -> int:
        """The parent's committed step."""
        return self.parent.step

    @property
    def stats(self) -> ElasticStats:
        """The parent's counters."""
        return self.parent.stats

    @property
    def client(self) -> MemberClient:
        return self.link.client

    @property
    def timeouts(self) -> Timeouts:
        return self.link.timeouts

    @property
    def rank(self) -> int:
        """This worker's rank in its subgroup of the current quorum (0 outside)."""
        self._layout()
        return self._ranks.index(self.parent.rank) if self._member else 0

    @property
    def size(self) -> int:
        """The size of this worker's subgroup in the current quorum (1 outside)."""
        self._layout()
        return len(self._ranks) if self._member else 1

    @property
    def newcomers(self) -> tuple[int, ...]:
        """Subgroup ranks healed in this step's ``begin_step``."""
        self._layout()
        healed = self.parent.newcomers
        return tuple(i for i, r in enumerate(self._ranks) if r in healed) if self._member else ()

    @property
    def member(self) -> bool:
        """Whether this worker is in one of the current quorum's groups of this subgroup."""
        self._layout()
        return self._member

    @property
    def parent_ranks(self) -> tuple[int, ...]:
        """This worker's subgroup, as parent (quorum) ranks, in subgroup rank order."""
        self._layout()
        return self._ranks

    @property
    def quorum_pending(self) -> bool:
        return self.parent.quorum_pending

    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any],
                       rollback: bool = False, heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None:
        """Register on the parent (state is the whole quorum's)."""
        self.parent.register_state(key, get, load, rollback, heal_load, snapshot)

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.parent.on_commit(fn)

    # The background heal is the parent's (shoal.membership.catchup): refusals and replays go to it; a
    # subgroup's means count every member, so one used while a joiner catches up is refused, never wrong.
    def register_replay(self, replayer: Any) -> None:
        self.parent.register_replay(replayer)

    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None:
        self.parent.refuse_background_heal(why, when)

    # The peer watch is the parent's too: its quorum is the one a subgroup's follows.
    def watch_peers(self) -> None:
        self.parent.watch_peers()

    def renew_if_dissolved(self) -> bool:
        return self.parent.renew_if_dissolved()

    def contribution(self) -> tuple[bool, int]:
        if self.parent.contribution()[1] != self.parent.size:
            raise ConfigError(f"elastic subgroup {self.name!r}: a joiner is catching up in the background "
                              "(SHOAL_HEAL=background) and a subgroup's means count every member; run with "
                              "SHOAL_HEAL=blocking (the default)")
        return True, self.size

    def shortfall(self) -> float:
        if self.parent.shortfall() != 0.0:
            raise ConfigError(f"elastic subgroup {self.name!r}: a joiner that entered between rounds counts with "
                              "part of a member's weight, and a subgroup's means count every member; run with "
                              "SHOAL_HEAL=blocking (the default)")
        return 0.0

    def out_ranks(self) -> frozenset[int]:
        self.contribution()   # a joiner catching up in the parent: refused, as there
        return frozenset()

    def unique_name(self, name: str) -> str:
        """A name not yet taken on the parent (the registry of states and names is the parent's)."""
        return self.parent.unique_name(name)

    def before_begin_step(self, fn: Callable[[], None]) -> None:
        self.parent.before_begin_step(fn)

    def begin_step(self) -> None:
        """The parent's ``begin_step``."""
        self.parent.begin_step()

    def commit(self) -> bool:
        """The parent's verdict."""
        return self.parent.commit()

    def leave(self, finished: bool | None = None) -> None:
        self.parent.leave(finished)

    def subgroup(self, rule: Partition, name: str) -> "Group":
        raise ConfigError(f"subgroup {self.name!r} cannot be split again: take subgroups of the ElasticGroup")

    def host_groups(self, name: str) -> "ElasticHostGroups":
        return ElasticHostGroups(self, name)   # refuses: a two-level mean needs the whole group

    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "Group | None":
        raise ShoalError("an elastic subgroup cannot be split; build another ElasticSubgroup of the parent")

    # --- layout and connection ---------------------------------------------------------
    def _started(self) -> bool:
        return self.parent.quorum is not None

    def _live_pg(self) -> Any:
        self._connect()
        return self.pg

    def _layout(self) -> None:
        q = self.parent.quorum
        if q is None:
            self._ranks, self._index, self._member = (0,), 0, True
            return
        if q.qid == self._qid:
            return
        groups = self.partition(member_infos(self.link.client, q))
        me = self.parent.rank
        mine = [(i, g) for i, g in enumerate(groups) if me in g]
        self._member = bool(mine)
        self._index, ranks = mine[0] if mine else (-1, [me])
        self._ranks = tuple(ranks)
        self._qid = q.qid

    def _drop(self) -> None:
        if self.pg is not None:
            self.link.retire(self.pg)
            self.pg = None
            self._dropped = self._pg_qid

    def _connect(self) -> None:
        """Build this quorum's subgroup (store barrier, then the backend); failures are recorded."""
        with self._connect_lock:
            self._layout()
            q = self.parent.quorum
            if not self._member:
                raise ShoalError(f"this worker is in no group of subgroup {self.name!r} in quorum "
                                 f"{q.qid if q else None}: check .member before a collective")
            if q is None or len(self._ranks) <= 1 or self.error is not None:
                return
            if self.pg is not None:
                if self._pg_qid == q.qid:
                    return
                self._drop()    # an older quorum's
            if self._dropped == q.qid:
                return      # abandoned after a failure: the step is lost, the next quorum rebuilds it
            prefix = f"{q.prefix}sub/{self.name}/{self._index}/"
            members = tuple(q.members[r] for r in self._ranks)
            trace = self.link.failures.trace
            trace("sub", name=self.name, qid=q.qid, phase="arrive", members=list(members))
            rv = Rendezvous(self.client, self.link, q, time.monotonic() + self.timeouts.op, self.timeouts.probe,
                            Circle(prefix, members))
            why = rv.meet()
            if why is not None:
                self._record(PeerLostError(f"subgroup {self.name!r} of quorum {q.qid}: not every member arrived "
                                           f"({why})"))
                return
            trace("sub", name=self.name, qid=q.qid, phase="build")
            try:
                self.pg = rv.build(self._ranks.index(self.parent.rank), time.monotonic() + self.timeouts.op)
                self._pg_qid = q.qid
                trace("sub", name=self.name, qid=q.qid, phase="built")
            except Exception as e:  # noqa: BLE001 - a peer did not connect: the step fails
                self._record(PeerLostError(f"building subgroup {self.name!r} of quorum {q.qid} failed: {e}"))

    def __repr__(self) -> str:
        return (f"ElasticSubgroup({self.name!r}, parent_ranks={self._ranks}, member={self._member}, "
                f"quorum={self._qid})")



Group.register(ElasticSubgroup)   # the same interface as a Group, not a subclass (see shoal.membership.elastic)

class ElasticHostGroups:
    """The subgroups of a two-level mean over an elastic group, for each quorum.

    The elastic counterpart of :class:`~shoal.comm.topology.HostGroups`:
    :meth:`current` gives the quorum's :class:`HostGroups`, whose ``local``
    is this worker's host (:func:`by_host`) and ``leaders`` the hosts'
    lowest-ranked workers (:func:`host_leaders`, ``None`` on the others);
    the topology is computed from the quorum's join records (no
    collective). Subgroup names are ``<name>/host`` and ``<name>/leaders``;
    a second instance on the same group gets ``<name>-2``, ... (every worker
    builds them in the same order, so they agree; the names are the group's
    :meth:`~shoal.comm.stepping.StepHooks.unique_name`).

    Example::

        levels = group.host_groups("ddp")      # or ElasticHostGroups(group, "ddp")
        group.begin_step()
        now = levels.current()          # now.topology.num_hosts, now.local.size, now.leaders
    """

    def __init__(self, group: Any, name: str) -> None:
        if isinstance(group, ElasticSubgroup):
            raise ConfigError(f"a two-level reduction needs a whole elastic group, got subgroup {group.name!r} "
                              "(an ElasticSubgroup cannot be split again); build it over the ElasticGroup")
        if not isinstance(group, ElasticCollectives):
            raise ConfigError(f"group must be a shoal ElasticGroup, got {type(group).__name__}")
        parent = cast(QuorumParent, group)   # the one other ElasticCollectives is the ElasticGroup
        name = parent.unique_name(name)
        self.group, self.name = parent, name
        self.local = ElasticSubgroup(parent, f"{name}/host", by_host)
        self.leaders = ElasticSubgroup(parent, f"{name}/leaders", host_leaders)
        self._qid = -1
        self._levels: HostGroups | None = None

    def current(self) -> HostGroups:
        """This quorum's layout and subgroups (recomputed when a new quorum was adopted)."""
        q = self.group.quorum
        if q is None:
            raise ShoalError("no quorum yet: start a step first (shoal's DistributedDataParallel does in forward)")
        if self._levels is None or self._qid != q.qid:
            hosts = [m.host for m in member_infos(self.group.link.client, q)]
            topo = Topology.from_host_ids(hosts, self.group.rank)
            self._levels = HostGroups(topology=topo, parent=self.group,  # type: ignore[arg-type]
                                      local=self.local, leaders=self.leaders if self.leaders.member else None)
            self._qid = q.qid
        return self._levels
