"""Step time of shoal's DDP against torch's DDP and the bare model, measured in one run.

The bare model and both wrappers live in the same worker processes and train
alternately in blocks of steps, so machine noise hits all three alike; the
figures reported are ratios of median step times (shoal / torch, and each
wrapper / bare). Bytes per step are the meter's count, checked against the
ring formula ``2(N-1)/N * gradient bytes``.

    python -m shoal.bench.overhead --workers 2 --steps 20 --rounds 5
    python -m shoal.bench.overhead --device cuda      # gpt (34M), world 1 and 2, NCCL

On ``--device cuda`` every step is bracketed by ``torch.cuda.synchronize()``,
so GPU time is measured, not launch time. Each rank uses its own GPU when
there are enough, else all share ``cuda:0`` (each rank then gets its own
``NCCL_HOSTID`` and NCCL talks over sockets on loopback, as separate hosts).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from shoal.bench.gpt import GPT, GPT_SIZES
from shoal.comm.meter import wire_bytes
from shoal.testing import run_workers

TASKS = ("mlp", "transformer", "gpt")
COLUMNS = ("bare", "shoal", "torch")
# The same optimizer in every column. The fused ones skip a non-finite step on the device, so shoal's
# DDP reads its verdict without a host sync there (shoal.nonfinite); plain SGD needs the host read.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-3, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
}


def mlp() -> nn.Module:
    """~5.2M parameters: 256 -> 2048 -> 2048 -> 256."""
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 256))


class TinyTransformer(nn.Module):
    """~3.3M parameters: 4 pre-norm encoder layers, d=256, on 64 tokens of 256 symbols."""

    def __init__(self, vocab: int = 256, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


@dataclass(frozen=True)
class Workload:
    """What one benchmark row trains: the task, its batch shape, the GPT size and the device.

    ``batch``/``context`` of 0 mean the task's default (mlp: 64 rows;
    transformer: 8 x 64 tokens; gpt: 16 x the size's context).
    """

    task: str
    batch: int = 0
    context: int = 0
    gpt_size: str = "34m"
    device: str = "cpu"

    def shape(self) -> tuple[int, int]:
        """(batch, context) after defaults; context is 0 for the mlp."""
        if self.task == "mlp":
            return self.batch or 64, 0
        if self.task == "transformer":
            return self.batch or 8, self.context or 64
        return self.batch or 16, self.context or GPT_SIZES[self.gpt_size].context

    def vocab(self) -> int:
        return GPT_SIZES[self.gpt_size].vocab if self.task == "gpt" else 256

    def build(self) -> nn.Module:
        if self.task == "mlp":
            return mlp()
        return TinyTransformer() if self.task == "transformer" else GPT(GPT_SIZES[self.gpt_size])

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch (input, target) drawn on the CPU from ``g``, moved to the device."""
        batch, context = self.shape()
        if self.task == "mlp":
            x, y = torch.randn(batch, 256, generator=g), torch.randn(batch, 256, generator=g)
        else:
            x = torch.randint(0, self.vocab(), (batch, context), generator=g)
            y = torch.roll(x, -1, dims=1)
        return x.to(self.device), y.to(self.device)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if self.task == "mlp":
            return F.mse_loss(out, y)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _block(task: str | Workload, model: nn.Module, opt: torch.optim.Optimizer, steps: int,
           g: torch.Generator, losses: list[float]) -> list[float]:
    """Train ``steps`` steps; return each step's seconds (GPU work included on CUDA)."""
    work = task if isinstance(task, Workload) else Workload(task)
    sync: Callable[[], None] = torch.cuda.synchronize if work.device.startswith("cuda") else (lambda: None)
    times = []
    for _ in range(steps):
        x, y = work.sample(g)
        sync()  # the batch's copy and the previous step's kernels stay off this step's clock
        t0 = time.perf_counter()
        loss = work.loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times


def _join_nccl(rank: int, world: int, timeout_s: float) -> int:
    """Join an NCCL group; return this rank's GPU index (its own, or 0 when ranks outnumber GPUs)."""
    shared = torch.cuda.device_count() < world
    index = 0 if shared else rank
    os.environ["LOCAL_RANK"] = str(index)
    if shared and world > 1:
        # NCCL refuses two ranks of one host on one GPU: present each rank as a host of its own.
        os.environ.update(NCCL_HOSTID=f"shoal-overhead-{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    torch.cuda.set_device(index)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return index


def _order(r: int) -> list[str]:
    """Round ``r``'s block order: shoal and torch alternate first/second; bare moves through every slot."""
    order = ["shoal", "torch"] if r % 2 == 0 else ["torch", "shoal"]
    order.insert(r % 3, "bare")
    return order


def _worker(rank: int, world: int, work: Workload, steps: int, rounds: int, warmup: int,
            optimizer: str = "sgd") -> dict[str, Any]:
    gpu: int | None = _join_nccl(rank, world, 600.0) if work.device == "cuda" else None
    try:
        work = Workload(work.task, work.batch, work.context, work.gpt_size,
                        "cpu" if gpu is None else f"cuda:{gpu}")
        return _measure(rank, world, work, steps, rounds, warmup, gpu, optimizer)
    finally:
        if gpu is not None and dist.is_initialized():
            dist.destroy_process_group()


def _measure(rank: int, world: int, work: Workload, steps: int, rounds: int, warmup: int,
             gpu: int | None, optimizer: str = "sgd") -> dict[str, Any]:
    torch.manual_seed(0)
    base = work.build().to(work.device)
    ids = None if gpu is None else [gpu]
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    models: dict[str, nn.Module] = {"bare": copy.deepcopy(base), "shoal": ours,
                                    "torch": TorchDDP(copy.deepcopy(base), device_ids=ids)}
    opts = {k: OPTIMIZERS[optimizer](m.parameters()) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in COLUMNS}
    losses: dict[str, list[float]] = {k: [] for k in COLUMNS}
    for k in COLUMNS:  # warm-up: allocator, connections, kernel choice
        _block(work, models[k], opts[k], warmup, torch.Generator().manual_seed(rank), [])
    for r in range(rounds):
        for k in _order(r):
            # Same data for every column: each block replays the same seed.
            gk = torch.Generator().manual_seed(1000 * r + rank)
            times[k] += _block(work, models[k], opts[k], steps, gk, losses[k])
    numel = sum(p.numel() for p in base.parameters())
    elem = next(base.parameters()).element_size()
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "final_loss": {k: v[-1] for k, v in losses.items()},
        "params": numel,
        "gpu": None if gpu is None else torch.cuda.get_device_name(gpu),
        "gpus_shared": gpu is not None and torch.cuda.device_count() < world,
        "bytes_sent_per_step": ours.comm_stats().last.bytes_sent,
        "formula_bytes": sum(wire_bytes("all_reduce", b.buffer.numel() * b.buffer.element_size(), world)[0]
                             for b in ours.reducer.buckets),
        "ring_bound_bytes": 2 * (world - 1) * numel * elem // world,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo on loopback; cuda: NCCL, GPU time per step (default cpu)")
    ap.add_argument("--workers", default=None,
                    help="world size, or several comma-separated (default: 2 on cpu, 1,2 on cuda)")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=5, help="timed blocks per column, in rotating order")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per column before the first block")
    ap.add_argument("--tasks", default=None, help=f"comma-separated, of {', '.join(TASKS)} "
                    "(default: mlp,transformer on cpu, gpt on cuda)")
    ap.add_argument("--gpt-size", choices=tuple(GPT_SIZES), default="34m", help="size of the gpt task (default 34m)")
    ap.add_argument("--batch", type=int, default=0, help="rows per rank and step (default: the task's; gpt 16)")
    ap.add_argument("--context", type=int, default=0,
                    help="tokens per row for transformer/gpt (default: 64; gpt: the size's context, 256)")
    ap.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                    help="the optimizer of every column (default sgd; the fused ones skip a non-finite step on "
                         "the device, so shoal reads its verdict without a host sync)")
    ap.add_argument("--json", help="write results here")
    return ap


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[str]]:
    """Arguments, world sizes and tasks; a bad value ends the program with exit code 2 and says why."""
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        worlds = [int(w) for w in (args.workers or ("2" if args.device == "cpu" else "1,2")).split(",")]
    except ValueError:
        ap.error(f"--workers must be an integer or comma-separated integers, got {args.workers!r}")
    tasks = (args.tasks or ("mlp,transformer" if args.device == "cpu" else "gpt")).split(",")
    if any(w < 1 for w in worlds):
        ap.error(f"--workers must be >= 1 (world 1 still wraps the model over a 1-rank group), got {args.workers}")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.batch < 0 or args.context < 0:
        ap.error("--warmup, --batch and --context must be >= 0 (0 for --batch/--context: the task's default)")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(TASKS)}")
    longest = GPT_SIZES[args.gpt_size].context
    if "gpt" in tasks and args.context > longest:
        ap.error(f"--context {args.context} is longer than the {args.gpt_size} gpt's position table ({longest})")
    if args.device == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no GPU or driver was found"
        ap.error(f"--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False ({why}, "
                 f"torch {torch.__version__}); run with --device cpu")
    return args, worlds, tasks


def _row(task: str, world: int, r: dict[str, Any]) -> str:
    ms = {k: 1e3 * v for k, v in r["median_s"].items()}
    check = "ok" if r["bytes_ok"] else "MISMATCH"
    return (f"{task:<12} {world:>5} {r['params']:>11,} {ms['bare']:>8.1f} {ms['shoal']:>9.1f} {ms['torch']:>9.1f} "
            f"{r['ratio']:>11.3f} {r['overhead_vs_bare']['shoal']:>10.3f} {r['overhead_vs_bare']['torch']:>10.3f} "
            f"{r['final_loss']['shoal']:>10.4f} {r['final_loss']['torch']:>10.4f} "
            f"{r['bytes_sent_per_step'] / 1e6:>8.3f} {r['formula_bytes'] / 1e6:>10.3f} {check:>5}")


def main(argv: list[str] | None = None) -> int:
    args, worlds, tasks = _parse(argv)
    results: list[dict[str, Any]] = []
    backend = "NCCL" if args.device == "cuda" else "gloo on loopback"
    print(f"device {args.device} ({backend}); {args.rounds} rotating blocks of {args.steps} steps per column "
          f"after {args.warmup} warm-up steps, optimizer {args.optimizer}; ms = median step time per rank")
    print(f"{'task':<12} {'world':>5} {'params':>11} {'bare ms':>8} {'shoal ms':>9} {'torch ms':>9} "
          f"{'shoal/torch':>11} {'shoal/bare':>10} {'torch/bare':>10} {'shoal loss':>10} {'torch loss':>10} "
          f"{'MB/step':>8} {'formula MB':>10} {'bytes':>5}", flush=True)
    for world in worlds:
        for task in tasks:
            work = Workload(task, args.batch, args.context, args.gpt_size, args.device)
            r = run_workers(_worker, world, work, args.steps, args.rounds, args.warmup, args.optimizer, timeout=1800,
                            init_group=args.device == "cpu")[0]
            med = r["median_s"]
            batch, context = work.shape()
            row = dict(r, task=task, world=world, device=args.device, batch=batch, context=context,
                       gpt_size=args.gpt_size if task == "gpt" else None,
                       median_ms={k: 1e3 * v for k, v in med.items()},
                       ratio=med["shoal"] / med["torch"],
                       overhead_vs_bare={k: med[k] / med["bare"] for k in ("shoal", "torch")},
                       bytes_ok=r["bytes_sent_per_step"] == r["formula_bytes"])
            results.append(row)
            print(_row(task, world, row), flush=True)
    gpus = sorted({(r["gpu"], r["gpus_shared"]) for r in results if r["gpu"]}, key=str)
    for name, shared in gpus:
        print(f"GPU: {name}" + (" (shared by the ranks; NCCL over sockets on loopback)" if shared else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                       "optimizer": args.optimizer, "torch": torch.__version__, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
