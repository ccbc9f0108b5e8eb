"""Topology from host identities, without communication."""

from __future__ import annotations

import pytest

from shoal.comm.topology import Topology, host_identity
from shoal.errors import ConfigError


def test_uneven_hosts_are_ordered_by_lowest_rank() -> None:
    ids = ["b", "a", "b", "c", "a", "b"]
    topos = [Topology.from_host_ids(ids, r) for r in range(6)]
    assert topos[0].hosts == ((0, 2, 5), (1, 4), (3,))
    assert topos[0].leaders == (0, 1, 3)
    assert [t.host_index for t in topos] == [0, 1, 0, 2, 1, 0]
    assert [t.local_rank for t in topos] == [0, 0, 1, 0, 1, 2]
    assert [t.local_size for t in topos] == [3, 2, 3, 1, 2, 3]
    assert [t.is_leader for t in topos] == [True, True, False, True, False, False]
    assert not topos[0].uniform and topos[0].max_ranks_per_host == 3 and topos[0].is_hierarchical()


def test_when_two_levels_pay() -> None:
    assert not Topology.from_host_ids(["a", "b", "c"], 0).is_hierarchical()  # one rank per host
    assert not Topology.from_host_ids(["a", "a"], 0).is_hierarchical()  # one host
    assert Topology.from_host_ids(["a", "a", "b"], 2).is_hierarchical()


def test_invalid_layouts_raise() -> None:
    with pytest.raises(ConfigError, match="partition"):
        Topology(rank=0, hosts=((0, 1), (1, 2)))
    with pytest.raises(ConfigError, match="outside"):
        Topology(rank=3, hosts=((0, 1), (2,)))
    with pytest.raises(ConfigError, match="empty"):
        Topology(rank=0, hosts=((0,), ()))
    with pytest.raises(ConfigError, match="non-empty"):
        host_identity("")


def test_identity_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_HOST_ID", "node-3")
    assert host_identity() == "node-3"
    assert host_identity("explicit") == "explicit"
    monkeypatch.delenv("SHOAL_HOST_ID")
    assert host_identity()  # the hostname


def test_hierarchical_switch_and_codec_are_validated() -> None:
    from shoal.codecs import Hierarchical, Identity
    from shoal.codecs.hierarchical import reduction_codec

    with pytest.raises(ConfigError, match="True, False or None"):
        reduction_codec(None, None, "yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hierarchical=False"):
        reduction_codec(None, Hierarchical(), False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="twice"):
        Hierarchical(Hierarchical(Identity()))
    with pytest.raises(ConfigError, match="chunk_mb"):
        Hierarchical(chunk_mb=0)
