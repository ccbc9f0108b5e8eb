"""Partition rules: which members of a group form each subgroup.

A rule maps the members of a group (by rank, each with its launch slot and
host identity) to disjoint lists of ranks. :meth:`shoal.comm.Group.subgroup`
applies one: once on a static group, again on every quorum of an elastic
group (:mod:`shoal.membership.views`), where every member computes the same
partition from the quorum's join records without a collective.

Example::

    host = group.subgroup(by_host, "host")           # this worker's host
    leaders = group.subgroup(host_leaders, "leaders")
    if leaders.member:
        leaders.all_reduce(delta, op="avg", tag="delta/inter").wait()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from shoal.errors import ConfigError


@dataclass(frozen=True)
class MemberInfo:
    """What a quorum member published when it joined.

    ``slot``: its launch ``RANK`` (stable across restarts under ``shoal
    run --elastic``), ``None`` if it had none; ``host``: its host identity.
    """

    slot: int | None
    host: str


Partition = Callable[[Sequence[MemberInfo]], list[list[int]]]
"""Maps the quorum's members (by quorum rank) to disjoint groups of quorum ranks."""


def by_host(members: Sequence[MemberInfo]) -> list[list[int]]:
    """One group per host identity, hosts ordered by their lowest quorum rank.

    >>> by_host([MemberInfo(0, "a"), MemberInfo(1, "b"), MemberInfo(2, "a")])
    [[0, 2], [1]]
    """
    groups: dict[str, list[int]] = {}
    for r, m in enumerate(members):
        groups.setdefault(m.host, []).append(r)
    return list(groups.values())


def host_leaders(members: Sequence[MemberInfo]) -> list[list[int]]:
    """One group of the lowest quorum rank of every host (the hosts' leaders).

    >>> host_leaders([MemberInfo(0, "a"), MemberInfo(1, "a"), MemberInfo(2, "b")])
    [[0, 2]]
    """
    return [[g[0] for g in by_host(members)]]


def whole_quorum(members: Sequence[MemberInfo]) -> list[list[int]]:
    """One group of every member, in quorum rank order: a second stream of collectives over the
    quorum (e.g. one issued from another thread, whose order would otherwise interleave differently
    with the group's own on each member).

    >>> whole_quorum([MemberInfo(0, "a"), MemberInfo(1, "b")])
    [[0, 1]]
    """
    return [list(range(len(members)))]


def by_slot(size: int) -> Partition:
    """Groups of members whose launch slot divided by ``size`` is equal (static groups of ``size``).

    Under a complete quorum launched as ranks ``0..N-1`` these are the static
    groups of ``size`` consecutive ranks; a restarted worker (same ``RANK``)
    returns to its own group; a lost worker only shrinks its group. A member
    without a slot is a group of its own.

    >>> by_slot(2)([MemberInfo(0, "a"), MemberInfo(3, "a"), MemberInfo(1, "a"), MemberInfo(None, "a")])
    [[0, 2], [1], [3]]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"slot group size must be an integer >= 1, got {size!r}")

    def partition(members: Sequence[MemberInfo]) -> list[list[int]]:
        groups: dict[tuple[int, int], list[int]] = {}
        for r, m in enumerate(members):
            key = (0, m.slot // size) if m.slot is not None else (1, r)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    return partition
