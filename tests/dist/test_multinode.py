"""One `shoal run` per machine (--nnodes/--node-rank/--master-addr), here as several launchers on loopback.

The emulated cluster, where each launcher runs in its own host's namespace, is tests/e2e/test_multinode_cluster.py.

Each launcher (``python -m shoal run ...``) is forked from the fork server of the fault tests' harness
(``harness.Forked``): the same command line in its own process and session, without a fresh interpreter's
torch import; the workers it starts are its own fresh interpreters, as under test.

Every run here takes its master port from ``_free_port()``, a port that was free a moment ago: under the
parallel suite another process can take it before node 0's launcher binds it (seen once in a fresh-clone
``make test``). Such a run starts again on a new port (:func:`_on_a_free_port`), as
``shoal.testing.procs.run_workers`` does; any other failure fails the test at once, with its logs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from shoal.cli.nodes import NodeSpec
from shoal.cli.supervise import _free_port
from shoal.errors import ConfigError

from cli_inprocess import shoal_cli

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "scripts" / "node_worker.py"
sys.path.insert(0, str(ROOT / "tests" / "faults"))
import harness  # noqa: E402


def _env(**more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONWARNINGS": "ignore", **more}


def _shoal(args: list[str], env: dict[str, str], log: Path) -> harness.Forked:
    """``python -m shoal ARGS`` forked from the fork server, stdout and stderr to ``log``."""
    return harness.Forked(["-m", "shoal", *args], env, str(log))


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _kill(procs: list[Any]) -> None:
    """SIGKILL each process still running with its process group (each leads its own session)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _finish(procs: list[Any], logs: list[Path], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit code and log, waiting at most ``timeout`` s for each; any left running is killed."""
    try:
        return [(p.wait(timeout=timeout), _read(log)) for p, log in zip(procs, logs)]
    finally:
        _kill(procs)


# How often a run starts again on a new port when the one _free_port() gave was taken before it was bound.
PORT_TRIES = 4
T = TypeVar("T")


class _PortTaken(Exception):
    """Another process took the master port between _free_port() and its bind (see _on_a_free_port)."""


def _launcher_port_taken(log: str, port: int) -> bool:
    """Node 0's launcher said another process holds ``port`` (shoal.cli.nodes names EADDRINUSE so)."""
    return f"port {port} is taken by another process" in log


def _store_port_taken(log: str, port: int) -> bool:
    """Rank 0's TCPStore (a worker started without a launcher) could not listen on ``port``: EADDRINUSE."""
    return f"port: {port}," in log and "EADDRINUSE" in log


@dataclass
class _Try:
    """The processes of one try on ``port``, each with its log. ``binder`` (an index) is the one that binds
    the port: node 0's launcher, or rank 0 of workers started without one; ``taken`` reads from its log
    whether another process held the port."""

    procs: list[Any]
    logs: list[Path]
    port: int
    binder: int
    taken: Callable[[str, int], bool] = _launcher_port_taken

    def check_port(self) -> None:
        """Raise _PortTaken, killing every process of this try, once the binder ended saying another process
        holds the port: the others would wait for it (a TCPStore client of whatever listens there may wait
        forever), and no worker can have started without it."""
        if self.procs[self.binder].poll() in (None, 0):
            return
        log = _read(self.logs[self.binder])
        if self.taken(log, self.port):
            _kill(self.procs)
            for p in self.procs:
                p.wait(timeout=10)
            raise _PortTaken(f"port {self.port}, {self.logs[self.binder].name}:\n{log}")

    def finish(self, timeout: float) -> list[tuple[int, str]]:
        """Each process's exit code and log once all ended, within ``timeout`` s in all; _PortTaken as soon
        as the port was taken; past ``timeout``, every process is killed and the error shows every log."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            self.check_port()
            time.sleep(0.05)
        self.check_port()
        running = [log.name for p, log in zip(self.procs, self.logs) if p.poll() is None]
        if running:
            _kill(self.procs)
            raise AssertionError(f"{', '.join(running)} still running after {timeout:g} s (killed):\n"
                                 + "\n".join(f"--- {log.name}:\n{_read(log)}" for log in self.logs))
        return _finish(self.procs, self.logs, 10)


def _on_a_free_port(attempt: Callable[[int], T]) -> T:
    """``attempt(port)`` on a port from _free_port(); while it raises _PortTaken, again on a new port.

    A taken port stops the run before any worker starts (node 0 serves no rendezvous; rank 0's store is
    what the other ranks wait for), so starting over changes nothing the test checks. Only that failure
    is retried: any other exception, and any exit code, is the attempt's own.
    """
    taken = []
    for _ in range(PORT_TRIES):
        try:
            return attempt(_free_port())
        except _PortTaken as e:
            taken.append(str(e))
    raise AssertionError(f"the master port was taken by another process on each of {PORT_TRIES} tries:\n"
                         + "\n".join(taken))


def _start(tmp: Path, nodes: list[dict[str, str]], env: dict[str, str]) -> _Try:
    """Start one `shoal run` per entry of ``nodes`` (its own options, one master port), each as its own
    process with its log ``launcher-I.log``."""
    procs, logs = [], []
    for i, opts in enumerate(nodes):
        argv = ["run"]
        for k, v in opts.items():
            argv += [f"--{k}", v]
        logs.append(tmp / f"launcher-{i}.log")
        procs.append(_shoal(argv + [str(WORKER), str(tmp)], env, logs[-1]))
    ports = {opts["master-port"] for opts in nodes}
    assert len(ports) == 1, f"one master port per run, got {ports}"
    return _Try(procs, logs, int(ports.pop()), [opts["node-rank"] for opts in nodes].index("0"))


def _launchers(tmp: Path, nodes: Callable[[int], list[dict[str, str]]], extra_env: dict[str, str] | None = None,
               timeout: float = 90) -> list[tuple[int, str]]:
    """One `shoal run` per entry of ``nodes(port)``, each as its own process; (code, log) of each. Started
    again on a new port when node 0's launcher found the port taken (_on_a_free_port)."""
    env = _env(**(extra_env or {}))
    return _on_a_free_port(lambda port: _start(tmp, nodes(port), env).finish(timeout))


def _node(rank: int, nnodes: int, port: int, n: int, **more: str) -> dict[str, str]:
    return {"nnodes": str(nnodes), "node-rank": str(rank), "master-addr": "127.0.0.1", "master-port": str(port),
            "nproc-per-node": str(n), **more}


@pytest.mark.timeout(120)
def test_two_launchers_lay_out_ranks_node_by_node_and_train_as_one_run(tmp_path: Path) -> None:
    # Node 1 starts first (it waits for node 0) and runs fewer workers than node 0.
    res = _launchers(tmp_path, lambda port: [_node(1, 2, port, 1), _node(0, 2, port, 2)])
    assert [c for c, _ in res] == [0, 0], res
    recs = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)}
    for r, rec in recs.items():
        e = rec["env"]
        assert rec["world"] == 3 and e["WORLD_SIZE"] == "3" and e["RANK"] == str(r)
        node, local = (0, r) if r < 2 else (1, 0)
        assert e["GROUP_RANK"] == str(node) and e["GROUP_WORLD_SIZE"] == "2" and e["LOCAL_RANK"] == str(local)
        assert e["LOCAL_WORLD_SIZE"] == ("2" if node == 0 else "1")
        assert e["SHOAL_ADVERTISE_ADDR"] == "127.0.0.1" and e["GLOO_SOCKET_IFNAME"] == "lo"
    # The gradient is the mean over the three ranks' batches: the same on every rank, and equal to a
    # single-process reference built from the same weights and per-rank seeds.
    w = torch.tensor(recs[0]["weight0"])
    ref = torch.zeros_like(w)
    for r in range(3):
        torch.manual_seed(100 + r)
        x = torch.randn(3, 4)
        ref += x.sum(0).expand_as(w) / 3  # d/dW sum(W x + b) = x summed over the batch, per output row
    for rec in recs.values():
        torch.testing.assert_close(torch.tensor(rec["grad"]), ref)
    assert "node 0/2: ranks 0..1 of 3, advertising 127.0.0.1 on lo" in res[1][1]


@pytest.mark.timeout(120)
def test_a_failed_worker_on_one_machine_stops_every_machine(tmp_path: Path) -> None:
    res = _launchers(tmp_path, lambda port: [_node(0, 2, port, 2), _node(1, 2, port, 1)],
                     extra_env={"FAIL_RANK": "2"})
    assert [c for c, _ in res] == [3, 3], res
    assert "node 1 rank 2 exited with code 3; stopping this machine's workers" in res[0][1], res[0][1]


@pytest.mark.timeout(120)
def test_a_failed_worker_on_node_0_gives_every_machine_its_exit_code(tmp_path: Path) -> None:
    res = _launchers(tmp_path, lambda port: [_node(0, 2, port, 1), _node(1, 2, port, 1)],
                     extra_env={"FAIL_RANK": "0"})
    assert [c for c, _ in res] == [3, 3], res
    assert "node 0 rank 0 exited with code 3; stopping this machine's workers" in res[1][1], res[1][1]


@pytest.mark.timeout(120)
def test_ctrl_c_on_one_machine_stops_every_machine(tmp_path: Path) -> None:
    env = _env(SLEEP_AFTER="60")

    def attempt(port: int) -> list[tuple[int, str]]:
        run = _start(tmp_path, [_node(r, 2, port, 1) for r in (0, 1)], env)
        try:
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob("*.json"))) < 2:  # both workers trained their step and now sleep
                run.check_port()
                assert time.monotonic() < deadline and all(p.poll() is None for p in run.procs)
                time.sleep(0.1)
            run.procs[1].send_signal(signal.SIGINT)
        finally:
            res = run.finish(45)
        return res

    res = _on_a_free_port(attempt)
    logs = [log for _, log in res]
    assert [c for c, _ in res] == [130, 130], logs
    assert "node 1's launcher got signal 2; stopping this machine's workers" in logs[0], logs[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second, message", [
    ({"nnodes": "3"}, "was started with --nnodes"),
    ({"run-id": "other-run"}, "was started with --run-id"),
])
def test_launchers_that_disagree_stop_before_any_worker_starts(tmp_path: Path, second: dict[str, str],
                                                               message: str) -> None:
    res = _launchers(tmp_path, lambda port: [_node(0, 2, port, 1), {**_node(1, 2, port, 1), **second}], timeout=45)
    assert [c for c, _ in res] == [2, 2], res
    for _, log in res:
        assert message in log, log
    assert not list(tmp_path.glob("*.json")), "no worker may start when the launchers disagree"


@pytest.mark.timeout(60)
def test_a_second_launcher_with_a_taken_node_rank_is_refused(tmp_path: Path) -> None:
    # Node 1 twice: whichever claims second is refused. The run of the other two either starts (the
    # refusal came after they met) or stops with the refusal; it never trains with three launchers.
    res = _launchers(tmp_path, lambda port: [_node(1, 2, port, 1), _node(1, 2, port, 1), _node(0, 2, port, 1)],
                     timeout=45)
    codes = [c for c, _ in res]
    # The refused one says so; a launcher that stopped for it says "the run stopped before it started: ..."
    # (then every launcher stops: one compare-and-set in the store decides start or refusal for all).
    said = [log for c, log in res if "two launchers claim --node-rank 1" in log]
    refused = [log for log in said if "stopped before it started" not in log]
    assert len(refused) == 1 and sorted(codes[:2])[1] == 2, res
    assert len(said) in (1, 3), res   # the run started (only the refused one says it) or nobody started
    assert set(codes) <= {0, 2}, res    # the refused launcher's done never ends the others' run (no 1)
    assert len(list(tmp_path.glob("*.json"))) in (0, 2), res


def _listening() -> socket.socket:
    """A socket that holds a loopback port as another test's server would: bound and listening."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def _ports_given(monkeypatch: pytest.MonkeyPatch, first: list[int]) -> list[int]:
    """Make _free_port() give the ports of ``first``, then fresh ones; the list of every port it gave."""
    given: list[int] = []
    fresh = _free_port

    def port() -> int:
        given.append(first[len(given)] if len(given) < len(first) else fresh())
        return given[-1]

    monkeypatch.setattr(sys.modules[__name__], "_free_port", port)
    return given


@pytest.mark.timeout(120)
def test_a_master_port_taken_before_node_0_binds_it_is_replaced(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The first port is held by a listener, as another test's server would hold it. Node 1 starts first and
    # connects to that listener (a TCPStore client there waits for an answer that never comes); node 0
    # cannot bind and says the port is taken; both go, and the run starts again on a fresh port. There
    # the launchers meet and find they disagree (--nnodes; no worker starts): the run's own result.
    held = _listening()
    given = _ports_given(monkeypatch, [held.getsockname()[1]])
    try:
        res = _launchers(tmp_path, lambda port: [{**_node(1, 2, port, 1), "nnodes": "3"}, _node(0, 2, port, 1)],
                         timeout=45)
    finally:
        held.close()
    assert len(given) == 2 and given[0] != given[1], given
    assert [c for c, _ in res] == [2, 2] and all("was started with --nnodes" in log for _, log in res), res


@pytest.mark.timeout(60)
def test_another_failure_of_node_0_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Node 0 fails before it binds, for a reason of its own (an address this machine does not hold): one
    # try, and its result is the run's.
    given = _ports_given(monkeypatch, [])
    res = _launchers(tmp_path, lambda port: [_node(0, 2, port, 1, **{"advertise-addr": "203.0.113.5"})], timeout=45)
    assert len(given) == 1, given
    assert res[0][0] == 2 and "cannot listen on the advertised address 203.0.113.5" in res[0][1], res


def test_the_retry_gives_up_after_its_tries_and_passes_other_errors_on(monkeypatch: pytest.MonkeyPatch) -> None:
    given = _ports_given(monkeypatch, [])

    def taken(port: int) -> None:
        raise _PortTaken(f"port {port}")

    with pytest.raises(AssertionError, match=f"taken by another process on each of {PORT_TRIES} tries"):
        _on_a_free_port(taken)
    assert len(given) == PORT_TRIES

    def broken(port: int) -> None:
        raise RuntimeError("not a port")

    given.clear()
    with pytest.raises(RuntimeError, match="not a port"):
        _on_a_free_port(broken)
    assert len(given) == 1


def test_a_loopback_address_is_refused_when_the_master_is_remote() -> None:
    # 203.0.113.0/24 is a documentation range: nothing is sent there (the advertised address is given).
    spec = NodeSpec(nnodes=2, node_rank=1, master_addr="203.0.113.5", advertise_addr="127.0.0.1")
    with pytest.raises(ConfigError, match="loopback address.*--advertise-addr"):
        spec.address()
    # All launchers on one machine (the master on loopback) may use loopback.
    assert NodeSpec(nnodes=2, node_rank=1, master_addr="127.0.0.1").address() == "127.0.0.1"


@pytest.mark.parametrize("kw, message", [
    ({"nnodes": 0, "node_rank": 0}, "nnodes must be an integer >= 1"),
    ({"nnodes": 2, "node_rank": 2}, r"node_rank 2 is outside \[0, nnodes=2\)"),
    ({"nnodes": 2, "node_rank": 0, "master_port": 70000}, "master_port must be <= 65535"),
    ({"nnodes": 2, "node_rank": 0, "master_addr": ""}, "master_addr is empty"),
])
def test_node_spec_is_validated(kw: dict[str, object], message: str) -> None:
    args = {"master_addr": "127.0.0.1", **kw}
    with pytest.raises(ConfigError, match=message):
        NodeSpec(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("opts, message", [
    (["--nnodes", "2"], "needs --node-rank, --master-addr as well"),
    (["--elastic", "--coordinator", "10.0.0.9:29400", "--node-rank", "1"], "needs both --nnodes"),
    (["--elastic", "--coordinator", "10.0.0.9", "--nnodes", "2", "--node-rank", "1"], "expects HOST:PORT"),
    (["--elastic", "--coordinator", "10.0.0.9:29400", "--master-addr", "10.0.0.1"], "instead of --master-addr"),
])
@pytest.mark.timeout(60)
def test_cli_names_what_a_run_across_machines_lacks(tmp_path: Path, opts: list[str], message: str,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: the refusal comes from the argument checks, before the launcher starts anything.
    monkeypatch.setenv("SHOAL_TOKEN", "t" * 24)
    code, _, err = shoal_cli(["run", *opts, str(WORKER), str(tmp_path)], capsys)
    assert code == 2 and message in err, err


@pytest.mark.timeout(120)
def test_a_worker_started_by_torchrun_joins_an_elastic_run_of_shoal_run(tmp_path: Path) -> None:
    # A standalone coordinator; one machine's worker comes from `shoal run --elastic --coordinator`, the
    # other's from torchrun with the elastic variables in its environment (no shoal launcher at all).
    from shoal.membership.coordinator import Coordinator

    token, run = "torchrun-joins-token", "mixed-launchers"
    coord = Coordinator(port=0, initial_workers=2, token=token).start()
    worker = [str(ROOT / "tests" / "faults" / "elastic_worker.py"), "--out", str(tmp_path), "--steps", "6",
              "--op", "20", "--min-workers", "2"]
    env = _env(SHOAL_TOKEN=token)
    # torchrun stays a fresh interpreter (its own launcher, not shoal's code); the shoal launcher is forked.
    torchrun = str(Path(sys.executable).parent / "torchrun")
    files = [tmp_path / "shoal-run.log", tmp_path / "torchrun.log"]
    try:
        procs: list[Any] = [_shoal(["run", "--elastic", "--coordinator", coord.address, "--nnodes", "2",
                                    "--node-rank", "1", "--run-id", run, "-n", "1", *worker], env, files[0])]
        with open(files[1], "w") as tr_log:
            procs.append(subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "1", *worker],
                                          env={**env, "SHOAL_COORDINATOR": coord.address, "SHOAL_RUN_ID": run},
                                          stdout=tr_log, stderr=subprocess.STDOUT, start_new_session=True))
        res = _finish(procs, files, 90)
    finally:
        coord.stop()
    logs = [log for _, log in res]
    assert [c for c, _ in res] == [0, 0], logs
    a, b = (torch.load(tmp_path / f"{r}-0.pt", weights_only=False) for r in (0, 1))
    assert a["log"][-1]["size"] == b["log"][-1]["size"] == 2, logs
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def _srun_tasks(tmp: Path) -> list[tuple[int, str]]:
    """Two tasks as `srun` starts them (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the batch script adds
    MASTER_*), rank 1 first, without a launcher: rank 0's TCPStore binds the master port; (code, log) of each.
    Started again on a new port when rank 0 found the port taken (_on_a_free_port)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore",
               MASTER_ADDR="127.0.0.1", SLURM_NTASKS="2", SLURM_STEP_ID="0")

    def attempt(port: int) -> list[tuple[int, str]]:
        logs = [tmp / f"task-{r}.log" for r in (1, 0)]
        procs = []
        for r, log in zip((1, 0), logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp)], stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True,
                                              env={**env, "MASTER_PORT": str(port), "SLURM_PROCID": str(r),
                                                   "SLURM_LOCALID": str(r)}))
        return _Try(procs, logs, port, binder=1, taken=_store_port_taken).finish(50)

    return _on_a_free_port(attempt)


def _check_srun_records(tmp: Path) -> None:
    recs = [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]
    assert [(rec["rank"], rec["world"], rec["env"]["LOCAL_RANK"]) for rec in recs] == [(0, 2, "0"), (1, 2, "1")]
    assert recs[0]["grad"] == recs[1]["grad"]


@pytest.mark.timeout(60)
def test_tasks_started_by_srun_take_their_ranks_from_slurm(tmp_path: Path) -> None:
    res = _srun_tasks(tmp_path)
    assert [c for c, _ in res] == [0, 0], res
    _check_srun_records(tmp_path)


@pytest.mark.timeout(90)
def test_srun_tasks_whose_master_port_was_taken_start_again_on_another(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0's store cannot bind the held port (EADDRINUSE in its traceback); rank 1, a client of the
    # listener there, is stopped with it; the second port serves the run.
    held = _listening()
    given = _ports_given(monkeypatch, [held.getsockname()[1]])
    try:
        res = _srun_tasks(tmp_path)
    finally:
        held.close()
    assert len(given) == 2 and given[0] != given[1], given
    assert [c for c, _ in res] == [0, 0], res
    _check_srun_records(tmp_path)


def test_the_batch_script_itself_is_no_srun_task(monkeypatch: pytest.MonkeyPatch) -> None:
    # In the batch step SLURM_PROCID=0 and SLURM_NTASKS=N too, but no SLURM_STEP_ID: init() must not wait
    # for N ranks there; it says what is missing instead.
    from shoal.comm import world
    from shoal.errors import ShoalError

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ShoalError, match="RANK, WORLD_SIZE"):
        world.init(timeout=5)
