"""Is communication hidden? NonBlocking's step time against compute alone and communication alone.

On an emulated cluster (root only), every worker measures, one after the
other, on the bench's ``lm`` task (:mod:`shoal.bench.tasks`):

* ``compute``: a training step with no communication (forward, backward,
  AdamW step), per step;
* ``comm``: the per-layer all-reduces NonBlocking issues for one step, alone
  (the same buffers, sizes and order), launched together and waited for;
* ``nonblocking``: steps of :class:`shoal.NonBlocking`, the loop timed as a
  whole (the last step's communication finalised inside the clock), per step;
* ``ddp``: the same for :class:`shoal.DistributedDataParallel`.

A phase's time is the slowest rank's (phases start after a barrier). It
prints ``nonblocking / max(compute, comm)``: 1.0 means communication fully
hidden behind compute or the reverse.

Example::

    python -m shoal.bench.overlap --hosts 4 --bandwidth 20mbit --steps 4
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from typing import Any, Callable

from shoal.cli.cluster import ClusterSpec
from shoal.cli.launcher import launch

_TAG = "OVERLAP_RESULT "


def _timed_loop(group: Any, steps: int, one_step: Callable[[int], None], finish: Callable[[], None]) -> float:
    """Seconds per step of ``steps`` calls of ``one_step`` then ``finish``, after a barrier."""
    group.barrier()
    t0 = time.perf_counter()
    for k in range(steps):
        one_step(k)
    finish()
    return (time.perf_counter() - t0) / steps


def _worker(steps: int, global_batch: int) -> None:
    import torch

    import shoal
    from shoal.bench.tasks import LMConfig, build_task
    from shoal.strategies.nonblocking import find_layers

    torch.set_num_threads(1)
    group = shoal.init(backend="gloo", timeout=900)
    task = build_task("lm", LMConfig())

    def batch(k: int) -> torch.Tensor:
        return task.corpus.train_batch(k, 0, global_batch, group.rank, group.size)

    def trainer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        def one(k: int) -> None:
            task.loss(model, batch(k)).backward()
            opt.step()
            opt.zero_grad()
        return one

    torch.manual_seed(0)
    plain = task.build_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    trainer(plain, plain_opt)(0)  # warm-up: allocator, optimizer state
    out: dict[str, Any] = {"rank": group.rank}
    out["compute"] = _timed_loop(group, steps, trainer(plain, plain_opt), lambda: None)

    buffers = [layer.buffer for layer in find_layers(plain)]
    handles: list[Any] = []

    def comm_step(k: int) -> None:
        handles.extend(group.all_reduce(b, tag="overlap/comm") for b in buffers)

    def comm_finish() -> None:
        for h in handles:
            h.wait()
        handles.clear()

    out["comm"] = _timed_loop(group, steps, comm_step, comm_finish)

    for name, strategy in (("nonblocking", shoal.NonBlocking()), ("ddp", shoal.Sync())):
        torch.manual_seed(0)
        net = task.build_model()
        model, opt = shoal.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3), strategy)
        step = trainer(model, opt)
        step(0)  # warm-up
        out[name] = _timed_loop(group, steps, step, strategy.flush)  # lands the last step's update
    out["params"] = sum(p.numel() for p in plain.parameters())
    print(_TAG + json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


def _run(ns: argparse.Namespace) -> int:
    spec = ClusterSpec(ns.hosts, ns.procs_per_host, tuple(ns.bandwidth.split(",")))
    cmd = [sys.executable, "-m", "shoal.bench.overlap", "--worker", "--steps", str(ns.steps),
           "--global-batch", str(ns.global_batch)]
    out = io.StringIO()
    res = launch(cmd, cluster=spec, stdout=out, quiet=True)
    results = [json.loads(line.split(_TAG, 1)[1]) for line in out.getvalue().splitlines() if _TAG in line]
    if res.returncode != 0 or len(results) != spec.world_size:
        print(out.getvalue(), file=sys.stderr)
        print(f"workers failed (exit {res.returncode})", file=sys.stderr)
        return res.returncode or 1
    t = {k: max(r[k] for r in results) for k in ("compute", "comm", "nonblocking", "ddp")}
    bound = max(t["compute"], t["comm"])
    print(f"lm ({results[0]['params'] / 1e6:.2f} M parameters), {ns.hosts} hosts x {ns.procs_per_host} at "
          f"{ns.bandwidth}, global batch {ns.global_batch}, {ns.steps} timed steps each (slowest rank)")
    print(f"  seconds per step: compute {t['compute']:.2f}, comm {t['comm']:.2f}, "
          f"nonblocking {t['nonblocking']:.2f}, ddp {t['ddp']:.2f}")
    print(f"  nonblocking / max(compute, comm) = {t['nonblocking'] / bound:.3f} (acceptance: <= 1.1); "
          f"ddp / max = {t['ddp'] / bound:.3f}; compute + comm = {t['compute'] + t['comm']:.2f} s")
    print(f"  per rank: {statistics.mean(r['nonblocking'] for r in results):.2f} s mean nonblocking")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--procs-per-host", type=int, default=1)
    p.add_argument("--bandwidth", default="20mbit")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32, help="windows per step over all workers (the bench's default)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        _worker(ns.steps, ns.global_batch)
        return 0
    return _run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
