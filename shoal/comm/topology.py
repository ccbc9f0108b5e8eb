"""Which ranks share a host, and the subgroups a two-level reduction needs.

Every rank contributes a *host identity* (a string); ranks with equal
identities are on the same host. The identity is, in order of preference:
an explicit argument, the ``SHOAL_HOST_ID`` environment variable (``shoal
run`` sets it on every worker, and tests set it to pretend that ranks on one
machine are on several hosts), else the machine's hostname. Hosts may hold
different numbers of ranks.

Hosts are numbered by their lowest rank; the lowest rank on each host is its
*leader*; a rank's *local rank* is its position among its host's ranks.

Example (inside ``shoal run --hosts 2 --procs-per-host 2 ...``)::

    group = shoal.init()
    topo = discover(group)
    topo.num_hosts, topo.host_index, topo.local_rank, topo.leaders
    # (2, 1, 0, (0, 2)) on rank 2
    levels = HostGroups.build(group, topo)      # collective: every rank calls it
    levels.local.size, levels.leaders is None   # (2, False) on rank 2
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Sequence

from shoal.comm.collectives import Collectives
from shoal.errors import ConfigError

HOST_ID_ENV = "SHOAL_HOST_ID"


def host_identity(override: str | None = None) -> str:
    """This process's host identity: ``override``, else ``$SHOAL_HOST_ID``, else the hostname.

    >>> host_identity("node-7")
    'node-7'
    """
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ConfigError(f"host identity must be a non-empty string, got {override!r}")
        return override
    env = os.environ.get(HOST_ID_ENV, "")
    return env if env else socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """The layout of a group's ranks on hosts, as seen by one rank.

    ``hosts[h]`` lists the group ranks on host ``h`` in increasing order;
    hosts are ordered by their lowest rank. Built by :func:`discover` (or
    :meth:`from_host_ids` without communication, e.g. in tests).

    >>> t = Topology.from_host_ids(["a", "a", "b", "b", "b"], rank=3)
    >>> t.num_hosts, t.host_index, t.local_rank, t.local_size, t.leaders
    (2, 1, 1, 3, (0, 2))
    >>> t.is_leader, t.uniform
    (False, False)
    """

    rank: int
    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = sorted(r for h in self.hosts for r in h)
        if not self.hosts or any(not h for h in self.hosts):
            raise ConfigError(f"a topology needs at least one host and no empty host, got {self.hosts}")
        if flat != list(range(len(flat))):
            raise ConfigError(f"hosts must partition ranks 0..N-1 exactly once, got {self.hosts}")
        if not 0 <= self.rank < len(flat):
            raise ConfigError(f"rank {self.rank} is outside the {len(flat)} ranks of this topology")

    @classmethod
    def from_host_ids(cls, host_ids: Sequence[str], rank: int) -> "Topology":
        """Group ranks by equal identity; ``host_ids[r]`` is rank r's."""
        order: dict[str, list[int]] = {}
        for r, h in enumerate(host_ids):
            order.setdefault(h, []).append(r)
        return cls(rank=rank, hosts=tuple(tuple(rs) for rs in order.values()))

    @property
    def world_size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def host_index(self) -> int:
        """Index of this rank's host (hosts ordered by their lowest rank)."""
        return next(i for i, h in enumerate(self.hosts) if self.rank in h)

    @property
    def host_ranks(self) -> tuple[int, ...]:
        """The group ranks on this rank's host."""
        return self.hosts[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.host_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.host_ranks)

    @property
    def leaders(self) -> tuple[int, ...]:
        """One rank per host (its lowest), in host order."""
        return tuple(h[0] for h in self.hosts)

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @property
    def max_ranks_per_host(self) -> int:
        return max(len(h) for h in self.hosts)

    def is_hierarchical(self) -> bool:
        """Whether a two-level reduction can beat a flat one: several hosts, some with several ranks."""
        return self.num_hosts > 1 and self.max_ranks_per_host > 1


def discover(group: Collectives, host_id: str | None = None) -> Topology:
    """All-gather every rank's host identity over ``group`` (collective) and derive the layout.

    Args:
        group: the ranks to lay out (numbers in the result are this group's ranks).
        host_id: this rank's identity; default :func:`host_identity`.

    Example::

        topo = discover(shoal.init())
        print(f"rank {topo.rank}: host {topo.host_index} of {topo.num_hosts}, local rank {topo.local_rank}")
    """
    ids = group.all_gather_object(host_identity(host_id), tag="topology")
    return Topology.from_host_ids([str(i) for i in ids], group.rank)


@dataclass(frozen=True)
class HostGroups:
    """The subgroups of a two-level reduction, for one rank.

    ``local``: this rank's host (always set, maybe of size 1). ``leaders``:
    one rank per host, set only on leaders (``None`` elsewhere). Both share
    the parent group's meter and timeout.
    """

    topology: Topology
    parent: Collectives
    local: Collectives
    leaders: Collectives | None

    @classmethod
    def build(cls, group: Collectives, topology: Topology | None = None) -> "HostGroups":
        """Create the subgroups (collective over ``group``: every rank calls it, in the same order).

        Example::

            levels = HostGroups.build(group)             # discovers the topology itself
        """
        topo = discover(group) if topology is None else topology
        if topo.world_size != group.size or topo.rank != group.rank:
            raise ConfigError(
                f"topology of {topo.world_size} ranks (rank {topo.rank}) does not match the group of "
                f"{group.size} ranks (rank {group.rank}); discover it over the same group"
            )
        local = group.split([list(h) for h in topo.hosts])
        leaders = group.split([list(topo.leaders)])
        if local is None:  # pragma: no cover - the hosts partition every rank
            raise ConfigError(f"rank {group.rank} is on no host of {topo.hosts}")
        return cls(topology=topo, parent=group, local=local, leaders=leaders)
