"""A small trainer written the way common GPT trainers (nanoGPT and the torch DDP tutorials) are.

The training code below is the same for every backend: torch's DDP, shoal's
DDP, shoal's DDP with a codec, LocalSGD and DiLoCo through ``shoal.wrap``.
It uses what such scripts use: ``raw_model = model.module``, gradient
accumulation by setting ``model.require_backward_grad_sync``, fp16 autocast
with ``torch.amp.GradScaler`` (``unscale_`` then gradient clipping, as
nanoGPT does), bf16 autocast without a scaler, a checkpoint through
``model.module.state_dict()``, and ``Join`` over uneven shards.
``torch.compile`` stays off: compiling even this model takes longer on a
shared CPU than the whole suite allows.

Run under torchrun or ``shoal run`` with 2 workers; rank 0 writes the
results as JSON to ``argv[1]``.
"""

from __future__ import annotations

import io
import json
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join

import shoal

VOCAB, CONTEXT, BATCH, ACCUM, ITERS = 32, 8, 4, 2, 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(CONTEXT, d)
        self.h = nn.ModuleList([Block(d), Block(d)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def get_batch(rank: int, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * it + micro)
    data = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def wrap(backend: str, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
    """The one line that differs between backends."""
    if backend == "torch":
        return nn.parallel.DistributedDataParallel(model), opt
    if backend == "shoal":
        return shoal.DistributedDataParallel(model), opt
    if backend == "codec":
        return shoal.DistributedDataParallel(model, codec=shoal.codecs.Cast(torch.bfloat16)), opt
    if backend == "localsgd":
        return shoal.wrap(model, opt, shoal.LocalSGD(period=2))
    if backend == "diloco":
        return shoal.wrap(model, opt, shoal.DiLoCo(inner_steps=2))
    raise ValueError(backend)


def train(backend: str, rank: int, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(1337)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = wrap(backend, model, optimizer)
    raw_model = model.module
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for it in range(ITERS):
        for micro in range(ACCUM):
            model.require_backward_grad_sync = micro == ACCUM - 1
            x, y = get_batch(rank, it, micro)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x, y) / ACCUM
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * ACCUM)
    out: dict[str, Any] = {"losses": losses, "prefixed": all(k.startswith("module.") for k in model.state_dict())}
    out["checkpoint"] = checkpoint_roundtrip(raw_model, optimizer)
    if backend in ("torch", "shoal", "codec"):   # gradient-averaging wrappers are Joinable
        out["join"] = uneven(model, optimizer, rank)
    out["final"] = [p.detach().float().sum().item() for p in raw_model.parameters()]
    if hasattr(optimizer, "strategy"):
        optimizer.strategy.close()
    return out


def checkpoint_roundtrip(raw_model: nn.Module, optimizer: Any) -> bool:
    buf = io.BytesIO()
    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    fresh = GPT()
    fresh.load_state_dict(ckpt["model"])
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), raw_model.state_dict().values()))


def uneven(model: nn.Module, optimizer: Any, rank: int) -> list[float]:
    """Rank 0 has 3 more batches, rank 1 one: ``Join`` keeps the longer rank's all-reduces matched."""
    with Join([model]):
        for it in range(3 if rank == 0 else 1):
            x, y = get_batch(rank, 100 + it, 0)
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return [p.detach().float().sum().item() for p in model.module.parameters()]


def main() -> None:
    torch.set_num_threads(1)
    shoal.init()   # reads torchrun's (and shoal run's) environment; gloo on CPU
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for backend in ("torch", "shoal", "codec", "localsgd", "diloco"):
        results[f"{backend}/fp16"] = train(backend, rank, torch.float16)
    for backend in ("torch", "shoal"):
        results[f"{backend}/bf16"] = train(backend, rank, torch.bfloat16)
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()
    assert all(math.isfinite(v) for r in everyone for k in r for v in r[k]["losses"])


if __name__ == "__main__":
    main()
