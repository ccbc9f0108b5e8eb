"""All-reduce throughput on an emulated cluster against the ring bound.

Runs one worker per rank on an emulated cluster (root only), all-reduces a
float32 tensor of ``--mb`` MiB a few times and compares the time of one
all-reduce with the ring bound ``2(W-1)/W * S / B`` (W ranks, S bytes, B the
slowest link's bytes/s): with a ring in rank order each host's one outgoing
cross-host edge carries ``2(W-1)/W * S`` bytes, so no schedule of the ring can
beat it. It also compares the bytes each host's link really carried
(interface counters, so including TCP/IP headers and the store's traffic)
with the meter's formula for its ranks.

Example::

    python -m shoal.bench.allreduce --hosts 4 --bandwidth 100mbit --mb 64
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time

from shoal.cli.cluster import ClusterSpec, parse_rate
from shoal.cli.launcher import launch

_TAG = "BENCH_RESULT "


def _worker(mb: float, iters: int, warmup: int) -> None:
    import torch

    import shoal

    torch.set_num_threads(1)
    group = shoal.init(backend="gloo", timeout=900)
    t = torch.ones(int(mb * 2**20) // 4)
    for _ in range(warmup):
        group.all_reduce(t, tag="bench/warmup").wait()
    times = []
    for _ in range(iters):
        group.barrier()  # start together: a rank that lags would be timed as network time
        t0 = time.perf_counter()
        group.all_reduce(t, tag="bench/timed").wait()
        times.append(time.perf_counter() - t0)
    world = group.size
    expected = float(world ** (warmup + iters))  # ones summed W times, then again...
    ok = bool(torch.allclose(t[:8], torch.full((8,), expected)))
    c = group.meter.counters()
    print(_TAG + json.dumps({"rank": group.rank, "times": times, "sent": c.bytes_sent,
                             "received": c.bytes_received, "correct": ok}), flush=True)
    torch.distributed.destroy_process_group()


def _run(ns: argparse.Namespace) -> int:
    spec = ClusterSpec(ns.hosts, ns.procs_per_host, tuple(ns.bandwidth.split(",")))
    cmd = [sys.executable, "-m", "shoal.bench.allreduce", "--worker", "--mb", str(ns.mb),
           "--iters", str(ns.iters), "--warmup", str(ns.warmup)]
    out = io.StringIO()
    res = launch(cmd, cluster=spec, stdout=out, quiet=True)
    results = sorted((json.loads(line.split(_TAG, 1)[1]) for line in out.getvalue().splitlines()
                      if _TAG in line), key=lambda r: r["rank"])
    if res.returncode != 0 or len(results) != spec.world_size:
        print(out.getvalue(), file=sys.stderr)
        print(f"workers failed (exit {res.returncode})", file=sys.stderr)
        return res.returncode or 1
    w, size = spec.world_size, int(ns.mb * 2**20) // 4 * 4
    slowest = min(parse_rate(b) for b in spec.bandwidth)
    bound = 2 * (w - 1) / w * size / slowest
    per_iter = [max(r["times"][i] for r in results) for i in range(ns.iters)]
    measured = statistics.median(per_iter)
    print(f"all-reduce of {size / 2**20:g} MiB over {ns.hosts} hosts x {ns.procs_per_host} procs "
          f"at {ns.bandwidth}: results {'correct' if all(r['correct'] for r in results) else 'WRONG'}")
    print(f"  seconds per all-reduce: {', '.join(f'{t:.2f}' for t in per_iter)} (median {measured:.2f})")
    print(f"  ring bound 2(W-1)/W*S/B: {bound:.2f} s; bound/measured = {bound / measured:.1%}")
    assert res.host_bytes is not None  # emulated run: launch always reads the counters
    for h, b in enumerate(res.host_bytes):
        ranks = results[h * ns.procs_per_host:(h + 1) * ns.procs_per_host]
        ms, mr = sum(r["sent"] for r in ranks), sum(r["received"] for r in ranks)
        print(f"  host {h}: interface sent {b['sent']:,} B / meter {ms:,} B ({b['sent'] / ms:.3f}x); "
              f"received {b['received']:,} B / meter {mr:,} B ({b['received'] / mr:.3f}x)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.bench.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--procs-per-host", type=int, default=1)
    p.add_argument("--bandwidth", default="100mbit", help="one tc rate, or one per host comma-separated")
    p.add_argument("--mb", type=float, default=64.0, help="MiB of float32 to all-reduce")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        _worker(ns.mb, ns.iters, ns.warmup)
        return 0
    return _run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
