"""Partitions of a quorum into subgroups (pure functions: every member computes the same groups)."""

from __future__ import annotations

import pytest

from shoal.comm.elastic_sub import MemberInfo, by_host, by_slot, host_leaders
from shoal.errors import ConfigError


def _static_groups(world: int, size: int) -> list[list[int]]:
    return [list(range(s, s + size)) for s in range(0, world, size)]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_by_slot_on_a_complete_quorum_is_the_static_split(size: int) -> None:
    members = [MemberInfo(r, "h") for r in range(8)]
    assert by_slot(size)(members) == _static_groups(8, size)


def test_by_slot_keeps_groups_when_members_are_lost_or_restarted() -> None:
    # Quorum order: survivors by member id, then the restarted slot 1 last.
    members = [MemberInfo(0, "a"), MemberInfo(2, "b"), MemberInfo(3, "b"), MemberInfo(1, "a")]
    assert by_slot(2)(members) == [[0, 3], [1, 2]]        # slot 1 is back with slot 0
    assert by_slot(2)(members[:3]) == [[0], [1, 2]]       # slot 1 lost: its group shrinks, no mixing


def test_members_without_a_slot_are_alone_and_sizes_are_checked() -> None:
    assert by_slot(2)([MemberInfo(None, "a"), MemberInfo(None, "a")]) == [[0], [1]]
    with pytest.raises(ConfigError):
        by_slot(0)


def test_hosts_and_leaders_follow_the_quorum_order() -> None:
    members = [MemberInfo(3, "b"), MemberInfo(0, "a"), MemberInfo(2, "b"), MemberInfo(1, "a")]
    assert by_host(members) == [[0, 2], [1, 3]]
    assert host_leaders(members) == [[0, 1]]
    # The leader of host b is lost: the next quorum's leader of b is its other worker.
    assert host_leaders(members[1:]) == [[0, 1]] and by_host(members[1:]) == [[0, 2], [1]]
