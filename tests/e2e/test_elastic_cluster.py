"""`shoal run --elastic` on an emulated cluster (root, ip and tc): kill, restart, heal, agree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from emulated import NEEDS_CLUSTER, leftovers

pytestmark = NEEDS_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "faults" / "elastic_worker.py"
STEPS, PARK = 12, 4


def _kill_when_parked(out: Path, launcher: subprocess.Popen[str], limit: float) -> int:
    """SIGKILL rank 1's first incarnation once it parks at step PARK; returns its pid."""
    deadline = time.monotonic() + limit
    parked = out / "parked-1"
    while not parked.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"rank 1 never parked at step {PARK} (launcher exit {launcher.poll()})")
        time.sleep(0.05)
    pid = int(parked.read_text())
    os.kill(pid, signal.SIGKILL)  # the worker runs in a namespace of the network only: same pid space
    return pid


@pytest.mark.timeout(40)
def test_elastic_run_on_two_hosts_survives_a_kill_and_heals_the_restart(tmp_path: Path) -> None:
    # Two hosts at 20 mbit, DDP on an ElasticGroup. Rank 1 parks at committed step 4 and is SIGKILLed
    # there; rank 0's step 5 fails and is discarded; with --min-workers 2 it waits for the restart,
    # which joins from host 1's namespace through the coordinator in host 0's, heals from rank 0
    # and both finish step 12 with equal model and optimizer state.
    cmd = [sys.executable, "-m", "shoal", "run", "--hosts", "2", "--bandwidth", "20mbit", "--elastic",
           "--min-workers", "2", "--max-restarts", "1", str(WORKER),
           "--out", str(tmp_path), "--steps", str(STEPS), "--park-at", str(PARK), "--op", "20"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _kill_when_parked(tmp_path, launcher, limit=25)
        logs, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:  # SIGTERM: the launcher stops its workers and removes the namespaces
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=15)
    assert launcher.returncode == 0, logs
    assert "coordinator: shoal coordinator: serving on 10.213.0.1:" in logs, logs
    assert "rank 1 exited with code 137; restarting it (1/1)" in logs, logs
    results: dict[tuple[int, int], dict[str, Any]] = {}
    for rank, life in ((0, 0), (1, 1)):
        results[rank, life] = torch.load(tmp_path / f"{rank}-{life}.pt", weights_only=False)
    assert not (tmp_path / "1-0.pt").exists(), "the killed incarnation must not have finished"
    survivor, restarted = results[0, 0], results[1, 1]
    assert survivor["stats"]["discards"] >= 1, logs            # the step the kill interrupted
    assert restarted["stats"]["heals_received"] == 1, logs
    assert restarted["log"][0]["step"] == PARK + 1, logs       # it resumed where the group was
    for res in (survivor, restarted):
        assert res["log"][-1]["step"] == STEPS and res["log"][-1]["size"] == 2, logs
    for k, v in survivor["model"].items():
        assert torch.equal(v, restarted["model"][k]), f"{k} differs between the two workers"
    assert survivor["log"][-1]["digest"] == restarted["log"][-1]["digest"], logs
    assert survivor["cursor"] == restarted["cursor"]
    assert leftovers(launcher.pid) == []


@pytest.mark.timeout(30)
def test_a_coordinator_that_cannot_serve_is_reported_with_its_output() -> None:
    from shoal.cli.cluster import ClusterSpec, EmulatedCluster
    from shoal.cli.elastic_launch import NamespacedCoordinator
    from shoal.errors import ShoalError

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with EmulatedCluster(ClusterSpec(1, 1)) as emu:
        with pytest.raises(ShoalError, match=r"exited with code 2; its output: .*port must be in \[0, 65535\]"):
            with NamespacedCoordinator(emu, port=70000, env=env, token="e2e-token-123"):
                pass
    assert leftovers(os.getpid()) == []
