"""A failed quorum's gloo group must not keep a survivor's CPU busy (emulated cluster: root, ip and tc).

What the chaos bench's largest DiLoCo stalls came from: after a kill during the
pseudogradient's allreduce, gloo's loop thread in a survivor could spin on the
failed group's reset connection for as long as the group, or any work of it,
lived: ~0.8 of a core, taken from that worker's own share, its inner steps
1.5-3x slower until the next round (shoal.comm.lifetime). Three hosts at
20 mbit allreduce 13 MB; the third is SIGKILLed mid-transfer; each survivor
measures its loop threads' CPU before and after letting go of the group
(tests/e2e/reset_worker.py). The spin does not happen every time, so the
scenario is run until a survivor spun before (up to 3 times): that survivor
must be quiet after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from emulated import NEEDS_CLUSTER

from shoal.cli.cluster import ClusterSpec, EmulatedCluster
from shoal.testing import free_port

pytestmark = NEEDS_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "e2e" / "reset_worker.py"
SPIN = 1.0    # CPU seconds in a 3 s window: a loop thread spinning (idle, it takes ~0.01)


def _attempt(out: Path) -> dict[int, dict[str, float]]:
    with EmulatedCluster(ClusterSpec(3, 1, ("20mbit",))) as emu:
        store = f"{emu.address(0)}:{free_port()}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR",
               "PYTHONWARNINGS": "ignore"}
        procs = [subprocess.Popen(emu.exec_prefix(r) + [sys.executable, str(WORKER), "--rank", str(r), "--size", "3",
                                                        "--store", store, "--out", str(out)],
                                  env={**env, "GLOO_SOCKET_IFNAME": emu.interface(r)}) for r in range(3)]
        try:
            t0 = time.monotonic()
            while not (out / "ready").exists():
                assert time.monotonic() - t0 < 90, "the first allreduce did not finish"
                assert all(p.poll() is None for p in procs), "a worker exited before the first allreduce was done"
                time.sleep(0.05)
            time.sleep(1.5)           # the second allreduce is under way (~7 s at 20 mbit)
            procs[2].kill()
            for p in procs[:2]:
                assert p.wait(timeout=120) == 0
        finally:
            for p in procs:
                p.kill()
                p.wait()
    # A survivor whose allreduces both finished (the kill came after them) writes nothing: not this scenario.
    return {r: json.loads((out / f"{r}.json").read_text()) for r in range(2) if (out / f"{r}.json").exists()}


@pytest.mark.timeout(400)
def test_a_survivor_s_gloo_loop_stops_spinning_once_the_failed_group_is_let_go_of(tmp_path: Path) -> None:
    seen = []
    for attempt in range(3):
        out = tmp_path / str(attempt)
        out.mkdir()
        res = _attempt(out)
        seen.append(res)
        spun = [r for r, v in res.items() if v["before"] >= SPIN]
        if spun:
            for r in spun:
                assert res[r]["after"] < 0.3, (f"rank {r}'s gloo loop still spun after the group was let go of "
                                               f"({res[r]['after']:.2f} s of CPU in 3 s): {res}")
            return
    pytest.skip(f"no survivor's gloo loop spun after the kill in 3 attempts (nothing to check): {seen}")
