"""The README's example really runs under torchrun."""

import os
import subprocess
import sys

import pytest

from shoal.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_example_trains_under_torchrun() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), os.path.join(ROOT, "examples", "train_ddp.py"), "--steps", "100"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("step ")]
    assert [l.split(":")[0] for l in lines] == ["step 50", "step 100"]
    first, last = (float(l.split("loss ")[1].split()[0]) for l in lines)
    assert last < 5.0 and "MB sent/step" in lines[-1]  # ln(256) = 5.55: it learned something
