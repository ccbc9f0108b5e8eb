"""The fault tests' process harness itself (harness.py): a killed worker's last lines are in its log, a
cleanup never masks the failure that led to it, and no forked worker outlives the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402


def _script(tmp_path: Any, name: str, body: str) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        f.write(body)
    return path


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie nobody reaped yet counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(60)
def test_what_a_worker_printed_right_before_its_sigkill_is_in_its_log(tmp_path: Any) -> None:
    # The worker's environment decides how its streams buffer, as for `python script.py`: the streams a forked
    # child inherits were made in the fork server, under the test process's environment, and with block
    # buffering a SIGKILL loses what they hold. Both ways, so that the test process's own environment
    # (PYTHONUNBUFFERED set or not) cannot make it pass without the worker's deciding.
    script = _script(tmp_path, "killed.py", "import os, signal, sys\n"
                     "print('the last words of this worker')\n"
                     "sys.stdout.write('and a line it never ended')\n"
                     "print('said on stderr', file=sys.stderr)\n"
                     "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    logs = {}
    for unbuffered in (True, False):
        logs[unbuffered] = os.path.join(str(tmp_path), f"log-{unbuffered}.txt")
        p = harness.Forked([script], {**env, **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})}, logs[unbuffered])
        assert p.wait(timeout=30) == -signal.SIGKILL
    with open(logs[True]) as f:
        text = f.read()
    assert "the last words of this worker\nand a line it never ended" in text, text
    with open(logs[False]) as f:   # stdout block-buffered (lost), stderr line-buffered: as the interpreter
        assert f.read() == "said on stderr\n"


@pytest.mark.timeout(60)
def test_a_worker_gone_before_the_cleanup_signals_it_does_not_mask_the_real_failure(tmp_path: Any,
                                                                                    monkeypatch: Any) -> None:
    # The run outlives its hard limit (the real failure); as the cleanup signals the worker, the worker
    # ends by itself (made certain here: the signal is sent, then the group is reported gone).
    script = _script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    killpg = os.killpg

    def gone_meanwhile(pid: int, sig: int) -> None:
        killpg(pid, sig)
        raise ProcessLookupError(3, "No such process")
    monkeypatch.setattr(harness.os, "killpg", gone_meanwhile)
    with pytest.raises(TimeoutError, match="still going after 1.0 s"):
        harness.run(str(tmp_path), 1, [], script=script, hard_limit=1.0)


_LEAVES_A_WORKER = """
import os, sys
sys.path[:0] = [{faults!r}]
import forked
p = forked.Forked([{sleeper!r}], dict(os.environ), {log!r}, preload=())   # no torch: a cheap fork server
print(p.pid, flush=True)
"""


@pytest.mark.timeout(60)
def test_a_test_process_that_ends_kills_its_forked_workers_instead_of_waiting_for_them(tmp_path: Any) -> None:
    # Forked workers are not daemons (a launcher has children): at its exit, multiprocessing joins them,
    # which would hang a test process that ends with one still running for as long as it runs.
    sleeper = _script(tmp_path, "sleeper.py", "import time\ntime.sleep(120)\n")
    code = _LEAVES_A_WORKER.format(faults=os.path.dirname(os.path.abspath(__file__)), sleeper=sleeper,
                                   log=os.path.join(str(tmp_path), "log.txt"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline() or 0)   # type: ignore[union-attr]
    try:
        assert worker and proc.wait(timeout=30) == 0, "the test process hung at its exit on its forked worker"
        assert _ended(worker, within=10.0)
    finally:
        proc.kill()
        if worker and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_forked_worker_ends_with_a_test_process_that_crashed(tmp_path: Any) -> None:
    # No exit handler runs in a test process that was SIGKILLed, and the fork server does not end with it
    # while a child lives (each child holds its "alive" pipe): the worker watches its owner itself.
    sleeper = _script(tmp_path, "sleeper.py", "import time\ntime.sleep(120)\n")
    owner = subprocess.Popen(["sleep", "60"])     # stands in for the test process
    p = harness.Forked([sleeper], dict(os.environ), os.path.join(str(tmp_path), "log.txt"), owner=owner.pid)
    try:
        assert p.poll() is None
        owner.kill()
        owner.wait()
        assert p.wait(timeout=20) == -signal.SIGKILL
    finally:
        owner.kill()
        harness._killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def _ended(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)
