"""One member of tests/e2e/test_reset_spin.py: allreduces 13 MB on a gloo group, as DiLoCo's pseudogradient.

Run in an emulated host's namespace (``--rank``, ``--size``, ``--store``
host:port of rank 0's TCPStore, ``--out`` a folder). Rank 0 writes
``ready`` once the first allreduce is done; the test then kills the last
rank during the second. A survivor waits for its failed allreduce through an
elastic handle, measures gloo's loop threads' CPU for ``--window`` s, lets go
of the group as a failed quorum's group is let go of (``Link.retire``; the
handle lives on, as a strategy's last one does until its next round), waits
the reaper's grace, measures again, and writes ``<rank>.json``: the two CPU
figures (seconds of CPU in the window).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.comm import lifetime
from shoal.comm.meter import Meter
from shoal.membership.coordinator import Timeouts
from shoal.membership.transport import Link, _ElasticHandle


class _Failures:
    """The step's failures, without a coordinator to raise an abort flag at."""

    error: BaseException | None = None
    aborted = False

    def record(self, err: BaseException) -> None:
        self.error = self.error or err


def loop_cpu() -> float:
    """CPU seconds used so far by this process's gloo loop threads."""
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except FileNotFoundError:
            continue
        if st[st.index("(") + 1:st.rindex(")")] == "gloo_tcp_loop":
            fields = st[st.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def window(seconds: float) -> float:
    a = loop_cpu()
    time.sleep(seconds)
    return loop_cpu() - a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=float, default=3.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    host, port = a.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), a.size, a.rank == 0, timeout=datetime.timedelta(seconds=60))
    op = 60.0
    pg = dist.ProcessGroupGloo(store, a.rank, a.size, datetime.timedelta(seconds=op))
    link = Link(client=None, timeouts=Timeouts(op=op, quorum=2 * op, join=3 * op),  # type: ignore[arg-type]
                factory=lambda spec: None, failures=_Failures(), step=lambda: 0)  # type: ignore[arg-type]
    flat = torch.ones(13_000_000 // 4)
    handle = None
    for i in range(2):
        handle = _ElasticHandle(link, pg.allreduce([flat]), flat, Meter(), "pseudograd", op, None)
        handle.wait()
        if link.failures.error is not None:
            break
        if a.rank == 0 and i == 0:
            (Path(a.out) / "ready").touch()
    if link.failures.error is None:
        return   # the killed rank, had it finished
    before = window(a.window)
    link.retire(pg)
    del pg
    time.sleep(lifetime.REAPER.grace + 0.5)
    after = window(a.window)
    (Path(a.out) / f"{a.rank}.json").write_text(json.dumps({"before": before, "after": after,
                                                             "error": str(link.failures.error)[:200]}))
    del handle


if __name__ == "__main__":
    main()
