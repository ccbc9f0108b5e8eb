"""Chaos benchmark: elastic training with a worker SIGKILLed every few seconds, against a fault-free run.

Both runs train the same model for the same number of optimizer steps with
``shoal.wrap(..., process_group=ElasticGroup())``; in the chaos run a random
worker is SIGKILLed every ``--kill-every`` seconds (±30 %) for ``--chaos-for``
seconds and restarted at once (as ``shoal run --elastic`` does); it heals
from a live peer. Reported: final validation loss of both runs, rounds re-run,
local steps lost per failure (the killed worker's progress that no
committed round holds: for DiLoCo and streaming DiLoCo each fragment's steps
since its last launch, weighted by its share of the parameters), seconds
the survivors' step took when a round had to be re-run, seconds from a
restart to its first step and the heal itself (with the model's size),
steps per second; per kill and per join the survivors' stall
(their longest gap between committed steps across the kill or around the
newcomer's admission, minus a median step), the newcomer's seconds from
process start to its first committed step, and the goodput (committed
samples per second; chaos over fault-free: ``goodput_ratio``). Per join,
beside that window figure (``stall_per_join_s``, newcomer ready to its first
contribution): the survivors' gap that admitted it (issue #20's stall per
join, ``stall_per_join_admission_s``) and the seconds its background
download added to the survivors' clean steps (``download_cost_per_join_s``).
The definitions, unit-tested: :mod:`shoal.bench.chaos_stats`. Per join also
(``joins``): the joiner's seconds from process start to its first contributing step and the bytes it
received. ``--heal background`` heals restarted workers in the background (SHOAL_HEAL, docs/elastic.md),
``--heal-pace`` paces it by the run's steps (SHOAL_HEAL_PACE). ``--state-cache`` gives each worker slot a
file in ``/dev/shm`` (SHOAL_STATE_CACHE, :mod:`shoal.membership.seed`): a restart on the same host then
fetches only the ranges of the state that changed since its last life wrote it (each join reports its
``seeded_bytes``); without it every restart downloads all, as on a replacement host.

The data depends on the run's position only, never on a worker's life, so the chaos half trains on the
fault-free half's samples and the final losses differ by the faults alone. DDP reads the run's one sample
stream through an :class:`~shoal.elastic.ElasticSampler` (each step logs its ``samples`` and the stream's
``cursor``; the goodput counts the samples); ``--global-batch N`` has each step's contributors share N of
them (the survivors of a kill take over its share), so both halves read the same samples in the same order.
``--joiner-batch N``: a joiner catching up computes N samples a step to throw away, not a full share
(ElasticSampler(joiner_batch=N)); every emulated host shares this machine's cores, so a joiner's discarded
share is the contributors' compute (after a kill, when they take over the dead worker's share, too).
A local-step strategy's worker reads its own batch of each local step, whichever life takes that step.
``--data-seed`` shifts every stream, so fault-free runs of other data orders show how far the final loss
moves without a fault. A local-step strategy's chaos half commits fewer samples than its fault-free half (a
kill loses the victim's steps since its last round): ``loss_at_equal_samples`` compares its final loss with
the fault-free half's loss curve read at the chaos half's committed samples (``--curve``,
:mod:`shoal.bench.chaos_curve`), beside the same-length comparison.

Two tasks. ``--task markov`` (default) is a small real one that 2 CPU cores
can train in minutes: a character-level LM (2-layer causal transformer,
d=64, 108k parameters) on sequences from a fixed random Markov chain of
order 1 over 64 symbols, so the loss has a known floor (the chain's
entropy, printed). ``--task lm`` is ``shoal bench``'s ``lm`` task (a byte
GPT of 3.26 M parameters on Python's documentation, batch 8 windows of 128
bytes per worker, validation on 64 held-out windows).

    python -m shoal.bench.chaos --workers 4 --strategy localsgd --steps 600 --kill-every 10 --chaos-for 120
    # one worker per emulated host (root): 4 hosts x 20 mbit, the coordinator in host 0's namespace
    python -m shoal.bench.chaos --workers 4 --bandwidth 20mbit --steps 1200 --kill-every 30 --chaos-for 150
    python -m shoal.bench.chaos --task lm --strategy diloco --period 32 --workers 4 --bandwidth 20mbit \
        --steps 480 --kill-every 30 --chaos-for 180 --op 60 --probe 2
    # streaming DiLoCo: 4 fragments, each synchronised once in a period of 32 inner steps
    python -m shoal.bench.chaos --task lm --strategy streaming --fragments 4 --period 32 --workers 4 ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F

import shoal
from shoal.bench.chaos_curve import at_equal_samples, due as curve_due, read_curve, save_point, worker_steps
from shoal.bench.chaos_stats import (admission_stalls, download_costs, goodput, join_stalls, joins as join_table,
                                     kill_stalls, median_round_step, median_step, spread, sync_of, trained_s,
                                     unsynced_steps)
from shoal.bench.overhead import TinyTransformer
from shoal.cli.cluster import ClusterSpec, EmulatedCluster
from shoal.rates import parse_rate
from shoal.membership.pace import parse_pace
from shoal.cli.elastic_launch import NamespacedCoordinator
from shoal.elastic import Coordinator, ElasticGroup, ElasticSampler, Timeouts

VOCAB, SEQ, BATCH = 64, 32, 16
STREAM = 1 << 40   # positions in a step-synchronous run's sample stream: never wraps


def per_worker(task: str) -> int:
    """Samples a worker trains on in a step of the default size (8 windows of 128 bytes for lm)."""
    return 8 if task == "lm" else BATCH


def _chain() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 2.5
    return torch.softmax(logits, dim=1)


def chain_entropy(p: torch.Tensor) -> float:
    """Expected loss (nats) of the true chain on our sequences (uniform start): the floor."""
    pi, row = torch.ones(VOCAB) / VOCAB, -(p * p.clamp_min(1e-12).log()).sum(1)
    total = 0.0
    for _ in range(SEQ):
        total += float(pi @ row)
        pi = pi @ p
    return total / SEQ


def sample(p: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.empty(n, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        seq[:, t + 1] = torch.multinomial(p[seq[:, t]], 1, generator=g).squeeze(1)
    return seq[:, :-1], seq[:, 1:]


def sample_rows(p: torch.Tensor, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of the chain ``p``, row ``i`` a pure function of ``seeds[i]``: one draw of uniforms per row,
    then the rows step through the chain together (inverse CDF), not one sequence at a time."""
    u = torch.stack([torch.rand(SEQ + 1, generator=torch.Generator().manual_seed(s)) for s in seeds], dim=1)
    cdf = p.cumsum(1)
    seq = torch.empty(len(seeds), SEQ + 1, dtype=torch.long)
    seq[:, 0] = (u[0] * VOCAB).long().clamp_max(VOCAB - 1)
    for t in range(SEQ):
        seq[:, t + 1] = torch.searchsorted(cdf[seq[:, t]], u[t + 1, :, None]).squeeze(1).clamp_max(VOCAB - 1)
    return seq[:, :-1], seq[:, 1:]


class CausalLM(TinyTransformer):
    """The bench's TinyTransformer with a causal mask (position t sees tokens <= t only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.body(self.emb(x), mask=mask, is_causal=True))


def _strategy(name: str, period: int, fragments: int) -> shoal.Strategy:
    if name == "localsgd":
        return shoal.LocalSGD(period=period)
    if name == "diloco":
        return shoal.DiLoCo(inner_steps=period)
    if name == "streaming":   # each fragment synchronised once a period, the fragments' rounds spread over it
        return shoal.StreamingDiLoCo(inner_steps=period, fragments=fragments, overlap_steps=0)
    return shoal.strategies.Sync()


def sync_schedule(strategy: shoal.Strategy) -> dict[str, Any] | None:
    """When each of a DiLoCo's fragments is synchronised, and its share of the parameters (what
    :func:`~shoal.bench.chaos_stats.unsynced_steps` needs); None for a strategy whose rounds sync everything."""
    frags = getattr(strategy, "fragments", None)
    if not frags:
        return None
    total = sum(f.snapshot.numel() for f in frags)
    cfg: Any = getattr(strategy, "config")   # a DiLoCoConfig
    return {"period": cfg.inner_steps, "offsets": [cfg.launch_offset(f.index) for f in frags],
            "weights": [f.snapshot.numel() / total for f in frags]}


def _timeouts(a: argparse.Namespace) -> Timeouts:
    """The run's timeouts from ``--op`` and ``--probe`` (raise both on slow links, see docs/elastic.md)."""
    return Timeouts(op=a.op, probe=a.probe, heartbeat_timeout=5 * a.probe, quorum=max(3 * a.op, 6 * a.probe),
                    join=max(200.0, 10 * a.op))


class _Task:
    """What a worker trains: a model, its training batches and its validation loss."""

    def __init__(self, a: argparse.Namespace, rank: int) -> None:
        self.kind = a.task
        # The data depends on the run's position, never on a life: a restart reads what the worker it replaces
        # would have read, so the chaos half trains on the fault-free half's samples (and loses only those of
        # its lost steps), and the final losses compare runs that differ by the faults alone.
        self.stream = 1 + 100_003 * a.data_seed               # step-synchronous: the run's one sample stream
        self.seed = 1000 * (rank + 1) + 1 + 100_003 * a.data_seed   # local steps: this worker's own batches
        if a.task == "lm":
            from shoal.bench.tasks import LMConfig, LMTask
            self.lm = LMTask(LMConfig())
        else:
            self.chain = _chain()

    def model(self, a: argparse.Namespace) -> torch.nn.Module:
        torch.manual_seed(0)
        if self.kind == "lm":
            return self.lm.build_model()
        return CausalLM(vocab=VOCAB, d=a.width, layers=a.layers)

    def stream_loss(self, model: torch.nn.Module, positions: list[int]) -> torch.Tensor:
        """The loss of the run's sample stream at ``positions`` (an :class:`ElasticSampler`'s share)."""
        if self.kind == "lm":
            return self.lm.loss(model, self.lm.corpus.samples(self.stream, positions))
        return self._chain_loss(model, *sample_rows(self.chain, [self.stream * 1_000_003 + p for p in positions]))

    def own_loss(self, model: torch.nn.Module, step: int, n: int) -> torch.Tensor:
        """The loss of this worker's batch of its local step ``step`` (``n`` samples)."""
        if self.kind == "lm":
            return self.lm.loss(model, self.lm.corpus.train_batch(step, self.seed, n, 0, 1))
        return self._chain_loss(model, *sample(self.chain, n, torch.Generator().manual_seed(self.seed * 1_000_003 + step)))

    @staticmethod
    def _chain_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))

    def val_loss(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            if self.kind == "lm":
                return float(self.lm.loss(model, self.lm.corpus.val_windows(limit=64)))
            xv, yv = sample(self.chain, 256, torch.Generator().manual_seed(99))
            return float(F.cross_entropy(model(xv).reshape(-1, VOCAB), yv.reshape(-1)))


def worker(a: argparse.Namespace) -> None:
    """One worker (run as ``python -m shoal.bench.chaos --worker``): trains, logs every step to a file."""
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    started = time.time()
    task = _Task(a, rank)
    group = ElasticGroup(timeouts=_timeouts(a), min_workers=2)
    net = task.model(a)
    strategy = _strategy(a.strategy, a.period, a.fragments)
    lr = 1e-3 if a.task == "lm" else 3e-3
    model, opt = shoal.wrap(net, torch.optim.AdamW(net.parameters(), lr=lr), strategy, process_group=group)

    def step_of() -> int:   # optimizer steps (local-step strategies) or committed steps (DDP)
        return int(getattr(strategy, "step", group.step))

    log = open(os.path.join(a.out, f"log-{rank}-{life}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"event": "joined", "t": time.time(), "started": started, "step": step_of(), "pid": os.getpid(),
                          "heal_s": group.stats.heal_s, "heal_bytes": group.stats.heal_bytes,
                          "healed": group.stats.heals_received,
                          "params": sum(q.numel() for q in net.parameters()), "sync": sync_schedule(strategy)}) + "\n")
    # Stop right after a round, so that every worker holds the same parameters.
    after_round = {"localsgd": 1, "diloco": 0, "streaming": 0}.get(a.strategy)
    # DDP reads the run's one stream: per step, per_worker samples each, or (--global-batch) the contributors
    # share N (the survivors of a kill take over its share). The cursor is healed into restarts.
    size = {"global_batch": a.global_batch} if a.global_batch else {"batch_size": per_worker(a.task)}
    sampler = None if after_round is not None else ElasticSampler(
        STREAM, group, shuffle=False, joiner_batch=a.joiner_batch or None, **size)
    log.write(json.dumps({"event": "joining", "t": time.time()}) + "\n")   # its first step asks to be admitted
    contributed, early_steps = False, 0
    while step_of() < a.steps or (after_round is not None and step_of() % a.period != after_round):
        t0, d0 = time.time(), group.stats.discards
        if sampler is not None:   # starts the step: who is in it decides the share
            positions = sampler.next_batch()
            n = len(positions)
            task.stream_loss(model, positions).backward()
        else:
            n = per_worker(a.task)
            task.own_loss(model, step_of(), n).backward()
        # Read within the step: a background heal's joiner counts zero, except once it has loaded between two
        # rounds (an averaging strategy): its inner steps from there go into the next round, weighted.
        mine = group.contribution()[0] or group.catchup.entering
        was_early = group.catchup.pre is not None
        opt.step()
        opt.zero_grad()
        early = group.catchup.pre is not None   # trained from the survivors' state before its admission
        took = group.catchup.stats.trained_before_admission   # steps the admitting round took (-1: none)
        if was_early and not early:   # admitted in this step: its round took this step only if it took any
            mine = took > 0
        log.write(json.dumps({"t": time.time(), "dt": time.time() - t0, "step": step_of(), "size": group.size,
                              "discards": group.stats.discards - d0, "round": group.step, "contributes": mine,
                              "early": early, "samples": n,
                              "cursor": None if sampler is None else sampler.cursor}) + "\n")
        if early_steps and not early:   # admitted: how many of the steps it logged early did its round take?
            # (those since it last loaded, this step aside; none if dropped: chaos_stats.progress_steps)
            # (resumed: its last life's steps since this host's copy that it went on from, counted in ``took``;
            # they are the killed incarnation's, whose loss _summarise reduces by them)
            resumed = group.catchup.stats.resumed_steps if took > 0 else 0
            log.write(json.dumps({"event": "early", "t": time.time(), "steps": early_steps,
                                  "kept": max(0, took - 1 - resumed), "resumed": resumed}) + "\n")
        early_steps = early_steps + 1 if early else 0
        if curve_due(step_of(), a.steps, a.period, after_round, a.curve):   # fault-free: its loss curve's points
            save_point(net, a.out, rank, step_of())   # (between two steps: off the step's clock)
        if mine and not early and not contributed:   # what it received to get here (it may be killed before "done")
            contributed, cu = True, group.catchup.stats
            log.write(json.dumps({"event": "contributing", "t": time.time(), "heal_bytes": group.stats.heal_bytes,
                                  "download_bytes": cu.download_bytes, "by_source": cu.by_source,
                                  "slots": cu.slots, "pauses": cu.pauses, "download_s": cu.download_s, "held_s": cu.download_held_s,
                                  "between_rounds": cu.entered_between_rounds,
                                  "prefetched_bytes": cu.prefetched_bytes,
                                  "seeded_bytes": cu.seeded_bytes,
                                  "trained_before_admission": cu.trained_before_admission}) + "\n")
    log.write(json.dumps({"event": "done", "t": time.time(), "val": task.val_loss(net)}) + "\n")
    log.close()
    group.leave()


def _run(a: argparse.Namespace, chaos: bool, out: str) -> dict[str, Any]:
    with ExitStack() as stack:
        token = secrets.token_urlsafe(16)   # elastic runs require one; the workers read SHOAL_TOKEN
        env = {**os.environ, "SHOAL_RUN_ID": uuid.uuid4().hex[:8], "OMP_NUM_THREADS": "1", "SHOAL_TOKEN": token,
               "SHOAL_HEAL": a.heal, "SHOAL_HEAL_RATE": a.heal_rate, "SHOAL_HEAL_PACE": a.heal_pace}
        env.pop("SHOAL_ELASTIC_TRACE", None)
        if a.trace:   # the workers and the coordinator write timestamped events (see _recovery)
            env["SHOAL_ELASTIC_TRACE"] = os.path.join(out, "trace")
            os.makedirs(env["SHOAL_ELASTIC_TRACE"], exist_ok=True)
        emu: EmulatedCluster | None = None
        if a.bandwidth:   # one worker per emulated host; the coordinator must live inside the cluster
            emu = stack.enter_context(EmulatedCluster(ClusterSpec(a.workers, 1, (a.bandwidth,))))
            env["SHOAL_COORDINATOR"] = stack.enter_context(
                NamespacedCoordinator(emu, initial_workers=a.workers, env=env, token=token)).address
        else:
            old = os.environ.get("SHOAL_ELASTIC_TRACE")
            os.environ["SHOAL_ELASTIC_TRACE"] = env.get("SHOAL_ELASTIC_TRACE", "")
            try:
                coord = Coordinator(port=0, initial_workers=a.workers, token=token).start()
            finally:
                if old is None:
                    os.environ.pop("SHOAL_ELASTIC_TRACE")
                else:
                    os.environ["SHOAL_ELASTIC_TRACE"] = old
            stack.callback(coord.stop)
            env["SHOAL_COORDINATOR"] = coord.address
        if a.state_cache:   # one file per worker slot, kept across its lives, removed with the run
            env["SHOAL_BENCH_CACHE"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="shoal-chaos-",
                                                                                       dir=_cache_dir(a)))
        res = _chaos_loop(a, chaos, out, env, emu)
        if emu is not None:
            res["host_bytes"] = emu.host_bytes()
        return res


def resumed(log: list[dict[str, Any]]) -> int:
    """The inner steps of its last life that a restart went on from and its admitting round took (0: none)."""
    return max((int(e.get("resumed", 0)) for e in log if e.get("event") == "early"), default=0)


def _cache_dir(a: argparse.Namespace) -> str | None:
    """Where ``--state-cache`` keeps the slots' files: ``/dev/shm`` if it has room for them (a container's is
    often 64 MB), else the default temporary folder (on disk: slower to write, the same bytes)."""
    # a slot's copy (global copies and outer momentum), its own inner AdamW state beside it and its progress (the
    # model and that state again): 7 fp32 numbers a parameter; twice while a write's .tmp replaces them; margin
    need = a.workers * 64 * (3_300_000 if a.task == "lm" else 120_000)
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        return "/dev/shm"
    print(f"--state-cache: /dev/shm lacks {need >> 20} MB; the files go to {tempfile.gettempdir()}", flush=True)
    return None


def _chaos_loop(a: argparse.Namespace, chaos: bool, out: str, env: dict[str, str],
                emu: EmulatedCluster | None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "shoal.bench.chaos", "--worker", "--out", out, "--task", a.task,
            "--strategy", a.strategy,
            "--steps", str(a.steps), "--period", str(a.period), "--width", str(a.width),
            "--layers", str(a.layers), "--op", str(a.op), "--probe", str(a.probe), "--fragments", str(a.fragments),
            "--global-batch", str(a.global_batch), "--joiner-batch", str(a.joiner_batch),
            "--data-seed", str(a.data_seed),
            "--curve", str(0 if chaos else a.curve)]
    procs: dict[int, tuple[subprocess.Popen[bytes], int]] = {}

    def start(rank: int, life: int) -> None:
        f = open(os.path.join(out, f"stdout-{rank}-{life}.txt"), "wb")
        where = {} if emu is None else {"GLOO_SOCKET_IFNAME": emu.interface(rank)}
        if env.get("SHOAL_BENCH_CACHE"):
            where["SHOAL_STATE_CACHE"] = os.path.join(env["SHOAL_BENCH_CACHE"], f"slot-{rank}.state")
        procs[rank] = (subprocess.Popen((emu.exec_prefix(rank) if emu else []) + argv,
                                        env={**env, **where, "RANK": str(rank), "SHOAL_RESTART": str(life)},
                                        stdout=f, stderr=subprocess.STDOUT, start_new_session=True), life)

    rng, kills = random.Random(a.seed), []
    t0, began = time.monotonic(), time.time()
    next_kill = t0 + a.kill_every * rng.uniform(0.7, 1.3)
    try:
        for r in range(a.workers):
            start(r, 0)
        while any(pr.poll() is None for pr, _ in procs.values()):
            now = time.monotonic()
            if now - t0 > a.limit:
                raise TimeoutError(f"run still going after {a.limit} s")
            # Once one worker has finished, the run is over: no more kills, no restarts (a worker
            # restarted now would find nobody to heal from and train alone from scratch).
            finished = any(pr.poll() == 0 for pr, _ in procs.values())
            if finished:   # a restart not admitted before the end would wait Timeouts.join for nothing
                for r, (pr, life) in procs.items():
                    if pr.poll() is None and not _training(out, r, life):
                        os.killpg(pr.pid, signal.SIGKILL)
                        pr.wait()
            due = chaos and not finished and now >= next_kill and now - t0 < a.chaos_for
            # A worker that logged its last step is finished too, also while it is still leaving.
            if due and not any(_done(out, r, life) for r, (_, life) in procs.items()):
                # Only once every worker trains: a kill would otherwise hit one still starting (import,
                # heal), or leave fewer than min_workers, and measure start-up rather than recovery.
                ready = all(_training(out, r, life) for r, (_, life) in procs.items())
                rank = rng.randrange(a.workers)
                pr, life = procs[rank]
                if not ready:
                    next_kill = now + 0.5
                else:
                    if pr.poll() is None:
                        os.killpg(pr.pid, signal.SIGKILL)
                        pr.wait()
                        kills.append({"rank": rank, "life": life, "t": time.time(), "pid": pr.pid, "survivors":
                                      [q.pid for r, (q, _) in procs.items() if r != rank and q.poll() is None]})
                        start(rank, life + 1)
                    next_kill = now + a.kill_every * rng.uniform(0.7, 1.3)
            time.sleep(0.05)
    finally:
        for pr, _ in procs.values():
            if pr.poll() is None:
                os.killpg(pr.pid, signal.SIGKILL)
                pr.wait()
    res = _summarise(out, kills, time.monotonic() - t0, per_worker(a.task), began)
    if not chaos and a.curve:   # the points its workers kept, evaluated as they evaluate their final model
        task = _Task(a, 0)
        net = task.model(a)

        def evaluate(state: dict[str, torch.Tensor]) -> float:
            net.load_state_dict(state)
            return task.val_loss(net)

        res["curve"] = read_curve(out, evaluate, a.workers)
        for n in os.listdir(out):   # 13 MB each on lm: read, not kept
            if n.startswith("curve-"):
                os.unlink(os.path.join(out, n))
    if os.path.isdir(os.path.join(out, "trace")):
        res["recovery"] = _recovery(os.path.join(out, "trace"), kills, out)
        res["kill_log"] = kills
    return res


def _done(out: str, rank: int, life: int) -> bool:
    """Whether that incarnation has logged its end of training (it may still be leaving the group)."""
    try:
        with open(os.path.join(out, f"log-{rank}-{life}.jsonl")) as f:
            return '"event": "done"' in f.read()
    except FileNotFoundError:
        return False


def _training(out: str, rank: int, life: int) -> bool:
    """Whether that incarnation has logged a training step (so it is past start-up and healing)."""
    try:
        with open(os.path.join(out, f"log-{rank}-{life}.jsonl")) as f:
            return sum(1 for _ in f) >= 2
    except FileNotFoundError:
        return False


def _read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def _summarise(out: str, kills: list[dict[str, Any]], wall: float, batch: int, began: float) -> dict[str, Any]:
    logs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for n in os.listdir(out):
        if n.startswith("log-"):
            rank, life = (int(v) for v in n[4:-6].split("-"))
            logs[rank, life] = _read(os.path.join(out, n))
    vals = [e["val"] for lg in logs.values() for e in lg if e.get("event") == "done"]
    steps = [e for lg in logs.values() for e in lg if "dt" in e]
    # The killed incarnation's progress no committed round holds (each fragment's since its last launch), less
    # what its restart went on from (its progress kept on the host, SHOAL_STATE_CACHE_EVERY).
    lost = [max(0.0, unsynced_steps(lg, sync_of(lg)) - resumed(logs.get((k["rank"], k["life"] + 1), [])))
            for k in kills for lg in [logs.get((k["rank"], k["life"]), [])]]
    joins = [e for (_, life), lg in logs.items() if life > 0 for e in lg if e.get("event") == "joined"]
    normal = median_step(logs)
    per_kill, per_join = kill_stalls(logs, kills, normal), join_stalls(logs, kills, normal)
    at_join, cost = admission_stalls(logs, kills, normal), download_costs(logs, kills, normal)
    round_step = median_round_step(logs) or normal   # DiLoCo: a step that ran an outer round (DDP: every step)
    at_round = admission_stalls(logs, kills, round_step)   # beyond a median round
    trained = trained_s(logs, began, wall)
    rate = goodput(logs, batch, trained, sum(lost))
    return {
        "wall_s": wall, "kills": len(kills), "val_loss": statistics.mean(vals) if vals else math.nan,
        "val_loss_spread": (max(vals) - min(vals)) if vals else math.nan,
        "worker_steps": worker_steps(logs, lost),   # committed, each of ``batch`` samples (chaos_curve)
        "rounds_rerun": sum(1 for e in steps if e["discards"]),
        "local_steps_lost_per_failure": statistics.mean(lost) if lost else 0.0,
        "recover_s": [round(e["dt"] - normal, 2) for e in steps if e["discards"]],
        "step_s_median": normal,
        "restart_to_first_step_s": [round(e["t"] - e["started"], 1) for e in joins],
        "heal_s": [round(e["heal_s"], 3) for e in joins],
        "heal_bytes": max((e["heal_bytes"] for e in joins), default=0),
        "params": next((e["params"] for lg in logs.values() for e in lg if "params" in e), 0),
        "joins": join_table(logs, normal),
        # Per kill and per join (shoal.bench.chaos_stats): the survivors' stall, minus a median step.
        "stall_per_kill_s": spread([k["stall_s"] for k in per_kill]),
        # Issue #20's bound: beyond the step in flight (what it had run when the kill struck), at most 2 s.
        "stall_per_kill_beyond_in_flight_s": spread([k["beyond_in_flight_s"] for k in per_kill]),
        # DiLoCo: a kill that meets a round in flight costs a round again; beyond a median round step.
        "stall_per_kill_vs_round_s": spread([k["stall_s"] for k in kill_stalls(logs, kills, round_step)]),
        "stall_per_join_s": spread([j["stall_s"] for j in per_join]),   # ready -> first contribution
        # Issue #20's stall per join (the gap that admitted the joiner), and what its download cost.
        "stall_per_join_admission_s": spread([j["admission_stall_s"] for j in at_join]),
        "stall_per_join_admission_vs_round_s": spread([j["admission_stall_s"] for j in at_round]),
        "joins_admitted_in_their_kills_gap": sum(1 for j in at_join if j["in_own_kill_gap"]),
        "download_cost_per_join_s": spread([j["download_cost_s"] for j in cost]),
        "download_cost_lost_joins_s": spread([j["lost_download_cost_s"] for j in cost]),   # never contributed
        "download_step_max_s": spread([j["download_step_max_s"] for j in cost]),
        "per_join_admission": [{**a, **c} for a, c in zip(at_join, cost)],
        "join_to_first_commit_s": spread([j["first_commit_s"] for j in per_join]),
        "per_kill": per_kill, "per_join": per_join,
        # Over the training's wall time: start to the last worker's end of training (not its leave).
        # Unrounded beside the rounded figure: the ratio of two 2-decimal rates wobbles by +-0.003.
        "goodput_samples_s": round(rate, 2), "goodput_exact": rate, "trained_s": trained,
    }


PHASES = ("request", "publish", "quorum", "barrier", "built", "healed")


def _recovery(folder: str, kills: list[dict[str, Any]], out: str) -> dict[str, Any]:
    """Where each recovery's seconds went, from the trace files (``--trace``).

    For every kill and every worker alive at that moment: ``detect`` (kill to
    the survivor's first failure: a failed collective, or a discard vote),
    then ``commit`` (that failure to its next committed step), and the time
    of each phase in between, measured from the failure: the coordinator's
    re-quorum request and publication, the worker's adoption of the quorum,
    the store barrier, the group built, the heal done. ``stall``: the
    longest gap between two of the survivor's logged steps until the next
    kill (it includes what follows the first commit, e.g. adopting a quorum
    that still lists the dead worker). Failures after the next kill are not
    this kill's: a kill that cost a survivor nothing has no case.
    """
    steps: dict[int, list[float]] = {}
    for name in os.listdir(out):
        if name.startswith("log-"):
            lg = _read(os.path.join(out, name))
            pid = next((e["pid"] for e in lg if e.get("event") == "joined"), None)
            if pid is not None:
                steps[pid] = [e["t"] for e in lg if "dt" in e]
    events: dict[int, list[dict[str, Any]]] = {}
    for name in os.listdir(folder):
        events[int(name.split(".")[0])] = _read(os.path.join(folder, name))
    coord = [e for evs in events.values() for e in evs if e["ev"] in ("request", "publish")]
    cases = []
    for n, k in enumerate(kills):
        until = kills[n + 1]["t"] if n + 1 < len(kills) else float("inf")
        for pid in k["survivors"]:
            evs = [e for e in events.get(pid, []) if k["t"] <= e["t"] < until]
            fail = next((e["t"] for e in evs if e["ev"] == "error"
                         or (e["ev"] == "vote" and e["verdict"] == "discard")), None)
            if fail is None:
                continue
            commit = next((e["t"] for e in evs if e["ev"] == "vote" and e["t"] >= fail
                           and e["verdict"].startswith("commit")), None)
            if commit is None:
                continue
            case = {"detect": fail - k["t"], "commit": commit - fail, "kill_to_commit": commit - k["t"]}
            ts = [k["t"]] + [t for t in steps.get(pid, []) if k["t"] < t < until]
            if len(ts) > 1:
                case["stall"] = max(b - a for a, b in zip(ts, ts[1:]))
            for ph in PHASES:
                pool = coord if ph in ("request", "publish") else evs
                t = next((e["t"] for e in pool if e["ev"] == ph and fail <= e["t"] <= commit), None)
                if t is not None:
                    case[ph] = t - fail
            cases.append(case)

    def dist(key: str) -> dict[str, float]:
        v = sorted(c[key] for c in cases if key in c)
        return {"n": len(v), "median": round(statistics.median(v), 3), "max": round(v[-1], 3)} if v else {"n": 0}

    return {"cases": len(cases), **{k: dist(k) for k in ("detect", "commit", "kill_to_commit", "stall", *PHASES)},
            "each": [{k: round(v, 3) for k, v in c.items()} for c in cases]}


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def equal_samples(res: dict[str, Any], workers: int) -> dict[str, Any] | None:
    """The chaos half's final loss against the fault-free curve at its committed samples
    (:mod:`shoal.bench.chaos_curve`); None without a curve (a step-synchronous strategy, ``--curve 0``)."""
    curve, done = res["fault_free"].get("curve") or [], res["chaos"]["worker_steps"]
    if not curve:
        return None
    ff = at_equal_samples(curve, done / workers)
    ch = res["chaos"]["val_loss"]
    return {"worker_steps": done, "samples_ratio": round(done / res["fault_free"]["worker_steps"], 4),
            "fault_free": ff, "delta_pct": None if ff is None else round(100 * (ch - ff) / ff, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--task", choices=["markov", "lm"], default="markov",
                    help="markov: 108k-parameter LM on a Markov chain; lm: shoal bench's 3.26M-parameter lm task")
    ap.add_argument("--strategy", choices=["localsgd", "diloco", "streaming", "ddp"], default="localsgd")
    ap.add_argument("--fragments", type=int, default=4, help="--strategy streaming: StreamingDiLoCo's fragments")
    ap.add_argument("--period", type=int, default=8, help="local steps per round (localsgd, diloco)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--width", type=int, default=64, help="model width d (64: 108k parameters with 2 layers)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bandwidth", default=None,
                    help="run on an emulated cluster, one worker per host at this tc rate (root), e.g. 20mbit")
    ap.add_argument("--op", type=float, default=10.0, help="Timeouts.op (s)")
    ap.add_argument("--probe", type=float, default=1.0, help="Timeouts.probe (s); heartbeat_timeout is 5x")
    ap.add_argument("--kill-every", type=float, default=10.0)
    ap.add_argument("--chaos-for", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0, help="the kill schedule's seed")
    ap.add_argument("--data-seed", type=int, default=0,
                    help="shifts every sample stream: a fault-free run with another data order shows "
                         "how far the final loss moves without any fault (the loss band's noise floor)")
    ap.add_argument("--limit", type=float, default=1200.0, help="hard limit per run (s)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chaos-only", action="store_true", help="skip the fault-free run")
    ap.add_argument("--trace", action="store_true",
                    help="trace every worker's elastic events and report where recovery time goes")
    ap.add_argument("--keep", default=None, help="keep the workers' logs under this folder")
    ap.add_argument("--heal", choices=["blocking", "background"], default="blocking",
                    help="how restarted workers get the run's state (SHOAL_HEAL; docs/elastic.md); background "
                         "applies to --strategy ddp, diloco and streaming")
    ap.add_argument("--heal-rate", default="", help="background heal: a source's flat rate, e.g. 4mbit (SHOAL_HEAL_RATE)")
    ap.add_argument("--heal-pace", default="", help="background heal: a joiner's share of each step (SHOAL_HEAL_PACE)")
    ap.add_argument("--state-cache", action="store_true",
                    help="each worker slot keeps a copy of the averaged state in /dev/shm for its restart "
                         "(SHOAL_STATE_CACHE; background heal of diloco and streaming)")
    ap.add_argument("--global-batch", type=int, default=0,
                    help="ddp: samples per step over all workers, shared by the step's contributors "
                         "(ElasticSampler(global_batch=N): the survivors of a kill take its share); 0: 8 windows "
                         "per worker (lm), so the global batch shrinks while a worker is missing")
    ap.add_argument("--joiner-batch", type=int, default=0,
                    help="ddp: samples a joiner catching up computes a step, to throw away (ElasticSampler("
                         "joiner_batch=N)); 0: a contributor's share. On the emulated cluster every worker shares "
                         "this machine's cores, so a joiner's discarded share is the contributors' compute")
    ap.add_argument("--curve", type=int, default=4,
                    help="local-step strategies: the fault-free half keeps its workers' models at its last N "
                         "round boundaries, to read its loss at the chaos half's committed samples "
                         "(loss_at_equal_samples; shoal.bench.chaos_curve); 0: none")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    (parse_rate(a.heal_rate) if a.heal_rate else None, parse_pace(a.heal_pace))   # bad: ConfigError here, once
    if a.global_batch and (a.strategy != "ddp" or a.global_batch < 1):
        ap.error(f"--global-batch {a.global_batch}: for --strategy ddp only (a step-synchronous strategy, whose "
                 "steps all workers share), as an integer >= 1")
    if a.joiner_batch and (a.strategy != "ddp" or a.joiner_batch < 0):
        ap.error(f"--joiner-batch {a.joiner_batch}: for --strategy ddp only, as an integer >= 0")
    if a.curve < 0:
        ap.error(f"--curve {a.curve}: the number of round boundaries to keep, >= 0")
    if a.worker:
        worker(a)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # unwind: the workers and emulated hosts are removed
    if a.task == "lm":
        print("task: shoal bench's lm (byte GPT, 3.26 M parameters, Python docs)")
    else:
        print(f"task: order-1 Markov LM over {VOCAB} symbols, loss floor {chain_entropy(_chain()):.4f} nats")
    res: dict[str, Any] = {}
    for name, chaos in (("fault_free", False), ("chaos", True))[int(a.chaos_only):]:
        if a.keep:
            out = os.path.join(a.keep, name)
            os.makedirs(out, exist_ok=True)
            res[name] = _run(a, chaos, out)
        else:
            with tempfile.TemporaryDirectory() as out:
                res[name] = _run(a, chaos, out)
        print(name, json.dumps(res[name]), flush=True)
    if not a.chaos_only:
        ff, ch = res["fault_free"]["val_loss"], res["chaos"]["val_loss"]
        print(f"validation loss: fault-free {ff:.4f}, chaos {ch:.4f} ({100 * (ch - ff) / ff:+.2f} %)")
        res["loss_at_equal_samples"] = equal_samples(res, a.workers)
        if res["loss_at_equal_samples"]:
            e = res["loss_at_equal_samples"]
            head = (f"at equal samples (the chaos half's {e['worker_steps']:.0f} committed worker-steps, "
                    f"{e['samples_ratio']:.3f} of the fault-free half's): ")
            print(head + (f"fault-free {e['fault_free']:.4f}, chaos {ch:.4f} ({e['delta_pct']:+.2f} %)"
                          if e["fault_free"] is not None else
                          "before the fault-free curve's first point: keep more of it (--curve)"))
        base = res["fault_free"]["goodput_exact"]
        res["goodput_ratio"] = round(res["chaos"]["goodput_exact"] / base, 4) if base else math.nan
        c = res["chaos"]
        print(f"goodput (committed samples/s, chaos / fault-free): {res['goodput_ratio']}; survivors' stall per "
              f"kill {c['stall_per_kill_s']} (beyond a median round step: {c['stall_per_kill_vs_round_s']}; "
              f"beyond the step in flight: {c['stall_per_kill_beyond_in_flight_s']}); "
              f"per join: at admission {c['stall_per_join_admission_s']} "
              f"(beyond a median round step: {c['stall_per_join_admission_vs_round_s']}; and "
              f"{c['joins_admitted_in_their_kills_gap']} admitted in their kill's own gap), over the window "
              f"to first contribution {c['stall_per_join_s']}, the download's cost "
              f"{c['download_cost_per_join_s']} (largest step excess {c['download_step_max_s']}; joiners that "
              f"never contributed: {c['download_cost_lost_joins_s']}) (s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
