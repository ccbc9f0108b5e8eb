"""`shoal bench`: train a real task with several strategies and compare them.

Examples::

    shoal bench --task lm --strategies ddp,torch-ddp,local,nosync --hosts 4 \\
        --bandwidth 20mbit --time-budget 150 --seed 0
    shoal bench --strategies ddp,local --hosts 2 --loopback --steps 50 --target-loss 3.0

Each strategy runs as its own launch with the same seed and data order; the
results go to results/<run>/results.json and results/<run>/report.png, and a
table is printed. See docs/bench.md for how to read it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from shoal.errors import ShoalError


def _parser() -> argparse.ArgumentParser:
    from shoal.bench import strategies

    p = argparse.ArgumentParser(prog="shoal bench", description="Compare training strategies on a real task.")
    p.add_argument("--task", default="lm", help="task to train (default lm: byte-level GPT on Python's docs)")
    p.add_argument("--strategies", default="ddp,torch-ddp,local,nosync",
                   help=f"comma-separated; registered: {', '.join(strategies.available())}")
    p.add_argument("--hosts", type=int, default=4, help="workers (one per emulated host; default 4)")
    p.add_argument("--procs-per-host", type=int, default=1)
    p.add_argument("--bandwidth", default=None, help="per-host link rate, tc units (e.g. 20mbit); emulated only")
    p.add_argument("--loopback", action="store_true",
                   help="do not emulate a cluster even as root: all workers on loopback, unshaped")
    stop = p.add_argument_group("stopping (at least one)")
    stop.add_argument("--steps", type=int, default=None, help="optimizer steps per strategy")
    stop.add_argument("--time-budget", type=float, default=None, help="training seconds per strategy")
    p.add_argument("--target-loss", type=float, default=None,
                   help="validation loss for 'time to target' (default: see --target)")
    p.add_argument("--target", choices=("ddp", "worst"), default="ddp",
                   help="without --target-loss: ddp = DDP's final validation loss + --target-tolerance "
                        "(default); worst = the highest final loss of the compared strategies")
    p.add_argument("--target-tolerance", type=float, default=0.005,
                   help="relative tolerance on DDP's final loss for --target ddp (default 0.005 = 0.5%%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="global batch in windows (split across workers)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="inner learning-rate schedule, the same for every strategy (ddp included): constant "
                        "(default) or cosine = linear warm-up then cosine decay to --lr-final-ratio x --lr; "
                        "a function of the global step, so equal samples means an equal schedule")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="--lr-schedule cosine: warm-up steps (default 5%% of --steps)")
    p.add_argument("--lr-final-ratio", type=float, default=0.1,
                   help="--lr-schedule cosine: the learning rate at the last step, as a fraction of --lr (default 0.1)")
    p.add_argument("--eval-every", default=None, metavar="N|Ss",
                   help="evaluate every N steps, or every S training seconds with an 's' suffix (default: ~12 evals)")
    p.add_argument("--val-windows", type=int, default=64, help="validation windows evaluated (fixed subset)")
    p.add_argument("--width", type=int, default=None, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 4)")
    p.add_argument("--out", default="results", help="results root (default results/)")
    p.add_argument("--run", default="", help="run name (default: a timestamp)")
    p.add_argument("--mode", choices=("time", "samples", "both"), default="time",
                   help="time: every strategy for --time-budget/--steps on the link (default); samples: "
                        "equal samples on loopback (--steps, default 1000), evaluated on a sample grid; "
                        "both: samples, then each strategy's speed on the link (--speed-budget), joined")
    p.add_argument("--speed-budget", type=float, default=60.0,
                   help="--mode both: training seconds per strategy of the speed run (default 60)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--from-results", default=None, metavar="RUN_DIR",
                   help="train nothing: summarise RUN_DIR/results.json again (e.g. with --target-loss), "
                        "rewrite it and its plot, print the table")
    return p


def _can_emulate() -> str | None:
    """None when an emulated cluster can be built here, else why not."""
    from shoal.cli.cluster import check_can_emulate

    try:
        check_can_emulate()
    except ShoalError as e:
        return str(e)
    return None


def config_from_args(args: argparse.Namespace) -> Any:
    """A :class:`~shoal.bench.runner.BenchConfig` from parsed arguments (emulating when possible)."""
    from shoal.bench.runner import BenchConfig

    emulate = not args.loopback and args.hosts * args.procs_per_host > 1
    if emulate:
        why_not = _can_emulate()
        if why_not:
            print(f"shoal bench: running on loopback, unshaped ({why_not.split('. ')[0]})", file=sys.stderr)
            emulate = False
    bandwidth = args.bandwidth if emulate else None
    if args.bandwidth and not emulate:
        print(f"shoal bench: --bandwidth {args.bandwidth} ignored on loopback", file=sys.stderr)
    every_steps = every_s = None
    if args.eval_every:
        text = args.eval_every.strip()
        try:
            every_s, every_steps = (float(text[:-1]), None) if text.endswith("s") else (None, int(text))
        except ValueError:
            raise ShoalError(f"--eval-every must be N (steps) or Ns (seconds), got {args.eval_every!r}") from None
    model = {k: v for k, v in (("d_model", args.width), ("n_layers", args.layers)) if v is not None}
    if "d_model" in model:
        model["n_heads"] = max(1, model["d_model"] // 64)
    return BenchConfig(
        task=args.task, strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
        hosts=args.hosts, procs_per_host=args.procs_per_host, bandwidth=bandwidth, emulate=emulate,
        steps=args.steps, time_budget_s=args.time_budget, target_loss=args.target_loss, target=args.target,
        target_tolerance=args.target_tolerance, seed=args.seed,
        global_batch=args.batch, lr=args.lr, eval_every_steps=every_steps, eval_every_s=every_s,
        val_windows=args.val_windows, model=model, out_root=args.out, run=args.run,
        lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, lr_final_ratio=args.lr_final_ratio,
        schedule_steps=getattr(args, "schedule_steps", None),
    )


class _Bar:
    """A tqdm bar per strategy: steps or training seconds, postfix with the latest loss."""

    def __init__(self, cfg: Any, enabled: bool) -> None:
        self.cfg, self.enabled, self.bar = cfg, enabled, None
        self.total_strategies = len(cfg.strategies)

    def start(self, name: str, index: int) -> None:
        self.close()
        if not self.enabled:
            print(f"[{index + 1}/{self.total_strategies}] {name}", file=sys.stderr)
            return
        from tqdm import tqdm

        by_time = self.cfg.time_budget_s is not None
        total = self.cfg.time_budget_s if by_time else self.cfg.steps
        self.by_time = by_time
        self.bar = tqdm(total=total, desc=f"[{index + 1}/{self.total_strategies}] {name}",
                        unit="s" if by_time else "step", file=sys.stderr, leave=True,
                        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}]{postfix}")

    def update(self, name: str, info: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.n = min(info.get("wall_s", 0.0) if self.by_time else info.get("step", 0), self.bar.total)
        loss = info.get("val_loss") if info.get("val_loss") is not None else info.get("train_loss")
        kind = "val" if info.get("val_loss") is not None else "train"
        self.bar.set_postfix_str(f"step {info.get('step', 0)}, {kind} loss {loss:.3f}" if loss is not None else "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _from_results(run_dir: str, target_loss: float | None, target: str, tolerance: float) -> int:
    import json

    from shoal.bench import report
    from shoal.bench.runner import resummarize

    path = os.path.join(run_dir, "results.json")
    try:
        with open(path) as f:
            loaded = json.load(f)
        report.validate_results(loaded)
        results = resummarize(loaded, target_loss, target, tolerance)
    except (OSError, ValueError, ShoalError) as e:
        print(f"shoal bench: cannot use {path}: {e}", file=sys.stderr)
        return 2
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    report.plot(results, os.path.join(run_dir, "report.png"))
    print(f"shoal bench {results['config']['task']} on {results['network']}")
    print(report.format_table(results))
    return 0


def schedule_line(cfg: Any) -> str:
    """The inner learning rate every strategy trained with, for the table's footer.

    Example:
        >>> from shoal.bench.runner import BenchConfig
        >>> schedule_line(BenchConfig(strategies=("ddp",), steps=100, lr_schedule="cosine"))
        'inner lr (every strategy): AdamW 0.001, cosine: warm-up 5 steps, then down to 0.0001 at step 100'
    """
    text = f"inner lr (every strategy): AdamW {cfg.lr:g}"
    if cfg.lr_schedule == "constant":
        return text + ", constant"
    horizon = cfg.schedule_steps if cfg.schedule_steps is not None else cfg.steps
    return (text + f", cosine: warm-up {cfg.warmup} steps, then down to {cfg.lr * cfg.lr_final_ratio:g} "
            f"at step {horizon}")


SAMPLES_DEFAULT_STEPS = 1000   # equal-samples quality: at least 1,000 steps of the global batch
GRID_POINTS = 20               # evaluations on the sample grid


def _samples_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` for the equal-samples run: loopback, a step count, a grid of sample counts."""
    steps = args.steps or SAMPLES_DEFAULT_STEPS
    return argparse.Namespace(**{**vars(args), "loopback": True, "bandwidth": None, "steps": steps,
                                 "time_budget": None, "eval_every": args.eval_every or str(max(1, steps // GRID_POINTS))})


def _speed_args(args: argparse.Namespace, root: str) -> argparse.Namespace:
    """``args`` for the speed run of ``--mode both``: the link, ``--speed-budget`` seconds, run 'speed'.

    The learning-rate schedule keeps the quality run's horizon (its step count), so step *t* runs with
    the same learning rate in both runs.
    """
    return argparse.Namespace(**{**vars(args), "steps": None, "time_budget": args.speed_budget,
                                 "eval_every": None, "out": root, "run": "speed",
                                 "schedule_steps": _samples_args(args).steps})


def _both(args: argparse.Namespace) -> int:
    """--mode both: equal samples on loopback, speed on the link, one joined table and figure."""
    import datetime
    import json

    from shoal.bench import joined, report

    run = args.run or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = os.path.join(args.out, run)
    quality_args = argparse.Namespace(**{**vars(_samples_args(args)), "out": root, "run": "quality"})
    runs = []
    for sub in (quality_args, _speed_args(args, root)):
        rc, results = _run(sub)
        if results is None:
            return rc
        runs.append(results)
    quality, speed = runs
    target = quality["target_loss"]
    table = joined.join(quality["strategies"], speed["strategies"], target)
    failed = {n: (f"refused in the {kind} run: {r['refused']}" if r.get("refused") else
                  f"exit {r['returncode']} in the {kind} run (see {kind}/{r['log']})")
              for kind, res in (("quality", quality), ("speed", speed))
              for n, r in res["strategies"].items() if not r["ok"]}
    out = {"run": run, "mode": "both", "quality_network": quality["network"], "speed_network": speed["network"],
           "target_loss": target, "target_source": quality["target_source"],
           "target_tolerance": quality.get("target_tolerance"),
           "ideal_time_to_target_s": joined.ideal_time(quality["strategies"], speed["strategies"], target),
           "joined": table, "failed": failed}
    with open(os.path.join(root, "joined.json"), "w") as f:
        json.dump(out, f, indent=1)
    report.plot_joined(quality, speed, out, os.path.join(root, "report.png"))
    print(f"\nshoal bench {args.task}: quality at equal samples ({quality['network']}), "
          f"speed on {speed['network']}")
    print(report.format_rows(joined.table_rows(table, failed)))
    print(report.target_line(quality))
    print(f"\nwrote {root}/joined.json, {root}/report.png, {root}/quality/ and {root}/speed/")
    return 0 if not failed else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.from_results:
        return _from_results(args.from_results, args.target_loss, args.target, args.target_tolerance)
    if args.mode == "both":
        return _both(args)
    rc, _ = _run(_samples_args(args) if args.mode == "samples" else args)
    return rc


def _run(args: argparse.Namespace) -> tuple[int, dict[str, Any] | None]:
    """One bench run from ``args``: (exit code, results or None when it did not run)."""
    from shoal.bench import report
    from shoal.bench.runner import run_bench

    try:
        cfg = config_from_args(args)
    except (ShoalError, ValueError) as e:
        print(f"shoal bench: {e}", file=sys.stderr)
        return 2, None
    bar = _Bar(cfg, enabled=not args.no_progress)
    try:
        results = run_bench(cfg, on_progress=bar.update, on_strategy=bar.start)
    except ShoalError as e:  # e.g. the emulated cluster could not be built
        bar.close()
        print(f"shoal bench: {e}", file=sys.stderr)
        return 1, None
    except KeyboardInterrupt as e:
        bar.close()
        print(f"shoal bench: stopped ({e or 'interrupted'}); workers stopped and the cluster removed", file=sys.stderr)
        return 130, None
    finally:
        bar.close()
    run_dir = os.path.join(cfg.out_root, results["run"])
    report.plot(results, os.path.join(run_dir, "report.png"))
    print(f"\nshoal bench {cfg.task} on {results['network']}")
    print(report.format_table(results))
    print(schedule_line(cfg))
    print(f"\nwrote {os.path.join(run_dir, 'results.json')} and {os.path.join(run_dir, 'report.png')}")
    return (0 if all(s["ok"] for s in results["strategies"].values()) else 1), results
