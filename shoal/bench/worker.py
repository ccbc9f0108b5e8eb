"""One benchmark worker: train a task with a strategy, evaluate, write JSON.

Started by :mod:`shoal.bench.runner` through ``shoal run``'s launcher (one
process per emulated host) as ``python -m shoal.bench.worker CONFIG.json``;
reads RANK/WORLD_SIZE from the torchrun environment.

Timing: ``wall_s`` counts every second of the training loop except the
evaluations (:class:`Clock`): the strategy's communication, whatever it waits
for and the bench's own per-step control message included. Before an
evaluation the trainer's communication still in flight is drained on the
clock; evaluation then runs between two barriers with the clock stopped, on
rank 0. When stopping or evaluating depends on rank 0's clock
(``time_budget_s`` / ``eval_every_s``), rank 0 broadcasts a two-flag control
message after each step (on the clock, outside the meter), so every rank stops
and evaluates at the same step. Control messages and barriers use a gloo group
of their own (:func:`control_group`), never the strategy's.

Each rank writes ``rank<r>.json``: its eval points (step, samples, wall
seconds, validation loss on rank 0, meter bytes and interface bytes since the
start); rank 0 also keeps ``progress.json`` fresh for the progress bar.

Example (normally done by the runner)::

    cfg = WorkerConfig(strategy="ddp", out_dir="results/x/ddp", steps=50)
    cfg.save("results/x/ddp/config.json")
    launch([sys.executable, "-m", "shoal.bench.worker", "results/x/ddp/config.json"], nprocs=4)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shoal.bench import strategies
from shoal.bench.schedule import DEFAULT_FINAL_RATIO, LRSchedule, ScheduledLR
from shoal.bench.tasks import LMConfig, build_task
from shoal.errors import ConfigError


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one strategy's run needs; identical for every rank.

    Exactly one of ``steps`` / ``time_budget_s`` may be None; when both are
    set the run stops at whichever comes first. Evaluation happens every
    ``eval_every_steps`` steps or every ``eval_every_s`` training seconds
    (one of them), and always at step 0 and at the last step.
    """

    strategy: str
    out_dir: str
    task: str = "lm"
    model: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    global_batch: int = 32
    lr: float = 1e-3
    steps: int | None = None
    time_budget_s: float | None = None
    eval_every_steps: int | None = None
    eval_every_s: float | None = None
    val_windows: int = 64
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_final_ratio: float = DEFAULT_FINAL_RATIO
    schedule_steps: int | None = None   # the schedule's horizon; None: ``steps``

    def __post_init__(self) -> None:
        if self.steps is None and self.time_budget_s is None:
            raise ConfigError("give steps or time_budget_s (or both): the run needs a stopping rule")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"time_budget_s must be > 0, got {self.time_budget_s}")
        if (self.eval_every_steps is None) == (self.eval_every_s is None):
            raise ConfigError("give exactly one of eval_every_steps and eval_every_s")
        if self.eval_every_steps is not None and self.eval_every_steps < 1:
            raise ConfigError(f"eval_every_steps must be >= 1, got {self.eval_every_steps}")
        if self.eval_every_s is not None and self.eval_every_s <= 0:
            raise ConfigError(f"eval_every_s must be > 0, got {self.eval_every_s}")
        if self.global_batch < 1 or self.lr <= 0 or self.val_windows < 1:
            raise ConfigError(
                f"global_batch ({self.global_batch}), lr ({self.lr}) and val_windows "
                f"({self.val_windows}) must be positive"
            )
        strategies.get(self.strategy)  # unknown names fail here, before any process starts
        LMConfig(**self.model)
        self.schedule()

    def schedule(self) -> LRSchedule:
        """The inner learning-rate schedule every strategy trains with (:mod:`shoal.bench.schedule`)."""
        return LRSchedule(self.lr_schedule, self.schedule_steps if self.schedule_steps is not None else self.steps,
                          self.warmup_steps, self.lr_final_ratio)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "WorkerConfig":
        with open(path) as f:
            return cls(**json.load(f))


def interface_bytes(ifname: str | None) -> tuple[int, int] | None:
    """``(sent, received)`` bytes of ``ifname`` in this process's network namespace.

    Read from ``/proc/self/net/dev`` (per-namespace, unlike ``/sys``); None
    when no interface is named (loopback runs, where every worker shares
    ``lo`` and a per-worker figure does not exist).
    """
    if not ifname:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                cols = rest.split()
                return int(cols[8]), int(cols[0])
    return None


def control_group(world: int) -> Any:
    """The process group of the bench's own messages (stop/evaluate flags, evaluation barriers).

    A gloo group of its own, never the strategy's: a control message queued on the
    training group waits behind the strategy's collectives still in flight (NonBlocking's
    per-layer all-reduces), which hid their time in the control message; and a collective
    issued from this thread while a strategy's background thread issues its own on the same
    group could reach the ranks in different orders. Created once per process.
    """
    global _CONTROL
    if world <= 1:
        return None
    if _CONTROL is None:
        _CONTROL = dist.new_group(backend="gloo")
    return _CONTROL


_CONTROL: Any = None


class _Control:
    """Agreement on stop/evaluate after each step, from rank 0's clock (on the control group)."""

    def __init__(self, cfg: WorkerConfig, world: int) -> None:
        self.cfg = cfg
        self.sync = world > 1 and (cfg.time_budget_s is not None or cfg.eval_every_s is not None)
        self.group = control_group(world) if self.sync else None
        self.next_eval_s = cfg.eval_every_s

    def decide(self, step: int, wall_s: float) -> tuple[bool, bool]:
        """``(stop, evaluate)`` after ``step`` steps done and ``wall_s`` training seconds."""
        cfg = self.cfg
        stop = (cfg.steps is not None and step >= cfg.steps) or (
            cfg.time_budget_s is not None and wall_s >= cfg.time_budget_s
        )
        if cfg.eval_every_steps is not None:
            ev = step % cfg.eval_every_steps == 0
        else:
            ev = self.next_eval_s is not None and wall_s >= self.next_eval_s
        flags = torch.tensor([int(stop), int(ev or stop)], dtype=torch.int32)
        if self.sync:
            dist.broadcast(flags, 0, group=self.group)
        if flags[1] and self.next_eval_s is not None:
            while self.next_eval_s <= wall_s:
                self.next_eval_s += cfg.eval_every_s or 0.0
        return bool(flags[0]), bool(flags[1])


class Clock:
    """Training seconds: everything since :meth:`start` except the paused spans (evaluations).

    Every second of the loop counts, the bench's own control messages and
    whatever a strategy waits for included; only what happens between
    :meth:`pause` and :meth:`resume` does not.

    Example:
        >>> c = Clock(); c.start(); t = c.pause(); c.resume(); c.pause() >= t
        True
    """

    def __init__(self) -> None:
        self._since: float | None = None
        self.counted = 0.0

    def start(self) -> None:
        self._since = time.perf_counter()

    resume = start

    def now(self) -> float:
        return self.counted + (0.0 if self._since is None else time.perf_counter() - self._since)

    def pause(self) -> float:
        self.counted, self._since = self.now(), None
        return self.counted


def _evaluate(task: Any, module: torch.nn.Module, val: torch.Tensor) -> float:
    was_training = module.training
    module.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in val.split(32):
            total += float(task.loss(module, chunk)) * len(chunk)
    module.train(was_training)
    return total / len(val)


class _Progress:
    """Rank 0's ``progress.json``, rewritten at most twice a second (atomically)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.last = 0.0

    def write(self, force: bool = False, **info: Any) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.5:
            return
        self.last = now
        with open(self.path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(self.path + ".tmp", self.path)


def train(cfg: WorkerConfig, rank: int, world: int) -> dict[str, Any]:
    """Run the whole training of ``cfg`` on this rank; return this rank's record.

    The record's ``wall_s`` is the :class:`Clock`'s: the loop's real time less its
    evaluations (``eval_s``, measured); ``setup_s`` is the time before the loop (group,
    model, strategy, the step-0 evaluation). Before each evaluation the trainer's
    communication in flight is drained on the clock (``Trainer.drain``).
    """
    torch.set_num_threads(1)
    started = time.perf_counter()
    group = None
    if world > 1:
        from shoal.comm import init

        group = init(backend="gloo")
    task = build_task(cfg.task, LMConfig(**cfg.model))
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and for every strategy
    module = task.build_model()
    # Every optimizer the strategy builds from the factory (and the one it returns) follows the
    # schedule, a function of the global step: the same learning rates for every strategy.
    sched = ScheduledLR(cfg.schedule(), cfg.lr)
    trainer = strategies.get(cfg.strategy).build(
        module, sched.track(lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=0.0)), group
    )
    sched.add(trainer.optimizer)
    scheduled = cfg.lr_schedule != "constant"   # constant: the factory's lr, untouched
    control = _Control(cfg, world)
    rec = _Recorder(cfg, task, trainer, module, rank, world)
    rec.record(0, 0.0)
    setup_s = time.perf_counter() - started - rec.eval_s   # the step-0 evaluation is an evaluation
    clock, step = Clock(), 0
    clock.start()
    while True:
        if scheduled:   # before the forward: ZeRO copies its groups into its shards' as the step begins
            sched.apply(step)
        batch = task.corpus.train_batch(step, cfg.seed, cfg.global_batch, rank, world)
        loss = task.loss(trainer.model, batch)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trainer.before_step(step)
        trainer.optimizer.step()
        trainer.after_step(step)
        if trainer.report_loss is not None:
            trainer.report_loss(loss.item())
        step += 1
        if rec.progress is not None:
            rec.progress.write(step=step, wall_s=clock.now(), train_loss=loss.item())
        stop, evaluate = control.decide(step, clock.now())
        if evaluate:
            trainer.drain()   # communication still in flight lands on the clock, not in the pause
            rec.record(step, clock.pause())
            clock.resume()
        if stop:
            break
    wall = clock.pause()
    ended = time.perf_counter()
    comm = trainer.comm().as_dict()
    trainer.close()
    return {"rank": rank, "world": world, "strategy": cfg.strategy, "steps": step, "wall_s": wall,
            "points": rec.points, "comm": comm, "setup_s": setup_s, "eval_s": rec.eval_s,
            "teardown_s": time.perf_counter() - ended}


class _Recorder:
    """The evaluations of one run: eval points, their seconds, rank 0's progress file."""

    def __init__(self, cfg: WorkerConfig, task: Any, trainer: Any, module: torch.nn.Module,
                 rank: int, world: int) -> None:
        self.cfg, self.task, self.trainer, self.module, self.rank = cfg, task, trainer, module, rank
        self.group = control_group(world)
        self.val = task.corpus.val_windows(cfg.val_windows)
        self.ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        self.if0 = interface_bytes(self.ifname)
        self.progress = _Progress(os.path.join(cfg.out_dir, "progress.json")) if rank == 0 else None
        self.points: list[dict[str, Any]] = []
        self.eval_s = 0.0

    def record(self, step: int, wall_s: float) -> None:
        t0 = time.perf_counter()
        if self.group is not None:
            dist.barrier(group=self.group)
        trainer = self.trainer
        loss = _evaluate(self.task, trainer.eval_module or self.module, self.val) if self.rank == 0 else None
        c = trainer.comm()
        now_if, if0 = interface_bytes(self.ifname), self.if0
        self.points.append({
            "step": step, "samples": step * self.cfg.global_batch, "wall_s": wall_s, "val_loss": loss,
            "meter_sent": c.bytes_sent, "meter_received": c.bytes_received,
            "iface_sent": None if now_if is None or if0 is None else now_if[0] - if0[0],
            "iface_received": None if now_if is None or if0 is None else now_if[1] - if0[1],
            "comm_wait_s": c.wait_seconds,
            # None: the strategy does not say; the credit rule then reads the bytes (runner.credited_points).
            "synced": trainer.synced() if trainer.synced is not None else None,
        })
        if self.progress is not None:
            self.progress.write(force=True, step=step, wall_s=wall_s, val_loss=loss)
        if self.group is not None:
            dist.barrier(group=self.group)
        self.eval_s += time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shoal.bench.worker CONFIG.json", file=sys.stderr)
        return 2
    cfg = WorkerConfig.load(args[0])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    record = train(cfg, rank, world)
    path = os.path.join(cfg.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
