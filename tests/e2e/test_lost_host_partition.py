"""A whole host lost, and a host cut off by a partition, on an emulated cluster (root, ip and tc).

Three emulated hosts at 50 mbit: host 0 runs the coordinator and rank 0, host 1
rank 1, host 2 ranks 2 and 3 (one process group: the host's processes).
Each worker logs every step as it happens (tests/e2e/host_worker.py), so the
checks read what each process committed, also one that never finished:

- lost host: ranks 2 and 3 park at a known step and are SIGKILLed together
  (their process group); ranks 0 and 1 go on and commit steps alone; then the
  host's workers are restarted, admitted, healed, and all four end equal.
- partition: host 2's link goes down for 20 s (``ip link set ... down`` in
  its namespace) and comes back. The side with the coordinator goes on; the
  cut-off side commits no step on its own (every committed step of the run
  has one quorum and one resulting state); when the link is back its
  workers, the same processes, rejoin as newcomers, are healed, and all four end equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from emulated import NEEDS_CLUSTER

pytestmark = NEEDS_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "e2e" / "host_worker.py"
TOKEN = "lost-host-e2e-token"
HOST_OF = {0: 0, 1: 1, 2: 2, 3: 2}   # rank -> emulated host


class Run:
    """The four workers of one test, started in their hosts' namespaces; kills what it started on exit."""

    def __init__(self, emu: Any, coordinator: str, out: Path, args: list[str]) -> None:
        self.emu, self.out, self.args = emu, out, args
        self.env = {**os.environ, "SHOAL_COORDINATOR": coordinator, "SHOAL_RUN_ID": uuid.uuid4().hex[:8],
                    "SHOAL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "faults")])}
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}

    def start(self, rank: int, life: int, group_of: int | None = None) -> subprocess.Popen[bytes]:
        """Start ``rank``'s incarnation ``life``; in the process group of ``group_of``'s process if given."""
        host = HOST_OF[rank]
        # A process group of its own (0: its pid), or the one of ``group_of``'s process (same session).
        where = {"process_group": self.procs[group_of, life].pid if group_of is not None else 0}
        with open(self.out / f"out-{rank}-{life}.txt", "wb") as f:
            p = subprocess.Popen(self.emu.exec_prefix(host) + [sys.executable, str(WORKER), "--out", str(self.out),
                                                               *self.args],
                                 env={**self.env, "RANK": str(rank), "SHOAL_RESTART": str(life),
                                      "GLOO_SOCKET_IFNAME": self.emu.interface(host),
                                      "SHOAL_HOST_ID": f"host-{host}"},
                                 stdout=f, stderr=subprocess.STDOUT, **where)  # type: ignore[call-overload]
        self.procs[rank, life] = p
        return p

    def start_host2(self, life: int) -> None:
        """Ranks 2 and 3, one process group (what a machine's death kills at once)."""
        self.start(2, life)
        self.start(3, life, group_of=2)

    def steps(self, rank: int, life: int) -> list[dict[str, Any]]:
        try:
            lines = (self.out / f"steps-{rank}-{life}.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def outputs(self) -> str:
        return "\n".join(f"=== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.out.glob("out-*.txt")))

    def wait_for(self, what: str, ok: Callable[[], bool], limit: float) -> None:
        deadline = time.monotonic() + limit
        while not ok():
            dead = [k for k, p in self.procs.items() if p.poll() not in (None, 0, -signal.SIGKILL)]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {limit} s (failed: {dead})\n{self.outputs()}")
            time.sleep(0.05)

    def finish(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        for key, p in self.procs.items():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker {key} still running after {limit} s\n{self.outputs()}") from None

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    def result(self, rank: int, life: int) -> dict[str, Any]:
        return torch.load(self.out / f"{rank}-{life}.pt", weights_only=False)


def _commits(recs: list[dict[str, Any]], after: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in recs if r["committed"] and r["t"] > after]


def _assert_one_history(logs: list[list[dict[str, Any]]]) -> None:
    """No split brain: every committed step of the run was committed by one quorum, to one state."""
    seen: dict[int, tuple[int, float]] = {}
    for recs in logs:
        for r in _commits(recs):
            got = (r["qid"], r["digest"])
            assert seen.setdefault(r["step"], got) == got, \
                f"step {r['step']} committed twice: (quorum, digest) {seen[r['step']]} and {got}"
            assert r["member"] in r["members"] and len(r["members"]) == r["size"], r


def _assert_all_equal(run: Run, finals: list[tuple[int, int]]) -> None:
    res = [run.result(rank, life) for rank, life in finals]
    last = [r["log"][-1] for r in res]
    assert {e["step"] for e in last} == {last[0]["step"]} and {e["size"] for e in last} == {4}, last
    for r in res[1:]:
        for k, v in res[0]["model"].items():
            assert torch.equal(v, r["model"][k]), f"{k} differs between rank {res[0]['rank']} and {r['rank']}"
    assert len({e["digest"] for e in last}) == 1, last


def _cluster(tmp_path: Path) -> Any:
    from shoal.cli.cluster import ClusterSpec, EmulatedCluster
    return EmulatedCluster(ClusterSpec(3, 1, ("50mbit",)))


def _coordinator(emu: Any) -> Any:
    from shoal.cli.elastic_launch import NamespacedCoordinator
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return NamespacedCoordinator(emu, host=0, initial_workers=4, env=env, token=TOKEN)


def _no_leftovers(emu: Any) -> None:
    from shoal.cli.cluster import list_namespaces
    left = [n for n in list_namespaces() if n.startswith(f"shoal-{emu.pid}-{emu.run_id}-")]
    assert left == [], f"namespaces left behind: {left}"


PARK = 4


@pytest.mark.timeout(150)
def test_a_lost_host_costs_the_survivors_one_step_and_its_workers_rejoin(tmp_path: Path) -> None:
    args = ["--steps", "12", "--want-size", "4", "--park-at", str(PARK), "--park-ranks", "2,3"]
    with _cluster(tmp_path) as emu, _coordinator(emu) as coord:
        run = Run(emu, coord.address, tmp_path, args)
        try:
            run.start(0, 0)
            run.start(1, 0)
            run.start_host2(0)
            run.wait_for("host 2's workers park", lambda: all((tmp_path / f"parked-{r}").exists() for r in (2, 3)),
                         limit=60)
            host2 = run.procs[2, 0]
            assert os.getpgid(run.procs[3, 0].pid) == host2.pid   # one process group: the host
            t_kill = time.time()
            os.killpg(host2.pid, signal.SIGKILL)
            # Survivors go on without the host: three steps committed by ranks 0 and 1 alone.
            run.wait_for("survivors commit alone",
                         lambda: all(len([r for r in _commits(run.steps(k, 0), t_kill) if r["size"] == 2]) >= 3
                                     for k in (0, 1)), limit=40)
            run.start_host2(1)
            run.finish(limit=60)
        finally:
            run.close()
        codes = {k: p.returncode for k, p in run.procs.items()}
        assert codes == {(0, 0): 0, (1, 0): 0, (2, 0): -signal.SIGKILL, (3, 0): -signal.SIGKILL,
                         (2, 1): 0, (3, 1): 0}, (codes, run.outputs())
    _no_leftovers(emu)
    logs = {k: run.steps(*k) for k in run.procs}
    _assert_one_history(list(logs.values()))
    for k in ((0, 0), (1, 0)):   # the step in flight at the kill is discarded, then they commit alone
        after = [r for r in logs[k] if r["t"] > t_kill]
        assert not after[0]["committed"] and after[0]["step"] == PARK, after[:3]
        assert [r["step"] for r in _commits(after)][:3] == [PARK + 1, PARK + 2, PARK + 3], after[:6]
    for k in ((2, 1), (3, 1)):   # admitted and healed: they begin at the run's step, not at 0
        res = run.result(*k)
        assert res["stats"]["heals_received"] >= 1, res["stats"]
        assert res["log"][0]["step"] > PARK + 3, res["log"][:2]
    _assert_all_equal(run, [(0, 0), (1, 0), (2, 1), (3, 1)])


CUT_S = 20.0   # the partition's length: longer than every timeout of the run (op 5 s, quorum 15 s)


@pytest.mark.timeout(180)
def test_a_partitioned_host_never_commits_alone_and_rejoins_when_its_link_returns(tmp_path: Path) -> None:
    args = ["--steps", "12", "--want-size", "4"]
    with _cluster(tmp_path) as emu, _coordinator(emu) as coord:
        run = Run(emu, coord.address, tmp_path, args)
        try:
            for rank in (0, 1):
                run.start(rank, 0)
            run.start_host2(0)
            run.wait_for("all four train", lambda: all(len(_commits(run.steps(r, 0))) >= PARK for r in range(4)),
                         limit=60)
            t_down = time.time()
            emu.set_link(2, False)
            try:
                # The side with the coordinator goes on: three steps committed by ranks 0 and 1 alone.
                run.wait_for("survivors commit alone",
                             lambda: all(len([r for r in _commits(run.steps(k, 0), t_down) if r["size"] == 2]) >= 3
                                         for k in (0, 1)), limit=CUT_S)
                time.sleep(max(t_down + CUT_S - time.time(), 0.0))
            finally:
                t_up = time.time()
                emu.set_link(2, True)
            run.finish(limit=100)
        finally:
            run.close()
        codes = {k: p.returncode for k, p in run.procs.items()}
        assert codes == {(r, 0): 0 for r in range(4)}, (codes, run.outputs())
    _no_leftovers(emu)
    logs = {r: run.steps(r, 0) for r in range(4)}
    _assert_one_history(list(logs.values()))
    for r in (2, 3):
        # The cut-off side committed nothing while cut off (its steps could not reach the vote) ...
        assert [e for e in _commits(logs[r]) if t_down < e["t"] < t_up] == [], logs[r]
        # ... and came back as a newcomer: dropped, joined again under a new member id, healed.
        before = [e for e in logs[r] if e["t"] < t_down]
        back = _commits(logs[r], t_up)
        assert back and back[0]["member"] != before[-1]["member"], (before[-1:], back[:1])
        assert run.result(r, 0)["stats"]["heals_received"] >= 1
    for r in (0, 1):
        assert len([e for e in _commits(logs[r]) if t_down < e["t"] < t_up and e["size"] == 2]) >= 3
    _assert_all_equal(run, [(r, 0) for r in range(4)])
