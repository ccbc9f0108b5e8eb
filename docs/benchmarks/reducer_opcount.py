"""Per-step work of shoal's DDP and torch's DDP counted, not timed (issue #13).

One process, world 1 (gloo), the benchmark's GPT (shoal.bench.gpt), batch 2 x 16
tokens, SGD. After 3 warm-up steps, one step (forward, backward, opt.step(),
opt.zero_grad()) is run under a TorchDispatchMode that counts every aten op
dispatched (autograd's thread included), and one under sys.setprofile counting
Python-level calls (Python functions and builtins). Neither count depends on the
machine's load.

    PYTHONPATH=. python docs/benchmarks/reducer_opcount.py tiny
    PYTHONPATH=. python docs/benchmarks/reducer_opcount.py 34m
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils._python_dispatch import TorchDispatchMode

import shoal
from shoal.bench.gpt import GPT, GPT_SIZES


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main(size: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = GPT_SIZES[size]
    x = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    ops: dict[str, Counter[str]] = {}
    calls: dict[str, int] = {}
    for name in ("bare", "shoal", "torch"):
        torch.manual_seed(0)
        net = GPT(cfg)
        model = {"bare": lambda: net, "shoal": lambda: shoal.DistributedDataParallel(net),
                 "torch": lambda: TorchDDP(net)}[name]()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        with CountOps() as mode:
            step()
        ops[name] = mode.counts
        seen: Counter[str] = Counter()
        sys.setprofile(lambda frame, event, arg: seen.update([event]))
        step()
        sys.setprofile(None)
        calls[name] = seen["call"] + seen["c_call"]
    n = sum(1 for _ in GPT(cfg).parameters())
    print(f"gpt {size}: {n} parameter tensors; per step (forward, backward, SGD step, zero_grad), world 1")
    for name, c in ops.items():
        extra = {k: c[k] - ops["bare"][k] for k in sorted(set(c) | set(ops["bare"])) if c[k] != ops["bare"][k]}
        print(f"  {name:5s} aten ops {sum(c.values()):5d} ({sum(c.values()) - sum(ops['bare'].values()):+d} over bare)"
              f"  python calls {calls[name]:5d} ({calls[name] - calls['bare']:+d})  {extra}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")
