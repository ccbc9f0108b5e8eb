"""Processes forked for tests start with what their first training step imports already loaded.

torch imports torch._dynamo (some 800 modules, about 1.1 s of CPU, as much as torch itself) at a process's
first optimizer step. The fork server of ``run_workers`` and of the fault harness (``forked.Forked``)
imports it once, so no forked worker pays it again; the two use one list, since a process has one fork
server and whoever starts it first sets what it preloads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from shoal.testing import run_workers
from shoal.testing.procs import FORKSERVER_PRELOAD

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import forked  # noqa: E402

STEP = "import sys, torch\nbefore = set(sys.modules)\n" \
       "torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).step()\n" \
       "print('NEW', len(set(sys.modules) - before))\n"


def _new_modules_at_first_step(rank: int, world: int) -> list[str]:
    before = set(sys.modules)
    torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).step()
    return sorted(set(sys.modules) - before)


def test_one_preload_list_for_both_fork_server_users() -> None:
    assert tuple(FORKSERVER_PRELOAD) == forked.PRELOAD


@pytest.mark.timeout(120)
def test_a_forked_workers_first_optimizer_step_imports_next_to_nothing(tmp_path: Path) -> None:
    # Without the preload: ~800 new modules (torch._dynamo, sympy, mpmath, ...) in each worker.
    (new,) = run_workers(_new_modules_at_first_step, 1, init_group=False, timeout=100)
    assert len(new) < 20, new[:40]
    script = tmp_path / "step.py"
    script.write_text(STEP)
    p = forked.Forked([str(script)], dict(os.environ), str(tmp_path / "log.txt"))
    assert p.wait(timeout=100) == 0
    out = (tmp_path / "log.txt").read_text()
    assert int(out.split("NEW ")[1]) < 20, out
