"""`shoal run` / launch() on this machine (no emulation): env contract, logs, failures, kills."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.cli.launcher import launch

from cli_forked import Forked, shoal_forked
from cli_inprocess import shoal_cli

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _script(name: str, *args: str) -> list[str]:
    return [PY, str(SCRIPTS / name), *args]


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(60)
def test_env_contract_and_prefixed_output() -> None:
    out = io.StringIO()
    res = launch(_script("env_worker.py", "--x", "1"), nprocs=3, env={"EXTRA": "yes", "RANK": "99"}, stdout=out)
    assert res.returncode == 0 and res.host_bytes is None and res.failed_rank is None
    lines = out.getvalue().splitlines()
    envs = {}
    for line in lines:
        m = re.match(r"^\[(\d+)\] ENV (.*)$", line)
        if m:
            envs[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(envs) == [0, 1, 2]
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, e in envs.items():
        assert e["RANK"] == str(r)  # the launcher's RANK wins over env=
        assert e["LOCAL_RANK"] == str(r)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == e["NODE_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "1"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["SHOAL_HOST_ID"] and e["GLOO_SOCKET_IFNAME"] is None
        assert e["EXTRA"] == "yes" and e["argv"] == ["--x", "1"]
    # stderr lines are prefixed by the rank that wrote them
    for r in range(3):
        assert f"[{r}] to-stderr rank={r}" in lines


@pytest.mark.timeout(60)
def test_no_prefix_passes_lines_unchanged() -> None:
    out = io.StringIO()
    res = launch(_script("env_worker.py"), nprocs=2, stdout=out, prefix_output=False)
    assert res.returncode == 0
    assert sum(line.startswith("ENV ") for line in out.getvalue().splitlines()) == 2
    assert not any(line.startswith("[") for line in out.getvalue().splitlines())


@pytest.mark.timeout(60)
def test_failure_stops_the_others_and_propagates_code() -> None:
    out = io.StringIO()
    t0 = time.monotonic()
    res = launch(_script("sleep_worker.py", "--fail", "1", "3"), nprocs=3, stdout=out)
    elapsed = time.monotonic() - t0
    assert res.returncode == 3 and res.failed_rank == 1
    assert elapsed < 30, f"the sleeping ranks were not stopped ({elapsed:.1f} s)"
    pids = [int(p) for p in re.findall(r"READY pid=(\d+)", out.getvalue())]
    assert len(pids) == 3 and not any(_pid_alive(p) for p in pids)
    assert "DONE" not in out.getvalue()
    assert "rank 1 exited with code 3" in out.getvalue()


@pytest.mark.timeout(60)
def test_kill_fails_the_run_with_sigkill_code() -> None:
    out = io.StringIO()
    res = launch(_script("sleep_worker.py"), nprocs=2, kill=[(1, 1.0)], stdout=out)
    assert res.returncode == 128 + signal.SIGKILL and res.failed_rank == 1
    assert 1.0 <= res.duration_s < 30
    assert "killing rank 1" in out.getvalue()


@pytest.mark.timeout(60)
def test_tolerated_kill_lets_survivors_decide() -> None:
    out = io.StringIO()
    res = launch(_script("sleep_worker.py", "--exit-after", "3"), nprocs=2, kill=[(0, 0.5)],
                 stdout=out, tolerate_kills=True)
    assert res.returncode == 0 and res.failed_rank is None
    text = out.getvalue()
    assert "[1] DONE" in text and "[0] DONE" not in text


def test_invalid_arguments_raise_config_error() -> None:
    from shoal.errors import ConfigError

    with pytest.raises(ConfigError, match="nprocs"):
        launch([PY, "x.py"], nprocs=0)
    with pytest.raises(ConfigError, match="kill rank"):
        launch([PY, "x.py"], nprocs=2, kill=[(2, 1.0)])
    with pytest.raises(ConfigError, match="argv"):
        launch("python x.py", nprocs=1)  # type: ignore[arg-type]


@pytest.mark.timeout(90)
def test_cli_gloo_all_reduce_two_workers(tmp_path: Path) -> None:
    # The launcher forked from the fork server (no torch import of its own); its workers are fresh interpreters.
    code, out = shoal_forked(["run", "-n", "2", str(SCRIPTS / "allreduce_worker.py")], _cli_env(),
                             tmp_path / "launcher.log", 80)
    assert code == 0, out
    for r in range(2):
        assert re.search(rf"^\[{r}\] SUM 3 3 HOST ", out, re.M), out


@pytest.mark.timeout(60)
def test_cli_module_mode_and_exit_code() -> None:
    proc = subprocess.run([PY, "-m", "shoal.run", "--nproc-per-node", "2", "-m", "json.tool", "--no-such-flag"],
                          capture_output=True, text=True, timeout=50, env=_cli_env())
    assert proc.returncode == 2, proc.stderr  # json.tool's argparse error, propagated
    # The first rank to fail stops the other (fail-fast), which may not have printed its usage yet.
    assert re.search(r"^\[[01]\] usage:", proc.stderr, re.M), proc.stderr
    assert re.search(r"rank [01] exited with code 2", proc.stderr), proc.stderr


@pytest.mark.timeout(30)
def test_cli_rejects_bad_kill_spec(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: the refusal comes before the launcher starts anything (no interpreter start-up to wait for).
    code, _, err = shoal_cli(["run", "-n", "2", "--kill", "1at5", "x.py"], capsys)
    assert code == 2 and "RANK@SECONDS" in err, err


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_stops_workers(tmp_path: Path) -> None:
    # The launcher forked from the fork server (no torch import of its own), in its own session.
    log = tmp_path / "launcher.log"
    proc = Forked(["-m", "shoal", "run", "-n", "2", str(SCRIPTS / "sleep_worker.py")], _cli_env(), str(log))
    try:
        pids = _read_ready_pids(proc, log, 2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM
        time.sleep(0.2)
        assert not any(_pid_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _read_ready_pids(proc: Forked, log: Path, n: int) -> list[int]:
    """Wait until ``n`` workers said READY in ``log`` (the caller's pytest timeout bounds this)."""
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""   # the child creates it when it runs
        pids = [int(p) for p in re.findall(r"READY pid=(\d+)", text)]
        if len(pids) >= n:
            return pids
        if proc.poll() is not None:
            raise AssertionError(f"launcher ended before {n} workers were ready: "
                                 f"{log.read_text(errors='replace') if log.exists() else '(no log)'}")
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_launch_reports_that_it_was_interrupted() -> None:
    """A caller running several launches (shoal bench) must know to stop."""
    import threading

    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        res = launch([sys.executable, "-c", "import time; time.sleep(30)"], nprocs=2, quiet=True,
                     stdout=io.StringIO())
    finally:
        timer.cancel()
    assert res.interrupted and res.returncode == 143
