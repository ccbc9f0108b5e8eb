"""Worker functions of tests/cuda (module level, so that forked workers can import them).

Every worker trains on cuda:0 (all ranks share the GPU, see onegpu.py) with
its rank's own data, and returns plain floats and CPU tensors.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from collab_peers import PeerRun, run_peers
from shoal import codecs

# cuda:0 (every rank shares it). SHOAL_TEST_DEVICE=cpu runs the same workers over gloo on the CPU:
# a dry run of the tests' own logic on a machine without a GPU (see onegpu.run_nccl).
DEV = torch.device(os.environ.get("SHOAL_TEST_DEVICE", "cuda:0"))
IDS = [0] if DEV.type == "cuda" else None


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(16, width), nn.Linear(width, width), nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batches(rank: int, steps: int, dtype: torch.dtype = torch.float32, n: int = 16) -> list[tuple[torch.Tensor, ...]]:
    """The same batches on every call for a rank; different between ranks."""
    g = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    out = []
    for _ in range(steps):
        x = torch.randn(n, 16, generator=g)
        out.append((x.to(DEV, dtype), torch.tanh(x @ teacher).to(DEV, dtype)))
    return out


def train(model: nn.Module, opt: Any, rank: int, steps: int, dtype: torch.dtype = torch.float32,
          after: Callable[[torch.Tensor], None] = lambda loss: None) -> list[float]:
    losses = []
    for x, y in batches(rank, steps, dtype):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        after(loss.detach())
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses).float().cpu()]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach().float() - q.detach().float()).abs().max()) for p, q in
               zip(a.parameters(), b.parameters()))


def spread(module: nn.Module) -> float:
    """Largest difference of any parameter between ranks (0: every rank holds the same)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).abs().max())


# --- DDP ------------------------------------------------------------------------------------------

def ddp_vs_torch(rank: int, world: int, dtype_name: str) -> dict[str, float]:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(rank)   # different init per rank: both wrappers broadcast rank 0's
    base = Net().to(DEV, dtype)
    ours = shoal.DistributedDataParallel(copy.deepcopy(base), device_ids=IDS, bucket_cap_mb=0.002)
    ref = TorchDDP(copy.deepcopy(base), device_ids=IDS, bucket_cap_mb=0.002)
    for m in (ours, ref):
        train(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), rank, 10, dtype)
    return {"diff": max_diff(ours.module, ref.module), "moved": max_diff(ours.module, base),
            "spread": spread(ours.module)}


CODECS: dict[str, Callable[[], Any]] = {
    "identity": codecs.Identity,
    "fp16": lambda: codecs.Cast(torch.float16),
    "bf16": lambda: codecs.Cast(torch.bfloat16),
    "int8": lambda: codecs.Int8Blockwise(64),
    "topk": lambda: codecs.TopK(0.25),
    "topk-ef": lambda: codecs.ErrorFeedback(codecs.TopK(0.25)),
    "sparseloco": lambda: codecs.SparseLoCo(0.25, 2, 64),   # Elias-Fano positions decoded on the GPU
    "powersgd": lambda: codecs.PowerSGD(rank=2, min_compression_rate=1.0),
    "adaptive": lambda: codecs.SizeAdaptive(codecs.Identity(), codecs.Cast(torch.bfloat16), threshold=256),
    "hierarchical": lambda: codecs.Hierarchical(),
}


def ddp_codec(rank: int, world: int, name: str) -> dict[str, float]:
    torch.manual_seed(0)
    base = Net().to(DEV)
    coded = shoal.DistributedDataParallel(copy.deepcopy(base), codec=CODECS[name](), bucket_cap_mb=0.002)
    exact = shoal.DistributedDataParallel(copy.deepcopy(base), hierarchical=False)
    out: dict[str, float] = {}
    for key, m in (("coded", coded), ("exact", exact)):
        losses = train(m, torch.optim.Adam(m.parameters(), lr=1e-2), rank, 40)
        out[key + "_first"], out[key + "_last"] = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    out["diff"] = max_diff(coded.module, exact.module)
    out["spread"] = spread(coded.module)
    return out


def torch_powersgd_hook(rank: int, world: int) -> float:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    torch.manual_seed(0)
    base = Net(64).to(DEV)
    mods = []
    for wrapper in (TorchDDP, shoal.DistributedDataParallel):
        m = wrapper(copy.deepcopy(base), device_ids=IDS)
        m.register_comm_hook(P.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                             min_compression_rate=2, random_seed=0), P.powerSGD_hook)
        train(m, torch.optim.SGD(m.parameters(), lr=0.05), rank, 20)
        mods.append(m.module)
    return max_diff(mods[0], mods[1])


# --- strategies through shoal.wrap -----------------------------------------------------------------

# name -> (strategy factory, steps, ranks equal after the last step). Averaging strategies average at
# step indices warmup + k * period (torch's averagers' rule): the step counts end on one.
STRATEGIES: dict[str, tuple[Callable[[], shoal.Strategy], int, bool]] = {
    "sync": (lambda: shoal.Sync(), 6, True),
    "sync-powersgd": (lambda: shoal.Sync(codec=codecs.PowerSGD(rank=2, min_compression_rate=1.0)), 6, True),
    "local": (lambda: shoal.LocalSGD(period=3, average_optimizer_state=True), 7, True),
    "postlocal": (lambda: shoal.PostLocalSGD(period=2, warmup_steps=2), 7, True),
    "hierarchical": (lambda: shoal.Hierarchical({2: 2}), 7, True),
    # 4 ranks on 2 hosts: every 2 steps inside a host, every 4 over all; index 8 averages over all.
    "hierarchical-4": (lambda: shoal.Hierarchical({2: 2, 4: 4}), 9, True),
    "diloco": (lambda: shoal.DiLoCo(inner_steps=3), 6, True),
    "diloco-int8": (lambda: shoal.DiLoCo(inner_steps=3, codec=codecs.Int8Blockwise(64)), 6, True),
    "diloco-sparse": (lambda: shoal.DiLoCo(inner_steps=3, codec=codecs.SparseLoCo(0.1, 2, 64)), 6, True),
    "streaming": (lambda: shoal.StreamingDiLoCo(inner_steps=3, fragments=2, overlap_steps=1), 6, False),
    # merge="carry", global copy in host memory (offload, the default on a GPU): the launch after step 6 merges
    # at close() with no progress since it, so the ranks end equal (the new global copy, to rounding)
    "streaming-carry": (lambda: shoal.StreamingDiLoCo(inner_steps=3, fragments=1, overlap_steps=1, merge="carry"),
                        6, True),
    "nonblocking": (lambda: shoal.NonBlocking(), 6, False),
    # 3 epochs of 2 steps, all warm-up or cool-down: a blocking global sync every step.
    "daso": (lambda: shoal.DASO(total_epochs=3, steps_per_epoch=2, warmup_epochs=2, cooldown_epochs=1), 6, True),
    # 6 epochs: the middle ones skip and delay (global_skips grows on a flat loss); the last is synchronous.
    "daso-skips": (lambda: shoal.DASO(total_epochs=6, steps_per_epoch=4, warmup_epochs=1, cooldown_epochs=1,
                                      stability_level=0.9), 24, True),
}


def wrapped(rank: int, world: int, name: str) -> dict[str, float]:
    make, steps, _ = STRATEGIES[name]
    torch.manual_seed(0)
    net = Net().to(DEV)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    strategy = make()
    model, opt = shoal.wrap(net, opt, strategy)
    report = getattr(strategy, "report_loss", None)
    losses = train(model, opt, rank, steps, after=report if report is not None else lambda loss: None)
    strategy.close()
    sync()
    return {"spread": spread(net), "first": losses[0], "last": losses[-1],
            "finite": float(all(torch.isfinite(p).all() for p in net.parameters()))}


# --- ZeRO ------------------------------------------------------------------------------------------

def zero_vs_torch_adam(rank: int, world: int, overlapped: bool) -> dict[str, float]:
    torch.manual_seed(0)
    base = Net(64).to(DEV)
    ref = TorchDDP(copy.deepcopy(base), device_ids=IDS)
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-3), rank, 10)
    net = copy.deepcopy(base)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
    # Several buckets, so that several owners step during backward; hierarchical=None: the
    # two-level reduction switches itself on when ranks share a host (per_host=2).
    model = shoal.DistributedDataParallel(net, optimizer=zero if overlapped else None, bucket_cap_mb=0.01)
    train(model, zero, rank, 10)
    zero.wait_for_params()
    sync()
    return {"diff": max_diff(net, ref.module), "moved": max_diff(net, base), "spread": spread(net),
            "hierarchical": float(model._two_level is not None)}


# --- CollaborativeOptimizer: two peers as threads of one process, on the GPU -------------------------

def _collaborative_peer(mode: str, k: int, run: PeerRun) -> dict[str, Any]:
    net = Net()
    gen = torch.Generator().manual_seed(0)   # threads share the global RNG: a private one
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    net = net.to(DEV)
    opt = shoal.CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=1e-2), net.named_parameters(),
                                       config=run.config(mode, target_batch_size=32, batch_size_per_step=16))
    data = iter(batches(k, 1000))

    def step() -> None:
        x, y = next(data)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    try:
        run.train(opt, step, epochs=3)
    finally:
        opt.shutdown()
    sync()
    return {"outcomes": [r.outcome for r in opt.rounds], "peers": [r.peers for r in opt.rounds],
            "epoch": opt.local_epoch, "params": [p.detach().cpu() for p in net.parameters()],
            "device": next(net.parameters()).device.type}


def collaborative_peers(mode: str) -> list[Any]:
    """Two peers (threads) train 3 epochs on cuda:0 around an in-process coordinator; their results."""
    return run_peers(functools.partial(_collaborative_peer, mode), 2, limit_s=90)


def collaborative_worker(rank: int, world: int, mode: str) -> list[Any]:
    """Run in a fresh process (no process group): CUDA is initialised there, not in pytest's."""
    os.environ.pop("SHOAL_COORDINATOR", None)
    return collaborative_peers(mode)


def fused_nonfinite_skip(rank: int, world: int) -> dict[str, Any]:
    """shoal DDP + fused AdamW on the device: rank 1 sends a NaN at step 3; every rank skips it on the
    device (found_inf, no host read between backward and the step's end), like torch DDP without the step."""
    import shoal.nonfinite
    import shoal.reducer

    reads = [0]
    for mod in (shoal.reducer, shoal.nonfinite):
        def counted(flag: torch.Tensor, read: Callable[[torch.Tensor], bool] = mod.read_flag) -> bool:
            reads[0] += 1
            return read(flag)
        mod.read_flag = counted   # type: ignore[attr-defined]
    torch.manual_seed(0)
    base = Net().to(DEV)
    ours, ref = shoal.DistributedDataParallel(copy.deepcopy(base), device_ids=IDS), TorchDDP(copy.deepcopy(base), device_ids=IDS)
    out: dict[str, Any] = {"reads_in_steps": 0}
    for key, model in (("ours", ours), ("ref", ref)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step, (x, y) in enumerate(batches(rank, 6)):
            if key == "ref" and step == 3:
                continue                               # the oracle: torch DDP without the bad step
            loss = F.mse_loss(model(x), y)
            hook = None
            if key == "ours" and step == 3 and rank == 1:
                hook = model.module.fc1.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device), float("nan")))
            seen = reads[0]
            loss.backward()
            opt.step()
            if key == "ours":
                out["reads_in_steps"] += reads[0] - seen
            opt.zero_grad()
            if hook is not None:
                hook.remove()
        sync()
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])   # noqa: E731
    a = flat(ours.module)
    out["finite"] = bool(torch.isfinite(a).all())
    out["diff"] = float((a - flat(ref.module)).abs().max())
    out["skips"] = ours.comm_stats().total.nonfinite_skips
    gathered = [torch.zeros_like(a) for _ in range(world)]
    dist.all_gather(gathered, a)
    out["spread"] = float(max((g - gathered[0]).abs().max() for g in gathered))
    return out
