"""Run elastic workers as real processes around an in-process coordinator.

Test code, not shipped: it starts ``elastic_worker.py`` once per rank, can
SIGKILL one at a chosen time, restarts crashed workers (as
``shoal run --elastic`` does) and kills everything it started before
returning, whatever happens: each run has a hard time limit.

The processes this harness starts itself (the workers of :func:`run`, the
launcher of :func:`run_launcher`) are forked from the fork server that
``shoal.testing.run_workers`` uses, which has imported torch, torch._dynamo
(what a process's first optimizer step imports) and shoal once, instead of
being fresh interpreters: each runs the same script or ``shoal`` command line
in its own session with its own environment, arguments and log, but skips
those imports (about 2.3 s of CPU each, most of an elastic test's cost on 2
cores). The launcher's own workers stay fresh interpreters: that is
``shoal run``'s code under test (:mod:`forked`: the handle, and why no
forked process outlives the test process or loses its last log lines).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from forked import Forked, _killpg
from shoal.elastic import Coordinator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@dataclass
class Outcome:
    results: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # (rank, life) -> result
    deaths: list[tuple[int, float]] = field(default_factory=list)                 # (rank, when it died)
    logs: str = ""

    def final(self) -> list[dict[str, Any]]:
        """The last incarnation's result of every rank that finished."""
        best: dict[int, dict[str, Any]] = {}
        for (rank, life), r in sorted(self.results.items()):
            best[rank] = r
        return [best[k] for k in sorted(best)]


def run(out_dir: str, world: int, args: list[str], *, env: dict[str, str] | None = None,
        hard_limit: float = 60.0, restarts: int = 1, kill: tuple[int, float] | None = None,
        script: str = "elastic_worker.py", token: str | None = None, initial_workers: int | None = None,
        ranks: list[int] | None = None, coordinator: Coordinator | None = None,
        run_id: str | None = None) -> Outcome:
    """Start one process per rank (``ranks``, default all of ``world``) and wait for them all.

    With ``coordinator`` (and ``run_id``) the processes join that run, whose other
    peers the caller runs itself; the caller then stops the coordinator (and
    passes its ``token``). ``token`` (default: a fresh one) is the run's, given
    to the processes as ``SHOAL_TOKEN`` unless ``env`` sets another.
    """
    token = token or f"test-{uuid.uuid4().hex}"
    coord = coordinator or Coordinator(port=0, initial_workers=world if initial_workers is None else initial_workers,
                                       token=token).start()
    base = {**os.environ, "SHOAL_TOKEN": token, **(env or {}), "SHOAL_COORDINATOR": coord.address,
            "SHOAL_RUN_ID": run_id or uuid.uuid4().hex[:8], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    trace = base.setdefault("SHOAL_ELASTIC_TRACE", os.path.join(out_dir, "trace"))   # read on a failure
    os.makedirs(trace, exist_ok=True)
    procs: dict[int, tuple[Forked, int]] = {}
    lives: dict[int, str] = {}   # pid -> "rank-life", to name the trace files
    outcome = Outcome()
    log_paths: list[str] = []

    def start(rank: int, life: int) -> None:
        path = os.path.join(out_dir, f"log-{rank}-{life}.txt")
        log_paths.append(path)
        p = Forked([os.path.join(HERE, script), "--out", out_dir, *args],
                   {**base, "RANK": str(rank), "SHOAL_RESTART": str(life)}, path)
        procs[rank] = (p, life)
        lives[p.pid] = f"{rank}-{life}"

    t0 = time.monotonic()
    try:
        for r in range(world) if ranks is None else ranks:
            start(r, 0)
        while True:
            # Deaths first: a SIGKILLed last process must still be restarted, not end the run.
            for rank, (p, life) in list(procs.items()):
                if p.poll() == -signal.SIGKILL:
                    outcome.deaths.append((rank, time.time()))
                    if life < restarts:
                        start(rank, life + 1)
                    else:
                        procs.pop(rank)
            if not [p.poll() for p, _ in procs.values()].count(None):
                break
            if time.monotonic() - t0 > hard_limit:
                raise TimeoutError(f"elastic run still going after {hard_limit} s")
            if kill is not None and time.monotonic() - t0 >= kill[1]:
                _killpg(procs[kill[0]][0].pid, signal.SIGKILL)
                kill = None
            time.sleep(0.05)
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                _killpg(p.pid, signal.SIGKILL)
                p.wait()
        if coordinator is None:
            coord.stop()
        outcome.logs = ((f"=== coordinator error: {coord.error!r}\n" if coord.error else "")
                        + "\n".join(f"=== {os.path.basename(lp)}\n{open(lp, errors='replace').read()[-3000:]}"
                                    for lp in log_paths)
                        + _trace_tails(trace, lives, t0))
    for name in os.listdir(out_dir):
        if name.endswith(".pt"):
            rank, life = (int(v) for v in name[:-3].split("-"))
            outcome.results[(rank, life)] = torch.load(os.path.join(out_dir, name), weights_only=False)
    return outcome


def _trace_tails(folder: str, lives: dict[int, str], t0: float, lines: int = 40) -> str:
    """The last ``lines`` elastic trace events (shoal.membership.coordinator.Trace) of each worker the harness
    started, times in seconds since the run began: where a failed run's group formation or heal stopped."""
    start = time.time() - (time.monotonic() - t0)
    out = []
    for pid, life in sorted(lives.items(), key=lambda kv: kv[1]):
        path = os.path.join(folder, f"{pid}.jsonl")
        if not os.path.exists(path):
            continue
        events = []
        for line in open(path, errors="replace").read().splitlines()[-lines:]:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            t = ev.pop("t", start)
            events.append(f"{t - start:7.2f} {ev.pop('ev', '?')} {ev}")
        out.append(f"=== trace {life} (pid {pid})\n" + "\n".join(events))
    return ("\n" + "\n".join(out)) if out else ""


def run_launcher(out_dir: str, world: int, launcher_args: list[str], args: list[str], *,
                 env: dict[str, str] | None = None, hard_limit: float = 60.0,
                 script: str = "elastic_worker.py") -> tuple[int, Outcome]:
    """``shoal run -n WORLD --elastic LAUNCHER_ARGS elastic_worker.py ARGS``; its exit code and outcome."""
    full_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    cmd = ["-m", "shoal", "run", "-n", str(world), "--elastic", *launcher_args,
           os.path.join(HERE, script), "--out", out_dir, *args]
    log = os.path.join(out_dir, "launcher.txt")
    p = Forked(cmd, full_env, log)
    try:
        code = p.wait(timeout=hard_limit)
    except subprocess.TimeoutExpired:
        _killpg(p.pid, signal.SIGTERM)   # the launcher stops its workers, then we make sure
        try:
            p.wait(timeout=8)
        finally:
            _killpg(p.pid, signal.SIGKILL)   # the launcher and its workers may be gone already
        code = -1
    outcome = Outcome(logs=open(log, errors="replace").read()[-6000:])
    for name in os.listdir(out_dir):
        if name.endswith(".pt"):
            rank, life = (int(v) for v in name[:-3].split("-"))
            outcome.results[(rank, life)] = torch.load(os.path.join(out_dir, name), weights_only=False)
    return code, outcome


def parked_striped(group: Any, park: int) -> Callable[[int, int], None]:
    """A joiner's ``before_chunk`` part: no range before ``park`` commits since its admission (the survivors
    commit while it downloads, whatever the speed; with ``park`` > 0 a download begun before the admission,
    CatchUp.prefetch, waits for it too), and a source's second range only once another source asked for its
    first (striped: a fast loopback source could fetch every range of a small state first)."""
    asked: set[int] = set()

    def wait(source: int, received: int) -> None:
        unparked = time.monotonic() + 90.0   # a stopped early download's thread must end too
        while ((park > 0 and group.catchup.stats.admitted_step < 0) or
               group.step < group.catchup.stats.admitted_step + park) and time.monotonic() < unparked:
            time.sleep(0.005)
        asked.add(source)
        deadline = time.monotonic() + 20.0
        while received > 0 and len(asked) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    return wait


def save_and_leave(out: str, rank: int, life: int, result: dict[str, Any], group: Any) -> None:
    """A worker's last act: write its result atomically as ``{rank}-{life}.pt`` (what ``run`` reads),
    then leave the elastic group."""
    path = os.path.join(out, f"{rank}-{life}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    group.leave()


def assert_equal_state(results: list[dict[str, Any]], cursor: bool = True) -> None:
    """Every result holds rank 0's parameters and optimizer state, bit for bit (and, with ``cursor``, its
    sampler cursor): the invariant of a run that survived faults."""
    ref = results[0]
    for r in results[1:]:
        for k, v in ref["model"].items():
            assert torch.equal(v, r["model"][k]), f"parameter {k} differs between rank {ref['rank']} and {r['rank']}"
        for pid, st in ref["opt"]["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(r["opt"]["state"][pid][k])), \
                    f"optimizer state {pid}/{k} differs between rank {ref['rank']} and {r['rank']}"
        if cursor:
            assert r["cursor"] == ref["cursor"], "the sampler's cursor differs"
