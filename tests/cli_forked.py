"""`python -m shoal ARGS` as its own process, forked from the fork server instead of a fresh interpreter.

For the tests of ``shoal run`` whose launcher must be a process of its own (it starts workers, takes signals,
exits with a code) but whose check is not the interpreter's start-up: the fault tests' harness forks the
launcher (``harness.Forked``) from a server that imported torch and shoal once, which saves the launcher's
torch import (about 1.2 s of CPU on an idle 2-core box, several seconds under load). The workers the
launcher starts stay fresh interpreters: that is ``shoal run``'s code under test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "faults"))
import harness  # noqa: E402

Forked = harness.Forked


def shoal_forked(args: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int, str]:
    """Run ``python -m shoal ARGS`` with ``env`` (stdout and stderr to ``log``); its exit code and output.

    Past ``timeout`` seconds the launcher is sent SIGTERM (it stops its workers, which run in sessions of
    their own), then SIGKILL with its process group, and the code is -9.
    """
    p = Forked(["-m", "shoal", *args], env, str(log))
    try:
        code = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = -signal.SIGKILL
    finally:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=8)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
    return code, log.read_text(errors="replace") if log.exists() else ""   # none if it was killed before it ran
