"""Validation of cluster specs, rates, tbf sizing and `shoal run` argument splitting (no processes)."""

from __future__ import annotations

import pytest

from shoal.cli.cluster import ClusterSpec, parse_rate, tbf_params
from shoal.cli.run import _cluster, _parser, _split_argv
from shoal.errors import ConfigError, ShoalError


def test_bandwidth_broadcast_and_per_host() -> None:
    assert ClusterSpec(3, 1, ("100mbit",)).bandwidth == ("100mbit",) * 3
    assert ClusterSpec(2, 2, "1gbit").bandwidth == ("1gbit", "1gbit")
    assert ClusterSpec(2, 1, ("1gbit", "20mbit")).rate_bytes(1) == 2.5e6
    assert ClusterSpec(2, 1).rate_bytes(0) is None
    assert ClusterSpec(4, 2, ()).world_size == 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(hosts=0, procs_per_host=1), "hosts"),
    (dict(hosts=2, procs_per_host=0), "procs_per_host"),
    (dict(hosts=True, procs_per_host=1), "hosts"),
    (dict(hosts=251, procs_per_host=1), "250"),
    (dict(hosts=3, procs_per_host=1, bandwidth=("1mbit", "2mbit")), "one per host"),
    (dict(hosts=1, procs_per_host=1, bandwidth=("fast",)), "not a tc rate"),
    (dict(hosts=1, procs_per_host=1, bandwidth=("10furlongs",)), "not a tc rate"),
    (dict(hosts=1, procs_per_host=1, bandwidth=("1kbit",)), "below 64kbit"),
])
def test_cluster_spec_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ClusterSpec(**kwargs)


def test_parse_rate_units() -> None:
    assert parse_rate("100mbit") == 12.5e6
    assert parse_rate("1gbit") == 125e6
    assert parse_rate("5mbps") == 5e6  # tc: bps is bytes per second
    assert parse_rate("1mibit") == 2**20 / 8


def test_tbf_burst_and_limit_grow_with_rate() -> None:
    b_slow, l_slow = tbf_params(parse_rate("1mbit"))
    b_fast, l_fast = tbf_params(parse_rate("10gbit"))
    assert b_slow >= 64 * 1024 and l_slow > b_slow  # one GSO segment always fits
    assert b_fast > b_slow and l_fast > l_slow
    assert b_fast >= parse_rate("10gbit") * 0.004  # one 4 ms tick of tokens


def test_split_argv_gives_program_its_own_flags() -> None:
    assert _split_argv(["-n", "2", "train.py", "-n", "5", "--kill", "x"]) == (["-n", "2"], None, ["train.py", "-n", "5", "--kill", "x"])
    assert _split_argv(["--hosts", "2", "-m", "pkg.mod", "--hosts", "9"]) == (["--hosts", "2"], "pkg.mod", ["--hosts", "9"])
    assert _split_argv(["-n2", "--quiet", "s.py"]) == (["-n2", "--quiet"], None, ["s.py"])
    assert _split_argv(["--cleanup"]) == (["--cleanup"], None, [])
    with pytest.raises(ShoalError, match="module"):
        _split_argv(["-m"])


def _spec(*argv: str) -> ClusterSpec | None:
    return _cluster(_parser().parse_args(list(argv)))


def test_cli_cluster_options() -> None:
    assert _spec("-n", "2") is None
    assert _spec("--hosts", "2", "-n", "4") == ClusterSpec(2, 2)
    assert _spec("--hosts", "3", "--bandwidth", "1gbit,100mbit", "--bandwidth", "20mbit").bandwidth == ("1gbit", "100mbit", "20mbit")
    with pytest.raises(ShoalError, match="--hosts"):
        _spec("--bandwidth", "10mbit")
    with pytest.raises(ShoalError, match="divide"):
        _spec("--hosts", "2", "-n", "3")
    with pytest.raises(ShoalError, match="differs"):
        _spec("--hosts", "2", "--procs-per-host", "2", "-n", "2")


def test_emulation_without_root_or_tools_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import shoal.cli.cluster as cluster

    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(ShoalError) as info:
        cluster.check_can_emulate()
    msg = str(info.value)
    assert "root" in msg and "`tc`" in msg and "`ip`" not in msg and "drop --hosts" in msg


def test_elastic_coordinator_address_is_refused_on_an_emulated_cluster() -> None:
    # Refused before anything is built: no root needed, no namespace created.
    from shoal.cli.elastic_launch import ElasticLaunch
    from shoal.cli.launcher import launch

    with pytest.raises(ConfigError, match=r"127.0.0.1:29400.*inside host 0's namespace"):
        launch(["true"], cluster=ClusterSpec(2, 1), elastic=ElasticLaunch(coordinator="127.0.0.1:29400"))
