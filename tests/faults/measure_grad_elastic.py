"""Byte counters of elastic ZeRO under a SIGKILL (not a test: prints figures for docs/zero.md).

Runs grad_worker.py (3 workers, hidden width 512, Adam) with rank 2 SIGKILLed in
its gradient all-reduce of step 5 and restarted, with and without replicas, and
prints each final member's ZeRO counters.

    PYTHONPATH=$PWD python tests/faults/measure_grad_elastic.py /tmp/out
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

from shoal.testing import FaultPlan  # noqa: E402

KEYS = ("reshards", "reshard_bytes", "replica_bytes", "lost_params", "lost", "replica_drift", "discards")


def main(root: str) -> None:
    for extra in (["--replicate"], []):
        d = os.path.join(root, "replicate" if extra else "plain")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        plan = FaultPlan().crash(rank=2, step=5, nth=0)
        args = ["--kind", "zero", "--steps", "20", "--width", "512", "--want-size", "3", "--pace", "0.05",
                "--op", "10", *extra]
        code, out = harness.run_launcher(d, 3, ["--min-workers", "2", "--max-restarts", "1"], args,
                                         env={"SHOAL_FAULT_PLAN": plan.to_json()}, hard_limit=200,
                                         script="grad_worker.py")
        for r in out.final():
            print("replicate" if extra else "plain", "exit", code, "rank", r["rank"], "life", r["life"],
                  {k: r["zero"][k] for k in KEYS}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shoal-measure-zero")
