"""`shoal run` on an emulated cluster (root, ip and tc), and that it always cleans up."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.cli.cluster import ClusterSpec, EmulatedCluster, cleanup_stale, list_namespaces
from shoal.cli.launcher import launch
from emulated import NEEDS_CLUSTER, leftovers

pytestmark = NEEDS_CLUSTER

SCRIPTS = Path(__file__).resolve().parents[1] / "dist" / "scripts"
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.mark.timeout(60)
def test_two_hosts_all_reduce_over_shaped_link() -> None:
    out = io.StringIO()
    spec = ClusterSpec(hosts=2, procs_per_host=2, bandwidth=("200mbit",))
    res = launch([PY, str(SCRIPTS / "allreduce_worker.py")], cluster=spec, stdout=out, quiet=True)
    assert res.returncode == 0, out.getvalue()
    hosts = {}
    for r in range(4):
        m = re.search(rf"^\[{r}\] SUM 10 10 HOST (\S+)$", out.getvalue(), re.M)
        assert m, out.getvalue()
        hosts[r] = m.group(1)
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert res.host_bytes is not None and len(res.host_bytes) == 2
    for b in res.host_bytes:  # the store and the ring crossed the link both ways
        assert b["sent"] > 1000 and b["received"] > 1000
    assert leftovers(os.getpid()) == []


def _stream_seconds(spec: ClusterSpec, nbytes: int) -> tuple[float, list[dict[str, int]]]:
    out = io.StringIO()
    res = launch([PY, str(SCRIPTS / "stream_worker.py"), str(nbytes)], cluster=spec, stdout=out, quiet=True)
    assert res.returncode == 0, out.getvalue()
    m = re.search(r"^\[0\] GOT (\d+) in ([\d.]+)$", out.getvalue(), re.M)
    assert m and int(m.group(1)) == nbytes, out.getvalue()
    assert res.host_bytes is not None
    return float(m.group(2)), res.host_bytes


@pytest.mark.timeout(60)
def test_link_is_shaped_to_its_rate() -> None:
    # 2 MB through host 1's 8 mbit upload (1 MB/s) takes ~2 s; through a 1 gbit one, well under 1 s.
    slow, counters = _stream_seconds(ClusterSpec(2, 1, ("1gbit", "8mbit")), 2_000_000)
    assert 1.6 <= slow <= 3.0, f"2 MB over 8 mbit took {slow:.2f} s"
    assert counters[1]["sent"] >= 2_000_000 and counters[0]["received"] >= 2_000_000
    # the same through host 0's 8 mbit download (the switch-side qdisc)
    down, _ = _stream_seconds(ClusterSpec(2, 1, ("8mbit", "1gbit")), 2_000_000)
    assert 1.6 <= down <= 3.0, f"2 MB into an 8 mbit host took {down:.2f} s"
    fast, _ = _stream_seconds(ClusterSpec(2, 1, ("1gbit",)), 2_000_000)
    assert fast < 1.0, f"2 MB over 1 gbit took {fast:.2f} s"
    print(f"8 mbit up {slow:.2f} s, 8 mbit down {down:.2f} s, 1 gbit {fast:.3f} s")


@pytest.mark.timeout(60)
def test_worker_error_cleans_up() -> None:
    out = io.StringIO()
    res = launch([PY, str(SCRIPTS / "sleep_worker.py"), "--fail", "1", "3"],
                 cluster=ClusterSpec(2, 1, ("100mbit",)), stdout=out, quiet=True)
    assert res.returncode == 3 and res.failed_rank == 1
    assert leftovers(os.getpid()) == []


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_cleans_up() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([PY, "-m", "shoal", "run", "--hosts", "2", "--bandwidth", "50mbit",
                             str(SCRIPTS / "sleep_worker.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, "launcher ended before its workers were ready"
            ready += "READY" in line
        assert any(n.startswith(f"shoal-{proc.pid}-") for n in list_namespaces())
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM
        assert leftovers(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(30)
def test_cleanup_stale_removes_a_dead_runs_namespaces() -> None:
    cluster = EmulatedCluster(ClusterSpec(2, 1))
    cluster.pid = 999_999_999  # no such process: looks like a crashed launcher
    cluster.__enter__()
    try:
        names = [cluster.switch_namespace, cluster.namespace(0), cluster.namespace(1)]
        assert set(names) <= set(list_namespaces())
        removed = cleanup_stale()
        assert set(names) <= set(removed)
        assert leftovers(999_999_999) == []
    finally:
        cluster.close()
