"""Process groups that shoal holds are destroyed at exit, before the interpreter finalizes.

A gloo group destroyed during finalization aborts the process ("terminate called
without an active exception", exit 134) after the script has finished; CI saw
it under ``shoal run`` in tests/compat. The check here is deterministic: after
the exit handler ran, no shoal group (held by a global or in a reference cycle)
keeps the process group alive.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc, os, weakref
    import torch.distributed as dist
    import shoal
    from shoal.comm import lifetime

    from shoal.testing import free_port
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    gc.disable()                          # the cycle below stays until someone collects it
    group = shoal.init(backend="gloo")
    sub = group.split([[0]])
    world_pg, sub_pg = weakref.ref(group.pg), weakref.ref(sub.pg)

    class Wrapper:                        # a model wrapper in a reference cycle, as a DDP with hooks is
        def __init__(self, g):
            self.g, self.me = g, self
    Wrapper(sub)
    KEEP = group                          # a module global, alive until finalization
    del sub
    dist.destroy_process_group()
    assert world_pg() is not None and sub_pg() is not None, "still held by shoal's groups"
    lifetime.release_all()
    print("WORLD", world_pg() is None, "SUB", sub_pg() is None)
""")


@pytest.mark.timeout(60)
def test_exit_handler_lets_go_of_every_process_group_shoal_holds() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WORLD True SUB True" in proc.stdout, proc.stdout + proc.stderr

