"""Minor page faults per training step of the bare model, shoal's DDP and torch's DDP (issue #13).

World 2 (gloo on loopback), the overhead bench's tasks (shoal.bench.overhead),
SGD; after 5 warm-up steps per column, ``getrusage(RUSAGE_SELF).ru_minflt``
is read around 20 steps of each column in turn (rank 0's process). A
buffer allocated afresh every step shows up here whatever the machine's
load: its pages fault in at their first write. The median step time is
printed too, but only the fault count is load-independent.

    PYTHONPATH=. python docs/benchmarks/reducer_faults.py mlp
    PYTHONPATH=. python docs/benchmarks/reducer_faults.py transformer
"""

from __future__ import annotations

import copy
import resource
import sys
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from shoal.bench.overhead import Workload, _block
from shoal.testing import run_workers


def worker(rank: int, world: int, task: str, steps: int) -> dict[str, tuple[float, float]]:
    torch.manual_seed(0)
    work = Workload(task)
    base = work.build()
    models: dict[str, Any] = {"bare": copy.deepcopy(base), "shoal": shoal.DistributedDataParallel(copy.deepcopy(base)),
                              "torch": TorchDDP(copy.deepcopy(base))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    for k, m in models.items():
        _block(work, m, opts[k], 5, torch.Generator().manual_seed(rank), [])
    out = {}
    for k, m in models.items():
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times = _block(work, m, opts[k], steps, torch.Generator().manual_seed(rank), [])
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
        out[k] = (faults, 1e3 * sorted(times)[len(times) // 2])
    return out


if __name__ == "__main__":
    task = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    for name, (faults, ms) in run_workers(worker, 2, task, 20, timeout=900)[0].items():
        print(f"{task} {name:6s} minor page faults per step {faults:7.0f}   median step {ms:7.1f} ms")
