"""All-reduce throughput on an emulated cluster against the ring bound.

Runs one worker per rank on an emulated cluster (root only), all-reduces a
float32 tensor of ``--mb`` MiB a few times and compares the time of one
all-reduce with the ring bound ``2(W-1)/W * S / B`` (W ranks, S bytes, B the
slowest link's bytes/s): with a ring in rank order each host's one outgoing
cross-host edge carries ``2(W-1)/W * S`` bytes, so no schedule of the ring can
beat it. It also compares the bytes each host's link really carried
(interface counters, so including TCP/IP headers and the store's traffic)
with the meter's formula for its ranks.

With ``--hierarchical`` each timed flat all-reduce is followed by a
two-level one (:class:`shoal.codecs.Hierarchical`: reduce inside the host,
all-reduce among host leaders, broadcast inside the host), both on the same
data, so the speed-up is measured within one run; its bound is the ring bound
over the ``H`` host leaders, ``2(H-1)/H * S / B``.

Example::

    python -m shoal.bench.allreduce --hosts 4 --bandwidth 100mbit --mb 64
    python -m shoal.bench.allreduce --hosts 2 --procs-per-host 2 --bandwidth 100mbit --hierarchical
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from typing import Any

from shoal.cli.cluster import ClusterSpec, parse_rate
from shoal.cli.launcher import launch
from shoal.codecs.hierarchical import Hierarchical

_TAG = "BENCH_RESULT "


def _worker(mb: float, iters: int, warmup: int, hierarchical: bool, chunk_mb: float) -> None:
    import torch

    import shoal

    torch.set_num_threads(1)
    group = shoal.init(backend="gloo", timeout=900)
    t = torch.ones(int(mb * 2**20) // 4)
    two_level = Hierarchical(chunk_mb=chunk_mb)
    hosts_found = two_level.setup(group).topology.num_hosts if hierarchical else 0
    for _ in range(warmup):
        group.all_reduce(t, tag="bench/warmup").wait()
        if hierarchical:
            two_level.mean([t], ["t"], group, tag="bench/warmup-hier")
    times, hier_times = [], []
    ok = True
    mean = (group.size + 1) / 2  # mean of rank + 1 over ranks
    for _ in range(iters):
        t.fill_(group.rank + 1)
        group.barrier()  # start together: a rank that lags would be timed as network time
        t0 = time.perf_counter()
        group.all_reduce(t, tag="bench/timed").wait()
        times.append(time.perf_counter() - t0)
        ok = ok and bool(torch.all(t == mean * group.size))
        if hierarchical:
            t.fill_(group.rank + 1)
            group.barrier()
            t0 = time.perf_counter()
            two_level.mean([t], ["t"], group, tag="bench/hier")
            hier_times.append(time.perf_counter() - t0)
            ok = ok and bool(torch.all(t == mean))
    c = group.meter.counters()
    print(_TAG + json.dumps({"rank": group.rank, "times": times, "hier_times": hier_times, "hosts_found": hosts_found,
                             "sent": c.bytes_sent, "received": c.bytes_received, "correct": ok}), flush=True)
    torch.distributed.destroy_process_group()


def _run(ns: argparse.Namespace) -> int:
    spec = ClusterSpec(ns.hosts, ns.procs_per_host, tuple(ns.bandwidth.split(",")))
    cmd = [sys.executable, "-m", "shoal.bench.allreduce", "--worker", "--mb", str(ns.mb),
           "--iters", str(ns.iters), "--warmup", str(ns.warmup)] + (["--hierarchical"] if ns.hierarchical else []) + ["--chunk-mb", str(ns.chunk_mb)]
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
    if ns.hierarchical:
        _report_hierarchical(results, ns, measured, size / slowest)
    assert res.host_bytes is not None  # emulated run: launch always reads the counters
    if ns.procs_per_host > 1:
        print("  (several ranks per host: the meter also counts traffic between ranks of one host, "
              "which never crosses the host's link)")
    for h, b in enumerate(res.host_bytes):
        ranks = results[h * ns.procs_per_host:(h + 1) * ns.procs_per_host]
        ms, mr = sum(r["sent"] for r in ranks), sum(r["received"] for r in ranks)
        print(f"  host {h}: interface sent {b['sent']:,} B / meter {ms:,} B ({b['sent'] / ms:.3f}x); "
              f"received {b['received']:,} B / meter {mr:,} B ({b['received'] / mr:.3f}x)")
    return 0


def _report_hierarchical(results: list[dict[str, Any]], ns: argparse.Namespace, flat: float, seconds_per_s: float) -> None:
    per_iter = [max(r["hier_times"][i] for r in results) for i in range(ns.iters)]
    hier = statistics.median(per_iter)
    bound = 2 * (ns.hosts - 1) / ns.hosts * seconds_per_s
    print(f"  hosts found by topology discovery: {results[0]['hosts_found']}")
    print(f"  two-level (hierarchical) seconds: {', '.join(f'{t:.2f}' for t in per_iter)} (median {hier:.2f})")
    print(f"  leaders' ring bound 2(H-1)/H*S/B: {bound:.2f} s; bound/measured = {bound / hier:.1%}")
    print(f"  speed-up of two-level over flat: {flat / hier:.2f}x "
          f"(ratio of bounds {(ns.hosts * ns.procs_per_host - 1) / (ns.hosts * ns.procs_per_host) / ((ns.hosts - 1) / ns.hosts):.2f}x)")
    per_pair = [max(r["times"][i] for r in results) / per_iter[i] for i in range(ns.iters)]
    print(f"  speed-up per pair of runs: {', '.join(f'{x:.2f}x' for x in per_pair)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.bench.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--procs-per-host", type=int, default=1)
    p.add_argument("--bandwidth", default="100mbit", help="one tc rate, or one per host comma-separated")
    p.add_argument("--mb", type=float, default=64.0, help="MiB of float32 to all-reduce")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hierarchical", action="store_true",
                   help="also time the two-level all-reduce (reduce in host, leaders, broadcast) on the same data")
    p.add_argument("--chunk-mb", type=float, default=Hierarchical().chunk_mb,
                   help="MiB per pipelined chunk of the two-level all-reduce")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        _worker(ns.mb, ns.iters, ns.warmup, ns.hierarchical, ns.chunk_mb)
        return 0
    return _run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
