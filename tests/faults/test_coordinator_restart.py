"""The coordinator may fail (issue #21): a standalone `shoal coordinator` SIGKILLed mid-run, restarted 10 s later.

Three workers (plain processes, never restarted) train through the outage
with the quorum they have: their votes go peer to peer while the store is
gone (shoal.membership.vote.peer_vote). The restarted coordinator (same
port, same token, empty store) learns the members from their
re-announcements (shoal.membership.reclaim / recovery); a fourth worker that
starts after the restart is admitted and healed. At the end every worker
exited 0 in its first life, all hold one state, and each said once that the
coordinator was lost.
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

import pytest
import torch

from shoal.cli.supervise import _free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOKEN = "coordinator-restart-token"


def _coordinator(port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHOAL_TOKEN": TOKEN}
    env.pop("SHOAL_ELASTIC_TRACE", None)
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "shoal", "coordinator", "--port", str(port),
                                 "--initial-workers", "3"], env=env, stdout=f, stderr=subprocess.STDOUT)


def _votes(trace: Path) -> list[dict[str, object]]:
    """Every worker's vote events (their trace files), each with the worker's pid."""
    out: list[dict[str, object]] = []
    for f in trace.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            ev = json.loads(line)
            if ev["ev"] == "vote":
                out.append({**ev, "pid": int(f.stem)})
    return out


def _wait(cond, limit: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


@pytest.mark.timeout(200)
def test_coordinator_killed_and_restarted_the_run_goes_on_and_admits_a_join(tmp_path: Path) -> None:
    port, trace = _free_port(), tmp_path / "trace"
    trace.mkdir()
    coord_log = tmp_path / "coordinator.txt"
    coord = _coordinator(port, coord_log)
    env = {**os.environ, "SHOAL_TOKEN": TOKEN, "SHOAL_COORDINATOR": f"127.0.0.1:{port}",
           "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SHOAL_ELASTIC_TRACE": str(trace), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    args = ["--out", str(tmp_path), "--steps", "20", "--op", "10", "--min-workers", "2", "--pace", "0.05",
            "--want-size", "4", "--max-steps", "3000"]
    workers: dict[int, subprocess.Popen[bytes]] = {}

    def start(rank: int) -> None:
        with open(tmp_path / f"log-{rank}.txt", "wb") as f:
            workers[rank] = subprocess.Popen([sys.executable, str(HERE / "elastic_worker.py"), *args],
                                             env={**env, "RANK": str(rank)}, stdout=f, stderr=subprocess.STDOUT)

    def committed_after(t: float) -> set[int]:
        return {int(v["pid"]) for v in _votes(trace) if str(v["verdict"]).startswith("commit") and float(v["t"]) > t}  # type: ignore[arg-type]

    try:
        for r in range(3):
            start(r)
        _wait(lambda: len(committed_after(0.0)) == 3, 90, "the three workers never trained")
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        killed = time.time()
        time.sleep(10)
        down = committed_after(killed + 1.0)   # a second for the last votes through the store to end
        alive = [r for r, p in workers.items() if p.poll() is None]
        coord = _coordinator(port, coord_log)
        restarted = time.time()
        _wait(lambda: "re-announced" in coord_log.read_text(), 60, "no worker re-announced itself")
        start(3)
        for p in workers.values():
            p.wait(timeout=120)
    finally:
        for p in [*workers.values(), coord]:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"=== {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(tmp_path.glob("*.txt")))
    assert alive == [0, 1, 2], logs                      # nobody died while the coordinator was down
    assert len(down) == 3, (down, logs)                  # and all three kept committing steps meanwhile
    assert [p.returncode for p in workers.values()] == [0, 0, 0, 0], logs
    results = [torch.load(tmp_path / f"{r}-0.pt", weights_only=False) for r in range(4)]   # first lives only
    assert all(r["log"][-1]["size"] == 4 for r in results), logs   # the joiner was admitted
    assert results[3]["stats"]["heals_received"] >= 1, logs
    assert any(e["committed"] and e["t"] > restarted for e in results[3]["log"]), logs
    for r in results[1:]:
        for k, v in results[0]["model"].items():
            assert torch.equal(v, r["model"][k]), (k, logs)
        assert results[0]["log"][-1]["digest"] == r["log"][-1]["digest"], logs
    for r in range(3):
        assert (tmp_path / f"log-{r}.txt").read_text().count("lost the coordinator") == 1, logs


def test_a_restarted_coordinator_admits_only_claims_that_verify() -> None:
    # Ticked by hand: each claim's step lands at a known point. A wrong proof of the token is denied; a
    # holder of the token who hands in a quorum the coordinator never signed is denied; a real member's
    # claim is admitted under its old id and a new quorum (after the claimed one) is published for it.
    from shoal.membership import auth
    from shoal.membership.coordinator import Coordinator, Timeouts, connect
    from shoal.membership.records import RecordBook
    from shoal.membership.recovery import quorum_text

    t = Timeouts(op=5.0, heartbeat_interval=0.05, probe=0.3, heartbeat_timeout=2.0, quorum=30.0, join=40.0)
    coord = Coordinator(port=0, token=TOKEN, join_grace=0.0)
    run = "reclaimed"
    try:
        st = connect(coord.address, 10.0)
        st.set(f"runs/{st.add('runs/n', 1)}", run)

        def claim(member: int, token: str) -> str:
            st.set(f"{run}/claims/{st.add(f'{run}/claims/n', 1)}", str(member))
            coord.tick(time.monotonic())
            nonce = st.get(f"{run}/claim/{member}/nonce").decode()
            st.set(f"{run}/claim/{member}/proof", auth.answer(token, f"{run}/{member}/claim", nonce))
            coord.tick(time.monotonic())
            return st.get(f"{run}/claim/{member}/verdict").decode()

        def records(member: int, qid: int, mac: str) -> None:
            book = RecordBook(st, run, member, TOKEN)
            st.add(f"{run}/hb/{member}", 1)
            st.set(f"{run}/join/{member}", book.seal({"timeouts": vars(t), "min_workers": 1}))
            prefix = f"{run}/q{qid}/"
            st.set(f"{run}/claimrec/{member}",
                   book.seal({"quorum": {"qid": qid, "members": [member], "prefix": prefix, "mac": mac}}))
            coord.tick(time.monotonic())

        assert claim(5, "not-the-run-token") == "denied"
        assert claim(6, TOKEN) == "ok"
        records(6, 3, mac="0" * 64)                            # a quorum the coordinator never signed
        assert st.get(f"{run}/claim/6/verdict") == b"denied"
        assert claim(7, TOKEN) == "ok"
        records(7, 3, mac=auth.sign(TOKEN, quorum_text(3, [7], f"{run}/q3/")))
        coord.tick(time.monotonic())
        assert st.add(f"{run}/q/latest", 0) == 4               # a new quorum after the claimed one
        assert json.loads(st.get(f"{run}/q/4"))["members"] == [7]
        assert st.add(f"{run}/next_id", 0) >= 7                # newcomers never take a live member's id
    finally:
        coord.stop()


@pytest.mark.timeout(150)
def test_a_membership_change_waits_for_a_dead_coordinator_then_fails_clearly(tmp_path: Path) -> None:
    # The coordinator dies for good, then a worker is lost: the survivors cannot form a quorum without it,
    # wait Timeouts.quorum (op + 10 s in the worker) and stop with an error that says what to do.
    port, trace = _free_port(), tmp_path / "trace"
    trace.mkdir()
    coord = _coordinator(port, tmp_path / "coordinator.txt")
    env = {**os.environ, "SHOAL_TOKEN": TOKEN, "SHOAL_COORDINATOR": f"127.0.0.1:{port}",
           "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SHOAL_ELASTIC_TRACE": str(trace), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    args = ["--out", str(tmp_path), "--steps", "100000", "--op", "3", "--min-workers", "2", "--pace", "0.05"]
    workers = [subprocess.Popen([sys.executable, str(HERE / "elastic_worker.py"), *args], env={**env, "RANK": str(r)},
                                stdout=open(tmp_path / f"log-{r}.txt", "wb"), stderr=subprocess.STDOUT)
               for r in range(3)]
    try:
        _wait(lambda: len({v["pid"] for v in _votes(trace) if str(v["verdict"]).startswith("commit")}) == 3, 90,
              "the three workers never trained")
        coord.kill()
        coord.wait()
        time.sleep(1.0)
        workers[2].kill()
        t0 = time.monotonic()
        codes = [p.wait(timeout=60) for p in workers[:2]]
        waited = time.monotonic() - t0
    finally:
        for p in [*workers, coord]:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"log-{r}.txt").read_text(errors="replace") for r in range(2)]
    assert all(c != 0 for c in codes), logs
    for log in logs:
        assert "is unreachable and this worker" in log and "Restart the coordinator" in log, log
    assert waited >= 13.0 - 1.0, waited      # it waited Timeouts.quorum (13 s) for the coordinator first


@pytest.mark.timeout(200)
def test_a_worker_lost_while_the_coordinator_is_down_is_left_out_once_it_is_back(tmp_path: Path) -> None:
    # The change arrives while the coordinator is down: the survivors wait for it (no restart of theirs);
    # the restarted coordinator hears from them only, leaves the lost worker out, and they finish as one.
    port, trace = _free_port(), tmp_path / "trace"
    trace.mkdir()
    coord_log = tmp_path / "coordinator.txt"
    coord = _coordinator(port, coord_log)
    env = {**os.environ, "SHOAL_TOKEN": TOKEN, "SHOAL_COORDINATOR": f"127.0.0.1:{port}",
           "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SHOAL_ELASTIC_TRACE": str(trace), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    args = ["--out", str(tmp_path), "--steps", "60", "--op", "10", "--min-workers", "2", "--pace", "0.05"]
    workers = [subprocess.Popen([sys.executable, str(HERE / "elastic_worker.py"), *args], env={**env, "RANK": str(r)},
                                stdout=open(tmp_path / f"log-{r}.txt", "wb"), stderr=subprocess.STDOUT)
               for r in range(3)]
    try:
        _wait(lambda: len({v["pid"] for v in _votes(trace) if str(v["verdict"]).startswith("commit")}) == 3, 90,
              "the three workers never trained")
        coord.kill()
        coord.wait()
        time.sleep(1.0)
        workers[2].kill()
        time.sleep(9.0)
        alive = [p.poll() is None for p in workers[:2]]
        coord = _coordinator(port, coord_log)
        codes = [p.wait(timeout=120) for p in workers[:2]]
    finally:
        for p in [*workers, coord]:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"=== {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(tmp_path.glob("*.txt")))
    assert alive == [True, True], logs           # waiting for the coordinator, not dead
    assert codes == [0, 0], logs
    assert "did not (left out)" in coord_log.read_text(), logs
    a, b = (torch.load(tmp_path / f"{r}-0.pt", weights_only=False) for r in range(2))
    assert a["log"][-1]["size"] == b["log"][-1]["size"] == 2, logs
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), (k, logs)
