"""The coordinator may fail (issue #21): a standalone `shoal coordinator` SIGKILLed mid-run, restarted 10 s later.

Three workers (plain processes, never restarted) train through the outage
with the quorum they have: their votes go peer to peer while the store is
gone (shoal.membership.vote.peer_vote). The restarted coordinator (same
port, same token, empty store) learns the members from their
re-announcements (shoal.membership.reclaim / recovery); a fourth worker that
starts after the restart is admitted and healed. At the end every worker
exited 0 in its first life, all hold one state, and each said once that the
coordinator was lost. The coordinator and the workers are forked from the
fork server (harness.Forked): the same command lines, without a fresh
interpreter's torch import each.
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
from typing import Sequence

import pytest
import torch

from shoal.cli.supervise import _free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
ROOT = HERE.parents[1]
TOKEN = "coordinator-restart-token"


def _coordinator(port: int, log: Path) -> harness.Forked:
    """`shoal coordinator` (forked from the fork server: torch already imported), appending to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHOAL_TOKEN": TOKEN}
    env.pop("SHOAL_ELASTIC_TRACE", None)
    return harness.Forked(["-m", "shoal", "coordinator", "--port", str(port), "--initial-workers", "3"], env,
                          str(log), append=True)


def _votes(trace: Path) -> list[dict[str, object]]:
    """Every worker's vote events (their trace files), each with the worker's pid."""
    out: list[dict[str, object]] = []
    for f in trace.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            ev = json.loads(line)
            if ev["ev"] == "vote":
                out.append({**ev, "pid": int(f.stem)})
    return out


def _wait(cond, limit: float, what: str, alive: Sequence[harness.Forked] = ()) -> None:  # type: ignore[no-untyped-def]
    """Poll ``cond`` until it holds; fail at once if a process of ``alive`` exits (waiting longer cannot
    help then), else after ``limit`` s."""
    deadline = time.monotonic() + limit
    while not cond():
        gone = [p.args for p in alive if p.poll() is not None]
        if gone:
            raise AssertionError(f"{what}: exited meanwhile: {gone}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _serving(log: Path, n: int) -> bool:
    """Whether ``log`` says a coordinator started serving ``n`` times (its own readiness line)."""
    return log.exists() and log.read_text(errors="replace").count("shoal coordinator: serving on") >= n


class _Run:
    """The scenario every test here shares: a standalone coordinator (``coord``, logging to ``coord_log``),
    workers of tests/faults/elastic_worker.py started by rank with ``args`` (``workers``), their vote
    traces, and an exit that kills whatever still runs. ``with _Run(...) as run:`` then the test's story."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.out, self.port, self.trace = tmp_path, _free_port(), tmp_path / "trace"
        self.trace.mkdir()
        self.coord_log = tmp_path / "coordinator.txt"
        self.coord = _coordinator(self.port, self.coord_log)
        self.env = {**os.environ, "SHOAL_TOKEN": TOKEN, "SHOAL_COORDINATOR": f"127.0.0.1:{self.port}",
                    "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "SHOAL_ELASTIC_TRACE": str(self.trace),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        self.args = ["--out", str(tmp_path), *args]
        self.workers: dict[int, harness.Forked] = {}

    def __enter__(self) -> "_Run":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in [*self.workers.values(), self.coord]:
            if p.poll() is None:
                p.kill()
                p.wait()

    def start(self, rank: int) -> None:
        self.workers[rank] = harness.Forked([str(HERE / "elastic_worker.py"), *self.args],
                                            {**self.env, "RANK": str(rank)}, str(self.out / f"log-{rank}.txt"))

    def committed_after(self, t: float) -> set[int]:
        """The workers (pids) that committed a step after time ``t`` (``time.time()``)."""
        votes = _votes(self.trace)
        return {int(v["pid"]) for v in votes if str(v["verdict"]).startswith("commit") and float(v["t"]) > t}  # type: ignore[arg-type]

    def start_three_and_wait_until_they_train(self) -> None:
        """Readiness first: the coordinator serves (its start-up, a torch import, takes long on a loaded
        machine), then the three workers start and train; a worker that exits ends the wait at once."""
        _wait(lambda: _serving(self.coord_log, 1), 120, "the coordinator never served", [self.coord])
        for r in range(3):
            self.start(r)
        _wait(lambda: len(self.committed_after(0.0)) == 3, 200, "the three workers never trained",
              [self.coord, *self.workers.values()])

    def kill_coordinator(self) -> float:
        """SIGKILL the coordinator; when it was dead (``time.time()``)."""
        self.coord.send_signal(signal.SIGKILL)
        self.coord.wait()
        return time.time()

    def lose_the_coordinator_then_worker_2(self) -> None:
        """The coordinator dies, and a second later (no vote through the store in flight) worker 2 too."""
        self.kill_coordinator()
        time.sleep(1.0)
        self.workers[2].kill()

    def restart_coordinator(self) -> float:
        """A new coordinator on the same port with the same token (an empty store); when it serves."""
        self.coord = _coordinator(self.port, self.coord_log)
        _wait(lambda: _serving(self.coord_log, 2), 120, "the restarted coordinator never served", [self.coord])
        return time.time()

    def wait_for_workers(self, limit: float) -> None:
        """Every worker exits within ``limit`` s, or the test fails with which did not and every log (a worker
        that hangs once in many runs must leave what it was doing in the report)."""
        deadline = time.monotonic() + limit
        for r, p in self.workers.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise AssertionError(f"worker {r} had not exited {limit} s after the joiner started "
                                     f"({type(e).__name__}); still running: "
                                     f"{[k for k, q in self.workers.items() if q.poll() is None]}\n{self.logs()}") from e

    def logs(self) -> str:
        return "\n".join(f"=== {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(self.out.glob("*.txt")))


@pytest.mark.timeout(300)
def test_coordinator_killed_and_restarted_the_run_goes_on_and_admits_a_join(tmp_path: Path) -> None:
    # The coordinator dies while no vote is in flight: every worker holds outside a step at step 3. (Killed
    # during a vote through the store, a member that had not read the decision yet votes again among its
    # peers, who have moved on; it discards alone and, by design, the run waits for the coordinator:
    # shoal.membership.vote.peer_vote. Not the story told here.)
    (tmp_path / "hold").touch()
    with _Run(tmp_path, ["--steps", "20", "--op", "10", "--min-workers", "2", "--pace", "0.05",
                         "--want-size", "4", "--max-steps", "3000", "--hold-at", "3"]) as run:
        run.start_three_and_wait_until_they_train()
        _wait(lambda: all((tmp_path / f"held-{r}").exists() for r in range(3)), 60, "a worker never held",
              list(run.workers.values()))
        killed = run.kill_coordinator()
        (tmp_path / "hold").unlink()
        time.sleep(10)                             # an outage longer than the workers' heartbeat timeout
        # ... and on until each committed a step without it (a second for the last votes through the store
        # to end), however slow the machine: a worker that dies meanwhile ends the wait.
        _wait(lambda: len(run.committed_after(killed + 1.0)) == 3, 60, "a worker stopped committing",
              list(run.workers.values()))
        down = run.committed_after(killed + 1.0)
        alive = [r for r, p in run.workers.items() if p.poll() is None]
        restarted = run.restart_coordinator()
        _wait(lambda: "re-announced" in run.coord_log.read_text(), 60, "no worker re-announced itself")
        run.start(3)
        run.wait_for_workers(120)
    workers, logs = run.workers, run.logs()
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


QUORUM_S = 6.0


@pytest.mark.timeout(300)
def test_a_membership_change_waits_for_a_dead_coordinator_then_fails_clearly(tmp_path: Path) -> None:
    # The coordinator dies for good, then a worker is lost: the survivors cannot form a quorum without it,
    # wait Timeouts.quorum and stop with an error that says what to do. Quorum 6 s (op + 10 = 13 s before;
    # the first quorum waits Timeouts.join, op + 40): the test took ~16 s, most of it this wait.
    with _Run(tmp_path, ["--steps", "100000", "--op", "3", "--quorum", str(QUORUM_S), "--min-workers", "2",
                         "--pace", "0.05"]) as run:
        run.start_three_and_wait_until_they_train()
        run.lose_the_coordinator_then_worker_2()
        t0 = time.monotonic()
        codes = [run.workers[r].wait(timeout=60) for r in range(2)]
        waited = time.monotonic() - t0
    logs = [(tmp_path / f"log-{r}.txt").read_text(errors="replace") for r in range(2)]
    assert all(c != 0 for c in codes), logs
    for log in logs:
        assert "is unreachable and this worker" in log and "Restart the coordinator" in log, log
    assert waited >= QUORUM_S - 1.0, waited   # it waited Timeouts.quorum for the coordinator first (op is 3 s)


@pytest.mark.timeout(300)
def test_a_worker_lost_while_the_coordinator_is_down_is_left_out_once_it_is_back(tmp_path: Path) -> None:
    # The change arrives while the coordinator is down: the survivors wait for it (no restart of theirs);
    # the restarted coordinator hears from them only, leaves the lost worker out, and they finish as one.
    # --op 30: they wait Timeouts.quorum (40 s) for it, room for its start-up (a torch import) on a loaded
    # machine after the 9 s outage.
    with _Run(tmp_path, ["--steps", "60", "--op", "30", "--min-workers", "2", "--pace", "0.05"]) as run:
        run.start_three_and_wait_until_they_train()
        run.lose_the_coordinator_then_worker_2()
        time.sleep(9.0)
        alive = [run.workers[r].poll() is None for r in range(2)]
        run.restart_coordinator()
        codes = [run.workers[r].wait(timeout=120) for r in range(2)]
    logs = run.logs()
    assert alive == [True, True], logs           # waiting for the coordinator, not dead
    assert codes == [0, 0], logs
    assert "did not (left out)" in run.coord_log.read_text(), logs
    a, b = (torch.load(tmp_path / f"{r}-0.pt", weights_only=False) for r in range(2))
    assert a["log"][-1]["size"] == b["log"][-1]["size"] == 2, logs
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), (k, logs)
