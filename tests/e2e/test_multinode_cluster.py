"""Each emulated host runs its OWN `shoal run` inside its namespace (no shared parent): static and elastic.

This is how a run across real machines starts (docs/multinode.md): one launcher per machine, sharing nothing
but addresses. Root, ip and tc are needed (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from emulated import NEEDS_CLUSTER

pytestmark = NEEDS_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
NODE_WORKER = ROOT / "tests" / "dist" / "scripts" / "node_worker.py"
ELASTIC_WORKER = ROOT / "tests" / "faults" / "elastic_worker.py"
TOKEN = "multinode-e2e-token"


def _env(**more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR", **more}


def _launcher(emu: Any, host: int, opts: list[str], script: list[str], **env: str) -> subprocess.Popen[str]:
    argv = emu.exec_prefix(host) + [sys.executable, "-m", "shoal", "run", *opts, *script]
    return subprocess.Popen(argv, env=_env(SHOAL_HOST_ID=f"machine-{host}", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(90)
def test_static_run_with_one_launcher_per_host(tmp_path: Path) -> None:
    from shoal.cli.cluster import ClusterSpec, EmulatedCluster

    with EmulatedCluster(ClusterSpec(2, 1, ("50mbit",))) as emu:
        procs = [_launcher(emu, h, ["--nnodes", "2", "--node-rank", str(h), "--master-addr", emu.address(0),
                                    "-n", "1"], [str(NODE_WORKER), str(tmp_path)]) for h in (1, 0)]
        logs = [p.communicate(timeout=75)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], logs
        recs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(recs):
        e = rec["env"]
        assert rec["world"] == 2 and e["RANK"] == e["GROUP_RANK"] == str(r), rec
        # Each host advertises its own address and points gloo at its own interface, never loopback.
        assert e["SHOAL_ADVERTISE_ADDR"] == emu.address(r) and e["GLOO_SOCKET_IFNAME"] == emu.interface(r), rec
        assert e["SHOAL_HOST_ID"] == f"machine-{r}" and e["MASTER_ADDR"] == emu.address(0)
    assert recs[0]["grad"] == recs[1]["grad"]


@pytest.mark.timeout(150)
def test_elastic_hosts_with_their_own_launchers_survive_a_lost_host_that_comes_back(tmp_path: Path) -> None:
    # A coordinator in host 0's namespace; each host starts its own `shoal run --elastic --coordinator`.
    # Host 1's worker parks at step 4; then host 1 dies whole (launcher and workers). Host 0 goes on alone;
    # a new launcher on host 1 starts later, its worker joins, heals and both end with equal state.
    from shoal.cli.cluster import ClusterSpec, EmulatedCluster
    from shoal.cli.elastic_launch import NamespacedCoordinator

    steps, park = 12, 4
    script = [str(ELASTIC_WORKER), "--out", str(tmp_path), "--steps", str(steps), "--park-at", str(park),
              "--op", "20", "--min-workers", "1", "--want-size", "2", "--pace", "0.05"]
    with EmulatedCluster(ClusterSpec(2, 1, ("50mbit",))) as emu, \
            NamespacedCoordinator(emu, host=0, initial_workers=2, env=_env(), token=TOKEN) as coord:
        def opts(h: int) -> list[str]:
            return ["--elastic", "--coordinator", coord.address, "--nnodes", "2", "--node-rank", str(h),
                    "-n", "1", "--min-workers", "1", "--max-restarts", "0"]

        host0 = _launcher(emu, 0, opts(0), script, SHOAL_TOKEN=TOKEN)
        host1 = _launcher(emu, 1, opts(1), script, SHOAL_TOKEN=TOKEN)
        deadline = time.monotonic() + 60
        while not (tmp_path / "parked-1").exists():
            if time.monotonic() > deadline or host0.poll() is not None or host1.poll() is not None:
                for p in (host0, host1):
                    p.kill()
                raise AssertionError(f"host 1's worker never parked: {[p.communicate()[0] for p in (host0, host1)]}")
            time.sleep(0.05)
        host1.kill()           # the machine dies: its launcher and every process in its namespace
        emu.kill_host(1)
        host1.wait(timeout=10)
        time.sleep(2)  # host 0 trains alone meanwhile (min-workers 1)
        back = _launcher(emu, 1, opts(1), script, SHOAL_TOKEN=TOKEN, SHOAL_RESTART="1")
        logs = [host0.communicate(timeout=90)[0], back.communicate(timeout=30)[0]]
        assert [host0.returncode, back.returncode] == [0, 0], logs
    survivor = torch.load(tmp_path / "0-0.pt", weights_only=False)
    rejoined = torch.load(tmp_path / "1-1.pt", weights_only=False)
    alone = [e for e in survivor["log"] if e["committed"] and e["size"] == 1]
    assert alone and alone[0]["step"] > park, "host 0 must go on alone while host 1 is down"
    assert rejoined["stats"]["heals_received"] >= 1, logs
    assert survivor["log"][-1]["size"] == rejoined["log"][-1]["size"] == 2, logs
    assert survivor["log"][-1]["step"] == rejoined["log"][-1]["step"]
    for k, v in survivor["model"].items():
        assert torch.equal(v, rejoined["model"][k]), f"{k} differs between the two hosts"
    assert survivor["log"][-1]["digest"] == rejoined["log"][-1]["digest"]
