"""Subgroups of an :class:`~shoal.comm.elastic.ElasticGroup`, rebuilt with every quorum.

An elastic group cannot be :meth:`~shoal.comm.group.Group.split` once: its
members change from one quorum to the next. An :class:`ElasticSubgroup` is a
*rule* instead ("the members of my host", "one leader per host", "the
members whose launch ``RANK`` divided by 4 equals mine"), applied to each
quorum as it is adopted. It stays the same Python object (a DDP built over it
keeps working), while under it:

- the layout is recomputed from the quorum's members and their join records
  (each member publishes its host identity and launch ``RANK`` when it
  joins), with no collective: every member computes the same partition;
- its own gloo group is built under ``<quorum prefix>sub/<name>/<index>/``
  at its first collective in that quorum (a store barrier first, which gives
  up on the parent's abort flag, then the backend factory of the parent, so
  fault plans apply to it too);
- failures are the parent's: a collective of the subgroup that fails records
  the error on the parent and raises its abort flag, so the whole step fails
  on every member of the quorum, and the parent's vote discards it; the
  subgroup's process group is abandoned together with the parent's.

``start_step``, ``should_commit``, ``register_state`` and ``on_commit`` are
the parent's; :attr:`ElasticSubgroup.newcomers` lists the *subgroup* ranks
healed in this step.

Example::

    group = ElasticGroup()
    host = ElasticSubgroup(group, "host", by_host)        # this worker's host, in every quorum
    leaders = ElasticSubgroup(group, "leaders", host_leaders)
    group.start_step()
    host.all_reduce(grad, op="avg", tag="grad/intra").wait()
    if leaders.member:
        leaders.all_reduce(delta, op="avg", tag="delta/inter").wait()
    group.should_commit()
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shoal.comm.elastic import BackendSpec, ElasticGroup, ElasticStats
from shoal.comm.group import Handle
from shoal.comm.membership import MemberClient, Quorum
from shoal.comm.rules import MemberInfo, Partition, by_host, by_slot, host_leaders, whole_quorum
from shoal.comm.topology import HostGroups, Topology
from shoal.errors import CommTimeoutError, ConfigError, PeerLostError, ShoalError


def member_infos(client: MemberClient, q: Quorum) -> list[MemberInfo]:
    """The quorum's members' join records, by quorum rank (one store read, no collective)."""
    out = []
    for m, found in zip(q.members, client.join_infos(q.members)):
        info = found or {}    # a record that does not verify counts as none (see MemberClient.join_infos)
        rank = str(info.get("rank", ""))
        out.append(MemberInfo(int(rank) if rank.isdigit() else None, str(info.get("host") or f"member-{m}")))
    return out


class ElasticSubgroup(ElasticGroup):
    """One subgroup of an elastic group per quorum, by a :data:`Partition` rule (see the module docstring).

    Args:
        parent: the elastic group.
        name: unique among the parent's subgroups (names the store prefix).
        partition: the rule, e.g. :func:`by_host`, :func:`host_leaders`, ``by_slot(4)``.

    :attr:`member` is False when this worker is in none of the quorum's
    groups (e.g. a non-leader for :func:`host_leaders`); collectives then raise.
    """

    def __init__(self, parent: ElasticGroup, name: str, partition: Partition) -> None:
        # No ElasticGroup.__init__: membership, store, vote and failures are the parent's.
        if not isinstance(parent, ElasticGroup) or isinstance(parent, ElasticSubgroup):
            raise ConfigError(f"parent must be a shoal ElasticGroup, got {type(parent).__name__}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"subgroup name must be a non-empty string, got {name!r}")
        self.parent, self.name, self.partition = parent, name, partition
        self.meter, self.timeouts, self.timeout = parent.meter, parent.timeouts, parent.timeout
        self.backend = "gloo"
        self.pg: Any = None
        self._qid = -1              # quorum whose layout is current
        self._pg_qid = -1           # quorum whose subgroup self.pg is
        self._dropped = -1          # quorum whose subgroup was abandoned (never rebuilt)
        self._seen = -1             # quorum whose adoption the on_adopt hooks have seen
        self._ranks: tuple[int, ...] = (0,)
        self._index = 0
        self._member = True
        self._connect_lock = threading.Lock()
        self._on_adopt: list[Callable[[], None]] = []
        parent._on_abandon.append(self._drop)

    # --- the parent's -------------------------------------------------------------
    @property  # type: ignore[override]
    def error(self) -> BaseException | None:
        return self.parent.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self.parent.error = value

    @property  # type: ignore[override]
    def client(self) -> MemberClient:
        return self.parent.client

    @client.setter
    def client(self, value: MemberClient) -> None:
        raise ShoalError("a subgroup's client is its parent's")

    @property  # type: ignore[override]
    def quorum(self) -> Quorum | None:
        return self.parent.quorum

    @quorum.setter
    def quorum(self, value: Quorum | None) -> None:
        raise ShoalError("a subgroup's quorum is its parent's")

    @property  # type: ignore[override]
    def step(self) -> int:
        return self.parent.step

    @step.setter
    def step(self, value: int) -> None:
        raise ShoalError("a subgroup's step is its parent's")

    @property  # type: ignore[override]
    def stats(self) -> ElasticStats:
        return self.parent.stats

    @stats.setter
    def stats(self, value: ElasticStats) -> None:
        raise ShoalError("a subgroup's stats are its parent's")

    @property  # type: ignore[override]
    def rank(self) -> int:
        self._layout()
        return self._ranks.index(self.parent.rank) if self.member else 0

    @rank.setter
    def rank(self, value: int) -> None:
        raise ShoalError("a subgroup's rank follows the quorum")

    @property  # type: ignore[override]
    def size(self) -> int:
        self._layout()
        return len(self._ranks) if self.member else 1

    @size.setter
    def size(self, value: int) -> None:
        raise ShoalError("a subgroup's size follows the quorum")

    @property  # type: ignore[override]
    def newcomers(self) -> tuple[int, ...]:
        """Subgroup ranks healed in this step's ``start_step``."""
        self._layout()
        return tuple(i for i, r in enumerate(self._ranks) if r in self.parent.newcomers) if self.member else ()

    @newcomers.setter
    def newcomers(self, value: tuple[int, ...]) -> None:
        raise ShoalError("a subgroup's newcomers are its parent's")

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
        self.parent.register_state(key, get, load, rollback, heal_load, snapshot)

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.parent.on_commit(fn)

    def on_adopt(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` in the first :meth:`start_step` through this subgroup after a quorum with
        newcomers was adopted (every member of the quorum calls it at the same point: use it for
        collectives that settle newcomers inside the subgroup)."""
        self._on_adopt.append(fn)

    def start_step(self) -> None:
        """The parent's ``start_step``; then the ``on_adopt`` hooks if a quorum with newcomers was adopted."""
        self.parent.start_step()
        q = self.parent.quorum
        if q is not None and q.qid != self._seen:
            self._seen = q.qid
            if self.parent.newcomers:
                for fn in self._on_adopt:
                    fn()

    def should_commit(self) -> bool:
        return self.parent.should_commit()

    def _record(self, err: BaseException) -> None:
        self.parent._record(err)

    def report_error(self, err: BaseException) -> None:
        self.parent.report_error(err)

    def leave(self) -> None:
        self.parent.leave()

    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "ElasticGroup | None":
        raise ShoalError("an elastic subgroup cannot be split; build another ElasticSubgroup of the parent")

    # --- layout and connection ---------------------------------------------------------
    def _layout(self) -> None:
        q = self.parent.quorum
        if q is None:
            self._ranks, self._index, self._member = (0,), 0, True
            return
        if q.qid == self._qid:
            return
        groups = self.partition(member_infos(self.parent.client, q))
        me = self.parent.rank
        mine = [(i, g) for i, g in enumerate(groups) if me in g]
        self._member = bool(mine)
        self._index, ranks = mine[0] if mine else (-1, [me])
        self._ranks = tuple(ranks)
        self._qid = q.qid

    def _drop(self) -> None:
        if self.pg is not None:
            self.parent._abandoned.append((time.monotonic(), self.pg))
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
            if q is None or len(self._ranks) <= 1 or self.parent.error is not None:
                return
            if self.pg is not None:
                if self._pg_qid == q.qid:
                    return
                self._drop()    # an older quorum's
            if self._dropped == q.qid:
                return      # abandoned after a failure: the step is lost, the next quorum rebuilds it
            st = self.parent.client.store
            prefix = f"{q.prefix}sub/{self.name}/{self._index}/"
            st.add(prefix + "arrive", 1)
            deadline = time.monotonic() + self.timeouts.op
            while st.add(prefix + "arrive", 0) < len(self._ranks):
                if self.parent.error is not None:
                    return
                if self.parent.client.remote_abort.is_set():
                    self._record(PeerLostError(f"subgroup {self.name!r} abandoned: another member reported a failure"))
                    return
                if time.monotonic() > deadline:
                    self._record(CommTimeoutError(f"subgroup {self.name!r} of quorum {q.qid}: not every member "
                                                  f"arrived within {self.timeouts.op} s (Timeouts.op)"))
                    return
                time.sleep(0.002)
            try:
                store = dist.PrefixStore(prefix + "pg/", st.clone())  # type: ignore[attr-defined]
                spec = BackendSpec(store, self._ranks.index(self.parent.rank), len(self._ranks),
                                   self.timeouts.op, lambda: self.parent.step)
                self.pg = self.parent._factory(spec)
                self._pg_qid = q.qid
            except Exception as e:  # noqa: BLE001 - a peer did not connect: the step fails
                self._record(PeerLostError(f"building subgroup {self.name!r} of quorum {q.qid} failed: {e}"))

    def _issue(self, tag: str, result: Any, launch: Callable[[], Any],
               post: Callable[[Any], Any] | None = None, whole: bool = False) -> Handle:
        self._connect()
        return super()._issue(tag, result, launch, post, whole)

    def __repr__(self) -> str:
        return (f"ElasticSubgroup({self.name!r}, parent_ranks={self._ranks}, member={self._member}, "
                f"quorum={self._qid})")


_LEVEL_NAMES: "weakref.WeakKeyDictionary[ElasticGroup, set[str]]" = weakref.WeakKeyDictionary()


class ElasticHostGroups:
    """The subgroups of a two-level mean over an elastic group, for each quorum.

    The elastic counterpart of :class:`~shoal.comm.topology.HostGroups`:
    :meth:`current` gives the quorum's :class:`HostGroups`, whose ``local``
    is this worker's host (:func:`by_host`) and ``leaders`` the hosts'
    lowest-ranked workers (:func:`host_leaders`, ``None`` on the others);
    the topology is computed from the quorum's join records (no
    collective). Subgroup names are ``<name>/host`` and ``<name>/leaders``;
    a second instance on the same group gets ``<name>-2``, ... (every worker
    builds them in the same order, so they agree).

    Example::

        levels = ElasticHostGroups(group, "ddp")
        group.start_step()
        now = levels.current()          # now.topology.num_hosts, now.local.size, now.leaders
    """

    def __init__(self, group: ElasticGroup, name: str) -> None:
        if isinstance(group, ElasticSubgroup):
            raise ConfigError(f"a two-level reduction needs a whole elastic group, got subgroup {group.name!r} "
                              "(an ElasticSubgroup cannot be split again); build it over the ElasticGroup")
        if not isinstance(group, ElasticGroup):
            raise ConfigError(f"group must be a shoal ElasticGroup, got {type(group).__name__}")
        taken = _LEVEL_NAMES.setdefault(group, set())
        base, n = name, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        self.group, self.name = group, name
        self.local = ElasticSubgroup(group, f"{name}/host", by_host)
        self.leaders = ElasticSubgroup(group, f"{name}/leaders", host_leaders)
        self._qid = -1
        self._levels: HostGroups | None = None

    def current(self) -> HostGroups:
        """This quorum's layout and subgroups (recomputed when a new quorum was adopted)."""
        q = self.group.quorum
        if q is None:
            raise ShoalError("no quorum yet: start a step first (shoal's DistributedDataParallel does in forward)")
        if self._levels is None or self._qid != q.qid:
            hosts = [m.host for m in member_infos(self.group.client, q)]
            topo = Topology.from_host_ids(hosts, self.group.rank)
            self._levels = HostGroups(topology=topo, parent=self.group, local=self.local,
                                      leaders=self.leaders if self.leaders.member else None)
            self._qid = q.qid
        return self._levels
