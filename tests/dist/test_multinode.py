"""One `shoal run` per machine (--nnodes/--node-rank/--master-addr), here as several launchers on loopback.

The emulated cluster, where each launcher runs in its own host's namespace, is tests/e2e/test_multinode_cluster.py.

Each launcher (``python -m shoal run ...``) is forked from the fork server of the fault tests' harness
(``harness.Forked``): the same command line in its own process and session, without a fresh interpreter's
torch import; the workers it starts are its own fresh interpreters, as under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def _finish(procs: list[Any], logs: list[Path], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit code and log, waiting at most ``timeout`` s for each; any left running is killed."""
    try:
        return [(p.wait(timeout=timeout), log.read_text(errors="replace") if log.exists() else "")
                for p, log in zip(procs, logs)]
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)   # its workers too: each leads its own session
                except ProcessLookupError:
                    pass


def _launchers(tmp: Path, nodes: list[dict[str, str]], extra_env: dict[str, str] | None = None,
               timeout: float = 90) -> list[tuple[int, str]]:
    """Start one `shoal run` per entry of ``nodes`` (its own options), each as its own process; (code, log)."""
    env = _env(**(extra_env or {}))
    procs, logs = [], []
    for i, opts in enumerate(nodes):
        argv = ["run"]
        for k, v in opts.items():
            argv += [f"--{k}", v]
        logs.append(tmp / f"launcher-{i}.log")
        procs.append(_shoal(argv + [str(WORKER), str(tmp)], env, logs[-1]))
    return _finish(procs, logs, timeout)


def _node(rank: int, nnodes: int, port: int, n: int, **more: str) -> dict[str, str]:
    return {"nnodes": str(nnodes), "node-rank": str(rank), "master-addr": "127.0.0.1", "master-port": str(port),
            "nproc-per-node": str(n), **more}


@pytest.mark.timeout(120)
def test_two_launchers_lay_out_ranks_node_by_node_and_train_as_one_run(tmp_path: Path) -> None:
    port = _free_port()
    # Node 1 starts first (it waits for node 0) and runs fewer workers than node 0.
    res = _launchers(tmp_path, [_node(1, 2, port, 1), _node(0, 2, port, 2)])
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
    port = _free_port()
    res = _launchers(tmp_path, [_node(0, 2, port, 2), _node(1, 2, port, 1)], extra_env={"FAIL_RANK": "2"})
    assert [c for c, _ in res] == [3, 3], res
    assert "node 1 rank 2 exited with code 3; stopping this machine's workers" in res[0][1], res[0][1]


@pytest.mark.timeout(120)
def test_a_failed_worker_on_node_0_gives_every_machine_its_exit_code(tmp_path: Path) -> None:
    port = _free_port()
    res = _launchers(tmp_path, [_node(0, 2, port, 1), _node(1, 2, port, 1)], extra_env={"FAIL_RANK": "0"})
    assert [c for c, _ in res] == [3, 3], res
    assert "node 0 rank 0 exited with code 3; stopping this machine's workers" in res[1][1], res[1][1]


@pytest.mark.timeout(120)
def test_ctrl_c_on_one_machine_stops_every_machine(tmp_path: Path) -> None:
    port = _free_port()
    env = _env(SLEEP_AFTER="60")
    files = [tmp_path / f"launcher-{r}.log" for r in (0, 1)]
    procs = [_shoal(["run", *sum(([f"--{k}", v] for k, v in _node(r, 2, port, 1).items()), []),
                     str(WORKER), str(tmp_path)], env, files[r]) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.json"))) < 2:  # both workers trained their step and now sleep
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGINT)
    finally:
        res = _finish(procs, files, 45)
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
    port = _free_port()
    other = {**_node(1, 2, port, 1), **second}
    res = _launchers(tmp_path, [_node(0, 2, port, 1), other], timeout=45)
    assert [c for c, _ in res] == [2, 2], res
    for _, log in res:
        assert message in log, log
    assert not list(tmp_path.glob("*.json")), "no worker may start when the launchers disagree"


@pytest.mark.timeout(60)
def test_a_second_launcher_with_a_taken_node_rank_is_refused(tmp_path: Path) -> None:
    # Node 1 twice: whichever claims second is refused. The run of the other two either starts (the
    # refusal came after they met) or stops with the refusal; it never trains with three launchers.
    port = _free_port()
    res = _launchers(tmp_path, [_node(1, 2, port, 1), _node(1, 2, port, 1), _node(0, 2, port, 1)], timeout=45)
    codes = [c for c, _ in res]
    refused = [log for c, log in res[:2] if "two launchers claim --node-rank 1" in log]
    assert len(refused) == 1 and sorted(codes[:2])[1] == 2, res
    assert set(codes) <= {0, 2}, res    # the refused launcher's done never ends the others' run (no 1)
    assert len(list(tmp_path.glob("*.json"))) in (0, 2), res


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


@pytest.mark.timeout(60)
def test_tasks_started_by_srun_take_their_ranks_from_slurm(tmp_path: Path) -> None:
    # What `srun` gives each task: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the batch script adds MASTER_*.
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_NTASKS="2", SLURM_STEP_ID="0")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (1, 0)]
    assert [p.wait(timeout=50) for p in procs] == [0, 0]
    recs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [(rec["rank"], rec["world"], rec["env"]["LOCAL_RANK"]) for rec in recs] == [(0, 2, "0"), (1, 2, "1")]
    assert recs[0]["grad"] == recs[1]["grad"]


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
