"""Partitions of a quorum into subgroups (pure functions: every member computes the same groups)."""

from __future__ import annotations

import pytest

from shoal.membership.views import MemberInfo, by_host, by_slot, host_leaders
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


def test_a_subgroup_is_a_view_whose_step_interface_is_the_parents() -> None:
    # One worker, one quorum: the view registers on, votes with and fails together with its parent.
    import torch

    from shoal.comm import Group
    from shoal.membership.elastic import ElasticGroup
    from shoal.membership.views import ElasticHostGroups, ElasticSubgroup
    from shoal.elastic import Coordinator, Timeouts
    from shoal.errors import PeerLostError

    token = "view-test-token"
    coord = Coordinator(port=0, initial_workers=1, token=token).start()
    group = ElasticGroup("view", coordinator=coord.address, min_workers=1, token=token, host_id="h0",
                         timeouts=Timeouts(op=5.0, quorum=10.0, join=20.0))
    try:
        host = group.subgroup(by_host, "host")
        assert isinstance(host, ElasticSubgroup) and isinstance(host, Group) and host.elastic
        assert not issubclass(ElasticSubgroup, ElasticGroup)
        assert not isinstance(host, ElasticGroup) and host.elastic   # a view over the quorums, not a subclass
        with pytest.raises(ConfigError, match="cannot be split again"):
            host.subgroup(by_host, "again")
        with pytest.raises(ConfigError, match="needs a whole elastic group"):
            ElasticHostGroups(host, "levels")
        # One registry: what the view registers is the parent's (a second key raises on either).
        box = {"v": 1.0}
        host.register_state("box", lambda: dict(box), lambda s: box.update(s), rollback=True)
        with pytest.raises(ConfigError, match="already registered"):
            group.register_state("box", dict, print)
        # ...and so are the names: a DDP over the view (shoal.parallel: unique_name("ddp")) and one over
        # the parent register apart.
        assert host.unique_name("ddp") == "ddp" and group.unique_name("ddp") == "ddp-2"
        committed: list[int] = []
        host.on_commit(lambda: committed.append(group.step))

        host.begin_step()                       # the parent's: adopts the first quorum
        assert group.quorum is not None and host.quorum is group.quorum and host.newcomers == ()
        assert (host.rank, host.size, host.member, host.parent_ranks) == (0, 1, True, (0,))
        t = torch.ones(3)
        host.all_reduce(t, op="sum", tag="view").wait()
        assert host.commit() is True and committed == [1] and group.step == 1

        group.begin_step()
        box["v"] = 2.0                          # a step's change, rolled back by the discard
        host.report_error(PeerLostError("lost"))
        assert group.error is host.error and isinstance(group.error, PeerLostError)
        assert group.commit() is False and box == {"v": 1.0} and committed == [1] and group.stats.discards == 1
    finally:
        group.leave()
        coord.stop()
