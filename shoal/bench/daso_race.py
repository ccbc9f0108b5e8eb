"""DASO's time to DDP's final loss, on an emulated cluster with several workers per host.

Trains the bench's ``lm`` task twice from the same initialisation and data
order, ``--steps`` steps each: shoal DDP (two-level all-reduce across hosts,
chosen automatically) and :class:`shoal.DASO`. The loss compared is the
training loss averaged over all workers and over the last ``--window`` steps.
It prints DDP's final loss and wall time, and the wall time at which DASO's
first reached it (or its own final loss if it never did). Root only.

Example::

    python -m shoal.bench.daso_race --hosts 2 --procs-per-host 2 --bandwidth 100mbit --steps 120
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any

from shoal.cli.cluster import ClusterSpec
from shoal.cli.launcher import launch

_TAG = "RACE_RESULT "


def _worker(strategy: str, steps: int, global_batch: int, spe: int) -> None:
    import torch

    import shoal
    from shoal.bench.tasks import LMConfig, build_task

    torch.set_num_threads(1)
    group = shoal.init(backend="gloo", timeout=900)
    task = build_task("lm", LMConfig())
    torch.manual_seed(0)
    net = task.build_model()
    daso = None
    if strategy == "daso":
        daso = shoal.DASO(total_epochs=steps // spe + 1, steps_per_epoch=spe, warmup_epochs=1,
                          cooldown_epochs=0, max_global_skips=8, stability_level=0.05)
    model, opt = shoal.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3), daso)
    times, losses = [], []
    group.barrier()
    t0 = time.perf_counter()
    for k in range(steps):
        loss = task.loss(model, task.corpus.train_batch(k, 0, global_batch, group.rank, group.size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if daso is not None:
            daso.report_loss(loss.item())
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    everyone = group.all_gather_object(losses)
    if group.rank == 0:
        mean = [sum(r[k] for r in everyone) / len(everyone) for k in range(steps)]
        extra: dict[str, Any] = {}
        if daso is not None:
            extra["skips"] = [gs for _, kind, gs in daso.schedule.events if kind == "launch"]
        sent = opt.strategy.comm_stats().total.bytes_sent  # this rank's, all of the strategy's traffic
        print(_TAG + json.dumps({"times": times, "loss": mean, "bytes_sent": sent, **extra}), flush=True)
    torch.distributed.destroy_process_group()


def _moving(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def _launch(ns: argparse.Namespace, strategy: str) -> dict[str, Any] | None:
    spec = ClusterSpec(ns.hosts, ns.procs_per_host, tuple(ns.bandwidth.split(",")))
    cmd = [sys.executable, "-m", "shoal.bench.daso_race", "--worker", strategy, "--steps", str(ns.steps),
           "--global-batch", str(ns.global_batch), "--steps-per-epoch", str(ns.steps_per_epoch)]
    out = io.StringIO()
    res = launch(cmd, cluster=spec, stdout=out, quiet=True)
    lines = [line.split(_TAG, 1)[1] for line in out.getvalue().splitlines() if _TAG in line]
    if res.returncode != 0 or not lines:
        print(out.getvalue(), file=sys.stderr)
        print(f"{strategy}: workers failed (exit {res.returncode})", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(lines[0])
    return result


def _run(ns: argparse.Namespace) -> int:
    ddp, daso = _launch(ns, "ddp"), _launch(ns, "daso")
    if ddp is None or daso is None:
        return 1
    ddp_ma, daso_ma = _moving(ddp["loss"], ns.window), _moving(daso["loss"], ns.window)
    target, ddp_time = ddp_ma[-1], ddp["times"][-1]
    print(f"lm, {ns.hosts} hosts x {ns.procs_per_host} at {ns.bandwidth}, {ns.steps} steps each, "
          f"global batch {ns.global_batch}, loss = world-mean training loss over the last {ns.window} steps")
    print(f"  ddp : final loss {target:.4f} after {ddp_time:.1f} s ({ddp_time / ns.steps:.2f} s/step), "
          f"{ddp['bytes_sent'] / 2**20:.1f} MiB sent by rank 0")
    hit = next((k for k, v in enumerate(daso_ma) if k >= ns.window - 1 and v <= target), None)
    print(f"  daso: final loss {daso_ma[-1]:.4f} after {daso['times'][-1]:.1f} s "
          f"({daso['times'][-1] / ns.steps:.2f} s/step), {daso['bytes_sent'] / 2**20:.1f} MiB sent by rank 0")
    if hit is None:
        print("  daso never reached ddp's final loss within its steps")
    else:
        t = daso["times"][hit]
        print(f"  daso reached ddp's final loss at step {hit + 1}, {t:.1f} s: {ddp_time / t:.2f}x faster than ddp")
    print(f"  daso global syncs launched: {len(daso['skips'])} (skips at launch: {daso['skips']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.bench.daso_race", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--procs-per-host", type=int, default=2)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--steps-per-epoch", type=int, default=10, help="DASO's epoch, for its schedule")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--window", type=int, default=10, help="steps in the loss moving average")
    p.add_argument("--worker", choices=("ddp", "daso"), help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        _worker(ns.worker, ns.steps, ns.global_batch, ns.steps_per_epoch)
        return 0
    return _run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
