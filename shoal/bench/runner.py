"""Run each strategy as its own launch, gather the workers' records, summarise.

Strategies run one after another, each as a fresh set of processes started by
:func:`shoal.cli.launcher.launch` (an emulated cluster when ``emulate`` is on,
loopback otherwise), with the same seed, initial weights and global data order.
Single-worker strategies (``local``) run one process without a network.

Example::

    cfg = BenchConfig(strategies=("ddp", "torch-ddp", "local", "nosync"), hosts=4,
                      bandwidth="20mbit", emulate=True, time_budget_s=120)
    results = run_bench(cfg)            # also written to results/<run>/results.json
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from shoal.bench import metrics, strategies
from shoal.bench.schedule import DEFAULT_FINAL_RATIO, default_warmup
from shoal.bench.tasks import TASKS, LMConfig
from shoal.bench.worker import WorkerConfig
from shoal.errors import ConfigError

SCHEMA_VERSION = 1
TARGET_RULES = ("ddp", "worst")
DEFAULT_TOLERANCE = 0.005  # relative: torch-ddp ends 2e-7 above ddp; 0.5% is a tenth of a good DiLoCo's gap
ProgressFn = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class BenchConfig:
    """One comparison: task, strategies, cluster shape, stopping rule, seeds.

    ``bandwidth`` is a tc rate (``"20mbit"``) applied to every emulated host's
    link; it needs ``emulate`` (root, ip, tc). Without ``eval_every_*`` the run
    is evaluated about 12 times: every ``time_budget_s / 12`` seconds, or
    every ``steps // 12`` steps.
    """

    task: str = "lm"
    strategies: tuple[str, ...] = ("ddp", "torch-ddp", "local", "nosync")
    hosts: int = 4
    procs_per_host: int = 1
    bandwidth: str | None = None
    emulate: bool = False
    steps: int | None = None
    time_budget_s: float | None = None
    target_loss: float | None = None
    target: str = "ddp"   # without target_loss: "ddp" (DDP's final loss + tolerance) or "worst"
    target_tolerance: float = DEFAULT_TOLERANCE
    seed: int = 0
    global_batch: int = 32  # 8 windows per worker at 4 hosts: ~0.2 s of compute per step on one core
    lr: float = 1e-3  # AdamW; steady on this model from the first step, no warm-up needed
    eval_every_steps: int | None = None
    eval_every_s: float | None = None
    val_windows: int = 64
    lr_schedule: str = "constant"    # inner lr schedule for every strategy alike (shoal.bench.schedule)
    warmup_steps: int | None = None  # cosine: None = 5 % of the steps
    lr_final_ratio: float = DEFAULT_FINAL_RATIO
    schedule_steps: int | None = None   # the schedule's horizon; None: steps (--mode both's speed run: the quality's)
    model: dict[str, int] = field(default_factory=dict)
    out_root: str = "results"
    run: str = ""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}; available: {', '.join(TASKS)}")
        if not self.strategies:
            raise ConfigError("give at least one strategy")
        if len(set(self.strategies)) != len(self.strategies):
            raise ConfigError(f"strategies are listed twice: {', '.join(self.strategies)}")
        for name in self.strategies:
            strategies.get(name)
        if self.hosts < 1 or self.procs_per_host < 1:
            raise ConfigError(f"hosts ({self.hosts}) and procs_per_host ({self.procs_per_host}) must be >= 1")
        if self.bandwidth is not None and not self.emulate:
            raise ConfigError(
                f"bandwidth {self.bandwidth!r} needs an emulated cluster (emulate=True: root, ip, tc); "
                "on loopback the network is not shaped"
            )
        if self.global_batch % self.world:
            raise ConfigError(
                f"global batch {self.global_batch} must be divisible by the {self.world} workers "
                "so every worker gets an equal slice"
            )
        if self.target_loss is not None and self.target_loss <= 0:
            raise ConfigError(f"target_loss must be > 0 (nats per byte), got {self.target_loss}")
        if self.target not in TARGET_RULES:
            raise ConfigError(f"target must be one of {', '.join(TARGET_RULES)}, got {self.target!r}")
        if not 0 <= self.target_tolerance < 1:
            raise ConfigError(f"target_tolerance is relative, in [0, 1), got {self.target_tolerance}")
        LMConfig(**self.model)
        self.worker_config(self.strategies[0], "unused")  # stopping/eval rules checked here

    @property
    def world(self) -> int:
        return self.hosts * self.procs_per_host

    @property
    def run_name(self) -> str:
        return self.run or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")

    def worker_config(self, strategy: str, out_dir: str) -> WorkerConfig:
        every_steps, every_s = self.eval_every_steps, self.eval_every_s
        if every_steps is None and every_s is None:
            if self.time_budget_s is not None:
                every_s = self.time_budget_s / 12
            else:
                every_steps = max(1, (self.steps or 12) // 12)
        return WorkerConfig(
            strategy=strategy, out_dir=out_dir, task=self.task, model=dict(self.model), seed=self.seed,
            global_batch=self.global_batch, lr=self.lr, steps=self.steps, time_budget_s=self.time_budget_s,
            eval_every_steps=every_steps, eval_every_s=every_s, val_windows=self.val_windows,
            lr_schedule=self.lr_schedule, warmup_steps=self.warmup, lr_final_ratio=self.lr_final_ratio,
            schedule_steps=self.schedule_steps,
        )

    @property
    def warmup(self) -> int:
        """The warm-up steps the workers use: ``warmup_steps``, or 5 % of the horizon for a cosine schedule."""
        if self.warmup_steps is not None or self.lr_schedule != "cosine":
            return self.warmup_steps or 0
        horizon = self.schedule_steps if self.schedule_steps is not None else self.steps
        return default_warmup(horizon) if horizon else 0


def merge_ranks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One list of eval points from every rank's record (ranks evaluate at the same steps).

    Wall seconds and validation loss come from rank 0; byte counts become
    lists indexed by rank.
    """
    records = sorted(records, key=lambda r: r["rank"])
    n = min(len(r["points"]) for r in records)
    merged = []
    for i in range(n):
        p0 = records[0]["points"][i]
        point = {k: p0[k] for k in ("step", "samples", "wall_s", "val_loss")}
        for key in ("meter_sent", "meter_received", "iface_sent", "iface_received"):
            values = [r["points"][i][key] for r in records]
            point[key] = None if any(v is None for v in values) else values
        synced = [r["points"][i].get("synced") for r in records]
        point["synced"] = None if any(v is None for v in synced) else all(synced)
        merged.append(point)
    return merged


class _Poller(threading.Thread):
    """Reads rank 0's progress.json twice a second and reports it."""

    def __init__(self, path: str, name: str, fn: ProgressFn) -> None:
        super().__init__(daemon=True)
        self.path, self.name_, self.fn = path, name, fn
        self.done = threading.Event()

    def run(self) -> None:
        last = None
        while not self.done.wait(0.5):
            try:
                with open(self.path) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                continue
            if info != last:
                last = info
                self.fn(self.name_, info)


_REFUSAL = re.compile(r"^(?:[\w.]+\.)?(\w*ConfigError): (.+)$")


def refusal(log_text: str) -> str | None:
    """Why the strategy refused to run, from its workers' output: the first ``ConfigError`` message.

    A strategy that rejects the run's layout or settings raises a
    :class:`~shoal.errors.ConfigError` in every worker before training (DASO
    on hosts of one worker each); the bench names that reason instead of a
    bare exit code. None when the output holds no such error (a crash).

    >>> refusal("Traceback ...\\nshoal.errors.ConfigError: DASO needs at least 2 workers on every host")
    'DASO needs at least 2 workers on every host'
    >>> refusal("RuntimeError: boom") is None
    True
    """
    for line in log_text.splitlines():
        # the launcher's "[rank] " and the worker's own "[rankN]: " prefixes
        m = _REFUSAL.match(re.sub(r"^(?:\[[^\]]*\]:?\s*)+", "", line.strip()))
        if m:
            return m.group(2).strip()
    return None


def _refusal_of(log_path: str) -> str | None:
    try:
        with open(log_path, errors="replace") as f:
            return refusal(f.read())
    except OSError:
        return None


def run_strategy(cfg: BenchConfig, name: str, run_dir: str, on_progress: ProgressFn | None = None) -> dict[str, Any]:
    """Launch one strategy's workers and return its raw record (points merged over ranks)."""
    from shoal.cli.launcher import ClusterSpec, launch

    spec = strategies.get(name)
    out_dir = os.path.join(run_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, stale))
    wcfg = cfg.worker_config(name, out_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    wcfg.save(cfg_path)
    if spec.single_worker:
        cluster, nprocs = None, 1
    elif cfg.emulate:
        bw = (cfg.bandwidth,) if cfg.bandwidth else ()
        cluster, nprocs = ClusterSpec(cfg.hosts, cfg.procs_per_host, bw), 1
    else:
        cluster, nprocs = None, cfg.world
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)}
    poller = _Poller(os.path.join(out_dir, "progress.json"), name, on_progress) if on_progress else None
    if poller:
        poller.start()
    try:
        with open(os.path.join(out_dir, "log.txt"), "w") as log:
            res = launch([sys.executable, "-m", "shoal.bench.worker", cfg_path], nprocs=nprocs,
                         cluster=cluster, env=env, stdout=log, quiet=True)
    finally:
        if poller:
            poller.done.set()
            poller.join()
    if res.interrupted:  # Ctrl-C / SIGTERM stops the whole bench, not just this strategy
        raise KeyboardInterrupt(f"interrupted while running {name!r}")
    workers = 1 if spec.single_worker else cfg.world
    records = []
    for r in range(workers):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    ok = res.returncode == 0 and len(records) == workers
    log_path = os.path.join(out_dir, "log.txt")
    return {
        "workers": workers, "returncode": res.returncode, "ok": ok, "launch_s": res.duration_s,
        "host_bytes": res.host_bytes if cluster is not None else None,
        "steps": records[0]["steps"] if ok else None, "wall_s": records[0]["wall_s"] if ok else None,
        "points": merge_ranks(records) if ok else [],
        "log": os.path.relpath(log_path, run_dir),
        "refused": None if ok else _refusal_of(log_path),
    }


def _mean(values: list[int] | None) -> float | None:
    return None if not values else sum(values) / len(values)


def pick_target(finals: dict[str, float | None], rule: str = "ddp",
                tolerance: float = DEFAULT_TOLERANCE) -> tuple[float | None, str]:
    """The target loss and how it was chosen, from the strategies' final validation losses.

    ``"ddp"``: DDP's final loss times ``1 + tolerance`` (``torch-ddp``'s when
    ``ddp`` did not run); None when neither finished. ``"worst"``: the highest
    final loss of the connected strategies, reached by every one of them.

    >>> pick_target({"ddp": 2.0, "daso": 3.0})
    (2.01, 'ddp')
    >>> pick_target({"ddp": 2.0, "daso": 3.0}, "worst")
    (3.0, 'worst')
    """
    if rule not in TARGET_RULES:
        raise ConfigError(f"target rule must be one of {', '.join(TARGET_RULES)}, got {rule!r}")
    if rule == "worst":
        return metrics.auto_target({n: v for n, v in finals.items() if not _is_disconnected(n)}), "worst"
    for ref in ("ddp", "torch-ddp"):
        if finals.get(ref) is not None:
            return float(finals[ref]) * (1.0 + tolerance), ref   # type: ignore[arg-type]
    return None, "none"


def credited_points(name: str, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``points`` with the loss of every evaluation before the first synchronisation hidden.

    A multi-worker strategy's evaluated model is one replica until it has
    taken in an exchange (DiLoCo before its first outer step; streaming DiLoCo
    before its first fragment's merge): no better evidence than ``nosync``'s, so
    it earns no time to target, speed-up or efficiency. A point's ``synced``
    (every worker's answer, from :class:`~shoal.bench.registry.Trainer`) says
    so; a point without it (an older results file) counts as synchronised once
    its meter counts a byte, which credits an overlapped exchange one launch
    early. Single-worker strategies hold the whole model.
    """
    try:
        spec = strategies.get(name)
        whole = spec.single_worker or not spec.communicates   # nosync gets no credit at all (summarize)
    except ConfigError:   # a results file from a checkout with more strategies
        whole = False
    if whole:
        return points
    # Step 0 is the same initial model on every worker: a common starting point for the crossing.
    def synced(p: dict[str, Any]) -> bool:
        return bool(p["synced"]) if p.get("synced") is not None else sum(p["meter_sent"]) > 0

    return [p if p["step"] == 0 or synced(p) else {**p, "val_loss": None} for p in points]


def summarize(runs: dict[str, dict[str, Any]], target_loss: float | None, target: str = "ddp",
              tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Add time to target, MB per worker, speed-up and efficiency to each run; build the ideal curve.

    With no ``target_loss`` the target follows ``target`` (:func:`pick_target`):
    by default DDP's final loss within ``tolerance``. Times to target count only
    evaluations after a strategy's first synchronisation (:func:`credited_points`).
    """
    finals = {n: (r["points"][-1]["val_loss"] if r["points"] else None) for n, r in runs.items()}
    source = "given"
    if target_loss is None:
        target_loss, source = pick_target(finals, target, tolerance)
    local, nosync = runs.get("local", {}).get("points"), runs.get("nosync", {}).get("points")
    ideal: dict[str, Any] | None = None
    if local and nosync:
        ideal = {
            "points": metrics.ideal_curve(local, nosync),
            "time_to_target_s": None if target_loss is None else metrics.ideal_time_to_target(local, nosync, target_loss),
        }
    ttt = {n: (metrics.time_to_target(credited_points(n, r["points"]), target_loss) if target_loss is not None
               else None) for n, r in runs.items()}
    for n, r in runs.items():
        last = r["points"][-1] if r["points"] else None
        r["final_val_loss"] = finals[n]
        r["time_to_target_s"] = ttt[n]
        r["mb_sent_per_worker"] = None if last is None else (_mean(last["meter_sent"]) or 0.0) / 1e6
        r["iface_mb_sent_per_worker"] = (
            None if last is None or last["iface_sent"] is None else (_mean(last["iface_sent"]) or 0.0) / 1e6
        )
        # nosync's loss is one replica's, not the cluster's model: no speed-up or efficiency to claim.
        ranked = not _is_disconnected(n)
        r["speedup_vs_ddp"] = metrics.ratio(ttt.get("ddp"), ttt[n]) if ranked else None
        r["efficiency"] = metrics.ratio(ideal["time_to_target_s"] if ideal else None, ttt[n]) if ranked else None
    return {"target_loss": target_loss, "target_source": source, "target_tolerance": tolerance, "ideal": ideal}


def _is_disconnected(name: str) -> bool:
    """True for strategies whose workers never talk (their loss is one replica's)."""
    try:
        spec = strategies.get(name)
    except ConfigError:  # a results file from a checkout with more strategies
        return False
    return not spec.communicates and not spec.single_worker


def resummarize(results: dict[str, Any], target_loss: float | None, target: str = "ddp",
                tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """``results`` (a loaded results.json) summarised again, e.g. against another target loss."""
    runs = results["strategies"]
    return {**results, **summarize(runs, target_loss, target, tolerance), "strategies": runs}


def _commit() -> str:
    """The checkout's short commit (``+dirty`` with local changes), or ``unknown``."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def run_bench(cfg: BenchConfig, on_progress: ProgressFn | None = None,
              on_strategy: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Run every strategy of ``cfg``; write and return ``results.json``'s content."""
    run_dir = os.path.join(cfg.out_root, cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = _commit()   # the code the workers run: taken before they start
    runs: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(cfg.strategies):
        if on_strategy:
            on_strategy(name, i)
        runs[name] = run_strategy(cfg, name, run_dir, on_progress)
    results = {
        "schema": SCHEMA_VERSION,
        "run": os.path.basename(run_dir),
        "started": started,
        "commit": commit,
        "config": {**asdict(cfg), "strategies": list(cfg.strategies), "world": cfg.world, "warmup_steps": cfg.warmup,
                   "model": asdict(LMConfig(**cfg.model))},
        "network": (f"{cfg.hosts} hosts x {cfg.bandwidth or 'unshaped'} (emulated)" if cfg.emulate
                    else f"loopback, {cfg.world} workers"),
        **summarize(runs, cfg.target_loss, cfg.target, cfg.target_tolerance),
        "strategies": runs,
    }
    with open(os.path.join(run_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results
