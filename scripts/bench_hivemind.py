"""shoal's CollaborativeOptimizer vs hivemind.Optimizer on one task, back to back (issue #9).

Not part of the shoal package: it imports hivemind, and only in the hivemind
peers, so run it under an interpreter that has hivemind, torch and
scikit-learn, with shoal on PYTHONPATH::

    PYTHONPATH=. /tmp/hm/bin/python scripts/bench_hivemind.py --seconds 30 --kill-at 10 --repeat 2

The task is the one of ``shoal.bench.collaborative`` (its ``dataset()``): an
MLP 64-128-10 on scikit-learn's digits, Adam lr 1e-3, batch 32 per step on
every peer, target batch 512 for the swarm, 2 peers on loopback, one thread
each. Here the digits are split (fixed permutation): 1497 to train on, 300 to
validate on. Systems: ``shoal`` (default ``CollaborativeConfig``), ``hivemind``
(``hivemind.Optimizer`` defaults, plus ``--hivemind-opts``) and
``hivemind-tuned`` (``--tuned-opts``, by default the matchmaking_time and
averaging_timeout of hivemind's quickstart). The harness adds one thing to
all: a start barrier (every peer builds its optimizer, then waits until all
have, before its clock starts).

Measured, identically for all, from the peers' own logs:

* samples/s: for each epoch peer 0 commits after its first, the samples behind
  its update (the own samples of every peer in the same averaging round, or
  peer 0's own when it stepped with its own gradients), divided by peer 0's
  wall time from its first to its last epoch. A shoal round is named by its
  epoch; a hivemind round by its members (the keys of the gradient round's
  result), matched across peers by time (within 1 s);
* seconds to a validation loss (``--loss``): time from peer 0's first epoch
  until its parameters, evaluated right after an epoch, have a validation
  loss at or below the target;
* bytes: TCP payload bytes sent (``ss -ti`` ``bytes_sent``) by all sockets of
  a peer's process group (for hivemind: the Python process, its forked DHT
  and averager processes and its p2pd daemon; their talk to p2pd over unix
  sockets is not TCP and not counted). The launcher polls ``ss`` every
  ``--poll`` seconds and keeps each socket's largest count; a socket opened
  and closed between two polls, or bytes sent in its last interval, are
  missed;
* with ``--kill-at``: peer 1's process group is SIGKILLed that many seconds
  after peer 0's first epoch; reported: the longest gap between the kill and
  the survivor's epochs after it, and the degraded seconds: the sum of those
  gaps longer than ``STALL_S``.

``--resummarize FILE`` recomputes the summaries of a ``--json`` file from the
peers' logs (kept in the temporary folders it names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.bench.collaborative import dataset

TOKEN = "bench-token-123"
BATCH, TARGET, LR = 32, 512, 1e-3
Peer = tuple[Callable[[], "dict[str, Any] | None"], Callable[[], None]]     # (step, stop)
STALL_S = 0.5       # a gap between two epochs longer than this counts as degraded time after a kill


def split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y, _ = dataset()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    tr, va = perm[300:], perm[:300]
    return x[tr], y[tr], x[va], y[va]


def barrier(out: str, rank: int, peers: int, timeout: float = 180.0) -> None:
    open(os.path.join(out, f"ready.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(out, f"ready.{r}")) for r in range(peers)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer {rank}: not all {peers} peers ready after {timeout} s")
        time.sleep(0.05)


def shoal_optimizer(net: nn.Module, a: argparse.Namespace) -> Peer:
    import shoal
    cfg = shoal.CollaborativeConfig(run_id=a.run_id, target_batch_size=TARGET, batch_size_per_step=BATCH,
                                    coordinator=a.address, token=TOKEN)
    opt = shoal.CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=LR), net.named_parameters(), config=cfg)
    opt.wait_for_peers(2, timeout=120)   # the comparison runs 2 peers (module docstring)

    def step() -> dict[str, Any] | None:
        rep = opt.step()
        opt.zero_grad()
        if rep is None or rep.outcome not in ("averaged", "local"):
            return None
        averaged = rep.outcome == "averaged"
        return {"epoch": rep.epoch, "group": f"e{rep.epoch}" if averaged else None,
                "n": rep.peers if averaged else 1, "swarm_samples": rep.samples}
    return step, opt.shutdown


def hivemind_optimizer(net: nn.Module, a: argparse.Namespace) -> Peer:
    import hivemind
    path = os.path.join(a.out, "maddrs.txt")
    if a.peer == 0:
        dht = hivemind.DHT(start=True)
        with open(path + ".tmp", "w") as f:
            f.write("\n".join(str(m) for m in dht.get_visible_maddrs()))
        os.replace(path + ".tmp", path)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError("peer 0 never published its multiaddrs")
            time.sleep(0.1)
        with open(path) as f:
            dht = hivemind.DHT(start=True, initial_peers=f.read().split("\n"))
    opt = hivemind.Optimizer(dht=dht, run_id=a.run_id, target_batch_size=TARGET, batch_size_per_step=BATCH,
                             optimizer=lambda ps: torch.optim.Adam(ps, lr=LR), params=net.parameters(),
                             **json.loads(a.tuned_opts if a.system == "hivemind-tuned" else a.hivemind_opts))

    def step() -> dict[str, Any] | None:
        before = opt.local_epoch
        opt.step()
        opt.zero_grad()
        if opt.local_epoch <= before:
            return None
        # The gradient round this epoch used, if any (hivemind keeps its StepControl until the next epoch's round
        # replaces it): a successful one (its result: what each member gathered, keyed by peer id) means averaged
        # gradients were applied, else this peer's own were.
        ctl, members = opt.scheduled_grads, None
        if ctl is not None and ctl.done() and not ctl.cancelled() and ctl.exception() is None:
            members = sorted(str(peer_id) for peer_id in ctl.result())
        return {"epoch": opt.local_epoch, "group": None, "members": members, "n": len(members) if members else 1}

    def stop() -> None:
        opt.shutdown()
        dht.shutdown()
    return step, stop


def peer(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y, xv, yv = split()
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    step, stop = (shoal_optimizer if a.system == "shoal" else hivemind_optimizer)(net, a)
    barrier(a.out, a.peer, a.peers)
    g = torch.Generator().manual_seed(a.peer)
    log = open(os.path.join(a.out, f"{a.peer}.jsonl"), "a", buffering=1)
    t_end, losses, own = time.monotonic() + a.seconds, [], 0
    while time.monotonic() < t_end:
        idx = torch.randint(0, len(x), (BATCH,), generator=g)
        loss = F.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        losses.append(loss.item())
        own += BATCH
        rec = step()
        if rec is not None:
            with torch.no_grad():
                val = F.cross_entropy(net(xv), yv).item()
            row = {**rec, "t": time.time(), "own": own, "loss": sum(losses) / len(losses), "val": val}
            log.write(json.dumps(row) + "\n")
            losses, own = [], 0
    log.close()
    # hivemind's shutdown can hang (seen here: "cannot schedule new futures after shutdown" in its DHT thread), so
    # give it 15 s, then leave; the launcher kills whatever this peer's process group still holds.
    t = threading.Thread(target=stop, daemon=True)
    t.start()
    t.join(15)
    os._exit(0)


class ByteMonitor(threading.Thread):
    """Largest ``bytes_sent`` seen per TCP socket, summed per process group."""

    LINE = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")

    def __init__(self, pgids: list[int], poll: float) -> None:
        super().__init__(daemon=True)
        self.pgids, self.poll, self.stop_flag = set(pgids), poll, threading.Event()
        self.sent: dict[tuple[int, str, str], int] = {}
        self._pg: dict[int, int | None] = {}

    def pgid(self, pid: int) -> int | None:
        if pid not in self._pg:
            try:
                self._pg[pid] = os.getpgid(pid)
            except ProcessLookupError:
                self._pg[pid] = None
        return self._pg[pid]

    def sample(self) -> None:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout.splitlines()
        for head, info in zip(out[::2], out[1::2]):
            m, b = self.LINE.match(head), re.search(r"bytes_sent:(\d+)", info)
            if m is None or b is None:
                continue
            pg = self.pgid(int(m.group(3)))
            if pg in self.pgids:
                key = (pg, m.group(1), m.group(2))
                self.sent[key] = max(self.sent.get(key, 0), int(b.group(1)))

    def run(self) -> None:
        while not self.stop_flag.wait(self.poll):
            self.sample()

    def per_group(self) -> dict[int, int]:
        return {pg: sum(v for (g, _, _), v in self.sent.items() if g == pg) for pg in self.pgids}


def read_log(path: str) -> list[dict[str, Any]]:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:       # a killed peer's half-written last line
                    pass
    return rows


def summarize(logs: list[list[dict[str, Any]]], nbytes: list[int], target: float,
              killed_at: float | None) -> dict[str, Any]:
    main = logs[0]
    if len(main) < 2:
        return {"epochs": len(main), "error": "peer 0 committed fewer than 2 epochs"}
    t0, t1 = main[0]["t"], main[-1]["t"]
    # Samples behind each of peer 0's epochs: the own samples of every peer in the same averaging round, or peer
    # 0's own alone when it stepped with its own gradients. shoal's rounds are named by epoch ("group"); hivemind
    # gives a round's member ids, and a member's row of that round is its row with those members closest in time.
    by_group: dict[str, int] = {}
    for log in logs:
        for row in log:
            if row["group"] is not None:
                by_group[row["group"]] = by_group.get(row["group"], 0) + row["own"]

    def round_samples(row: dict[str, Any]) -> int:
        if row["group"] is not None:
            return by_group[row["group"]]
        total = row["own"]
        if row.get("members"):
            for log in logs[1:]:
                mates = [m for m in log if m.get("members") == row["members"] and abs(m["t"] - row["t"]) < 1.0]
                if mates:
                    total += min(mates, key=lambda m: abs(m["t"] - row["t"]))["own"]
        return total
    samples = sum(round_samples(row) for row in main[1:])
    gaps = [(b["t"], b["t"] - a["t"]) for a, b in zip(main, main[1:])]
    r: dict[str, Any] = {
        "epochs": len(main), "samples_per_s": samples / (t1 - t0),
        "s_to_val_loss": next((row["t"] - t0 for row in main if row["val"] <= target), None),
        "final_val_loss": main[-1]["val"], "median_gap_s": sorted(g for _, g in gaps)[len(gaps) // 2],
        "tcp_bytes_sent_per_peer": nbytes, "tcp_bytes_per_epoch_peer0": nbytes[0] / max(len(main) - 1, 1),
        "epochs_per_peer": [len(log) for log in logs],
        "averaged_epochs_peer0": sum(row["group"] is not None or bool(row.get("members")) for row in main),
        "mean_group_size_peer0": sum(row["n"] for row in main) / len(main)}
    if all("swarm_samples" in row for row in main):     # shoal's own count, as a check of the one above
        r["reported_samples_per_s"] = sum(row["swarm_samples"] for row in main[1:]) / (t1 - t0)
    if killed_at is not None:
        # Stalls: stretches longer than STALL_S without an epoch on the survivor, counted from the kill.
        stamps = [killed_at] + [row["t"] for row in main if row["t"] > killed_at]
        stalls = [b - a for a, b in zip(stamps, stamps[1:]) if b - a > STALL_S]
        r["max_gap_after_kill_s"] = max((b - a for a, b in zip(stamps, stamps[1:])), default=None)
        r["degraded_s"] = sum(stalls)
        r["stalls_after_kill"] = len(stalls)
        r["epochs_after_kill"] = len(stamps) - 1
    return r


def run_one(system: str, a: argparse.Namespace, kill_at: float | None) -> dict[str, Any]:
    out, load = tempfile.mkdtemp(prefix=f"hm-compare-{system}-"), os.getloadavg()[0]
    run_id, coord, address = uuid.uuid4().hex[:8], None, ""
    if system == "shoal":
        from shoal.membership.coordinator import Coordinator
        coord = Coordinator(port=0, token=TOKEN, initial_workers=a.peers).start()
        address = coord.address
    procs = []
    for r in range(a.peers):
        with open(os.path.join(out, f"{r}.stderr"), "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--peer", str(r), "--system", system, "--out", out,
                 "--run-id", run_id, "--address", address, "--seconds", str(a.seconds), "--peers", str(a.peers),
                 "--hivemind-opts", a.hivemind_opts, "--tuned-opts", a.tuned_opts],
                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True, stdout=err, stderr=err))
    mon = ByteMonitor([p.pid for p in procs], a.poll)
    mon.start()
    killed_at = None
    try:
        if kill_at is not None:
            deadline = time.time() + 240
            while not read_log(os.path.join(out, "0.jsonl")) and time.time() < deadline:
                time.sleep(0.1)
            time.sleep(kill_at)
            mon.sample()
            os.killpg(procs[1].pid, signal.SIGKILL)
            killed_at = time.time()
        deadline = time.monotonic() + a.seconds + 180
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:      # the peer and all it forked (hivemind's DHT and averager processes, p2pd)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        mon.stop_flag.set()
        mon.join()
        if coord is not None:
            coord.stop()
    per = mon.per_group()
    logs = [read_log(os.path.join(out, f"{r}.jsonl")) for r in range(a.peers)]
    res = summarize(logs, [per[p.pid] for p in procs], a.loss, killed_at)
    return {"system": system, "kill_at": kill_at, "killed_at": killed_at, "load_1min": [load, os.getloadavg()[0]],
            "logs": out, "rc": [p.returncode for p in procs], **res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="shoal,hivemind,hivemind-tuned")
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--kill-at", type=float, default=None, help="also run each system with peer 1 SIGKILLed")
    ap.add_argument("--loss", type=float, default=0.5, help="target validation loss")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--poll", type=float, default=0.2, help="seconds between ss samples")
    ap.add_argument("--hivemind-opts", default="{}", help="JSON of extra hivemind.Optimizer arguments")
    ap.add_argument("--tuned-opts", default='{"matchmaking_time": 3.0, "averaging_timeout": 10.0}',
                    help="JSON of hivemind.Optimizer arguments for the system 'hivemind-tuned'")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--resummarize", default=None, help="recompute the summaries of a --json file from its logs")
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--system", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer is not None:
        peer(a)
        return
    if a.resummarize:
        with open(a.resummarize) as f:
            old = json.load(f)["results"]
        for res in old:
            logs = [read_log(os.path.join(res["logs"], f"{r}.jsonl")) for r in range(a.peers)]
            # Older files lack killed_at: the kill came kill_at s after peer 0's first epoch (+ up to 0.1 s).
            killed = res.get("killed_at") or (logs[0][0]["t"] + res["kill_at"] if res["kill_at"] else None)
            keep = {k: res[k] for k in ("system", "kill_at", "load_1min", "logs", "rc")}
            print(json.dumps({**keep, **summarize(logs, res["tcp_bytes_sent_per_peer"], a.loss, killed)}))
        return
    results = []
    for _ in range(a.repeat):
        for kill in [None] + ([a.kill_at] if a.kill_at is not None else []):
            for system in a.systems.split(","):
                res = run_one(system, a, kill)
                print(json.dumps(res), flush=True)
                results.append(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
