"""Codecs over real gloo groups of 2 and 3 ranks: means, agreement, bytes, error feedback, NaN."""

from __future__ import annotations

import pytest
import torch

from shoal.codecs import Cast, ErrorFeedback, Identity, Int8Blockwise, PowerSGD, TopK
from shoal.comm import Group
from shoal.testing import run_workers

pytestmark = pytest.mark.timeout(120)

SHAPES = [(24, 10), (7,), (5, 3, 3), (333,)]
NAMES = ["l1.w", "l1.b", "conv.w", "v"]


def _data(rank: int, step: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(s, generator=g) * (rank + 1)).to(dtype) for s in SHAPES]


def _run(codec, rank: int, group: Group, tag: str, dtype=torch.float32, step: int = 0):
    ts = _data(rank, step, dtype)
    codec.mean(ts, NAMES, group, tag)
    return ts


def _means(rank: int, group: Group) -> dict:
    out = {}
    for key, codec, dtype in [
        ("identity", Identity(), torch.float32),
        ("fp16", Cast(torch.float16), torch.float32),
        ("bf16", Cast(torch.bfloat16), torch.float32),
        ("bf16_in", Identity(), torch.bfloat16),
        ("int8", Int8Blockwise(block_size=5), torch.float32),  # 5: rows not 4-aligned without padding
        ("topk", TopK(0.1), torch.float32),
        ("topk_half", TopK(0.07), torch.float16),
        ("psgd_full", PowerSGD(rank=24, min_compression_rate=0.01, error_feedback=False), torch.float32),
        ("psgd", PowerSGD(rank=2), torch.float32),
    ]:
        out[key] = _run(codec, rank, group, key, dtype)
    out["meter"] = {k: v.as_dict() for k, v in group.meter.by_tag().items()}
    return out


def _feedback(rank: int, group: Group) -> dict:
    out: dict = {}
    for key, codec in [("ef_topk", ErrorFeedback(TopK(0.05))), ("ef_int8", ErrorFeedback(Int8Blockwise(16))),
                       ("ef_psgd", PowerSGD(rank=1))]:
        decoded = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        for step in range(12):
            ts = _data(rank, step)
            codec.mean(ts, NAMES, group, key)
            for a, t in zip(decoded, ts):
                a += t.double()
        res = codec.residuals if isinstance(codec, ErrorFeedback) else codec.errors
        out[key] = (decoded, {n: r.double() for n, r in res.items()})
    return out


def _nan(rank: int, group: Group) -> dict:
    out = {}
    for key, codec in [("nan_topk", ErrorFeedback(TopK(0.2))), ("nan_psgd", PowerSGD(rank=2))]:
        for step in range(2):
            _run(codec, rank, group, key, step=step)
        sd = codec.state_dict()
        before = {k: v.clone() for k, v in sd.get("residuals", sd.get("errors")).items()}
        ts = _data(rank, 2)
        if rank == 1:
            ts[0][0, 0] = float("nan")  # only one rank goes bad
        codec.mean(ts, NAMES, group, key)
        sd = codec.state_dict()
        after = sd.get("residuals", sd.get("errors"))
        later = _run(codec, rank, group, key, step=3)
        out[key] = {
            "out_finite": bool(torch.isfinite(ts[0]).all()),
            "state_kept": torch.equal(before["l1.w"], after["l1.w"]),
            "later_finite": all(bool(torch.isfinite(t).all()) for t in later),
        }
    return out


def _worker(rank: int, world: int) -> dict:
    group = Group()
    return {"means": _means(rank, group), "feedback": _feedback(rank, group), "nan": _nan(rank, group)}


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def _check_means(res: list[dict], world: int) -> None:
    xs = [_flat(_data(r)) for r in range(world)]
    true = sum(xs) / world
    for key in ["identity", "fp16", "bf16", "int8", "topk", "topk_half", "psgd_full", "psgd", "bf16_in"]:
        outs = [_flat(r["means"][key]) for r in res]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), f"{key}: ranks disagree"
    m = {k: _flat(res[0]["means"][k]) for k in res[0]["means"] if k != "meter"}
    torch.testing.assert_close(m["identity"], true, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m["psgd_full"], true, rtol=1e-4, atol=1e-4)
    for key, dt in [("fp16", torch.float16), ("bf16", torch.bfloat16)]:
        # each rank's x/N rounded once, then the sum rounded in the wire dtype once per hop
        bound = (world + 1) * torch.finfo(dt).eps * sum(x.abs() for x in xs) / world
        assert torch.all((m[key] - true).abs() <= bound + 1e-12), key
    n = true.numel()
    pad = -(-n // 5) * 5 - n
    blocks = [torch.cat([x, torch.zeros(pad, dtype=x.dtype)]).view(-1, 5) for x in xs]
    scale = sum(b.abs().amax(1) for b in blocks) / world / 127
    err = torch.cat([(m["int8"] - true).abs(), torch.zeros(pad, dtype=true.dtype)]).view(-1, 5)
    assert torch.all(err <= scale.unsqueeze(1) / 2 * (1 + 1e-5) + 1e-7)
    k = TopK(0.1).k_for(n)
    sparse = torch.zeros_like(true)
    for x in xs:
        idx = x.abs().topk(k).indices
        sparse[idx] += x[idx].float().double()
    torch.testing.assert_close(m["topk"], sparse / world, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(m["psgd"], true, atol=1e-2)  # rank 2 is really lossy here


def _check_bytes(res: list[dict], world: int) -> None:
    meter = res[0]["means"]["meter"]
    n = sum(torch.Size(s).numel() for s in SHAPES)
    expect = {
        "identity/identity": 4 * n,
        "fp16/fp16": 2 * n,
        "int8/int8": Int8Blockwise(5).wire_bytes(n),
        "topk/topk": 8 * TopK(0.1).k_for(n),
        # the 5x9 conv: 45 <= 2 * 2 * (5 + 9), would not shrink 2x, so uncompressed
        "psgd/powersgd/uncompressed": 4 * (7 + 333 + 45),
        "psgd/powersgd/p": 4 * 24 * 2,
        "psgd/powersgd/q": 4 * 10 * 2,
    }
    for tag, payload in expect.items():
        assert meter[tag]["payload_bytes"] == payload, tag
    assert meter["int8/int8"]["bytes_sent"] == (world - 1) * Int8Blockwise(5).wire_bytes(n)
    assert meter["identity/identity"]["bytes_sent"] == 2 * (world - 1) * 4 * n // world


def _check_feedback(res: list[dict], world: int) -> None:
    for key in ["ef_topk", "ef_int8", "ef_psgd"]:
        decoded = res[0]["feedback"][key][0]
        for i, name in enumerate(NAMES):
            inputs = sum(_data(r, s)[i].double() for r in range(world) for s in range(12)) / world
            # PowerSGD keeps its residual as the n x m matrix it compresses
            mean_res = sum(r["feedback"][key][1].get(name, torch.zeros(1)).reshape(-1) for r in res) / world
            if mean_res.numel() > 1:
                mean_res = mean_res.view(decoded[i].shape)
            torch.testing.assert_close(decoded[i] + mean_res, inputs, rtol=0, atol=2e-4, msg=f"{key} {name}")


@pytest.mark.parametrize("world", [2, 3])
def test_codecs_over_real_groups(world):
    res = run_workers(_worker, world, timeout=100)
    _check_means(res, world)
    _check_bytes(res, world)
    _check_feedback(res, world)
    for r in res:
        for key, v in r["nan"].items():
            assert v == {"out_finite": False, "state_kept": True, "later_finite": True}, (key, v)
