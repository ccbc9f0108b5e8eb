"""Codecs over real gloo groups of 2, 3 and 4 ranks: means, agreement, bytes, error feedback, NaN."""

from __future__ import annotations

import math

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
        requant = torch.zeros(sum(torch.Size(s).numel() for s in SHAPES), dtype=torch.float64)
        for step in range(12):
            ts = _data(rank, step)
            codec.mean(ts, NAMES, group, key)
            for a, t in zip(decoded, ts):
                a += t.double()
            requant += _requant_bound(_flat(ts), 16)
        res = codec.residuals if isinstance(codec, ErrorFeedback) else codec.errors
        out[key] = (decoded, {n: r.double() for n, r in res.items()}, requant)
    return out


def _nan(rank: int, group: Group) -> dict:
    out = {}
    for key, codec in [("nan_topk", ErrorFeedback(TopK(0.2))), ("nan_psgd", PowerSGD(rank=2)),
                       ("nan_int8", ErrorFeedback(Int8Blockwise(16)))]:
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
    out = {"means": _means(rank, group), "feedback": _feedback(rank, group), "nan": _nan(rank, group)}
    if world >= 3:  # Int8's reduce-scatter method (at 4 ranks: test_int8_reduce_scatter_at_4_ranks)
        out["int8"] = _int8(rank, group)
    return out


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    """``x`` zero-padded to whole blocks of ``b``, one block per row."""
    return torch.cat([x, torch.zeros(-(-x.numel() // b) * b - x.numel(), dtype=x.dtype)]).view(-1, b)


def _requant_bound(out: torch.Tensor, b: int) -> torch.Tensor:
    """Per element, the most the requantization of a decoded mean ``out`` can have moved it.

    The requantized block's scale is ``absmax / 127`` of the block's decoded
    values (its largest element decodes to exactly 127 * scale); rounding moves
    each element by at most half a scale.
    """
    return (_blocks(out, b).abs().amax(1, keepdim=True) / 254).expand(-1, b).reshape(-1)[: out.numel()]


def _int8_bound(xs: list[torch.Tensor], out: torch.Tensor, b: int, method: str) -> torch.Tensor:
    """The documented per-element error bound of Int8Blockwise's mean ``out`` of ``xs``.

    One quantization per contribution: ``mean_r(scale_r) / 2``; the
    reduce-scatter method adds the requantization, ``scale_m / 2``.
    """
    scale = sum(_blocks(x, b).abs().amax(1, keepdim=True) for x in xs) / len(xs) / 127
    bound = (scale / 2).expand(-1, b).reshape(-1)[: out.numel()]
    if method == "reduce_scatter":
        bound = bound + _requant_bound(out, b)
    return bound * (1 + 1e-5) + 1e-7


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
    assert torch.all((m["int8"] - true).abs() <= _int8_bound(xs, m["int8"], 5, Int8Blockwise(5).method_for(n, world)))
    k = TopK(0.1).k_for(n)
    sparse = torch.zeros_like(true)
    for x in xs:
        idx = x.abs().topk(k).indices
        sparse[idx] += x[idx].float().double()
    torch.testing.assert_close(m["topk"], sparse / world, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(m["psgd"], true, atol=1e-2)  # rank 2 is really lossy here


def _topk_bytes(n: int, k: int) -> int:
    """k fp32 values and k Elias-Fano positions (floor(log2(n / k)) low bits each, a unary high part), to 4."""
    low = math.floor(math.log2(n / k))
    return -(-(4 * k + math.ceil((k * low + k + ((n - 1) >> low) + 1) / 8)) // 4) * 4


def _check_bytes(res: list[dict], world: int) -> None:
    meter = res[0]["means"]["meter"]
    n = sum(torch.Size(s).numel() for s in SHAPES)
    expect = {
        "identity/identity": 4 * n,
        "fp16/fp16": 2 * n,
        "topk/topk": _topk_bytes(n, TopK(0.1).k_for(n)),
        # the 5x9 conv: 45 <= 2 * 2 * (5 + 9), would not shrink 2x, so uncompressed
        "psgd/powersgd/uncompressed": 4 * (7 + 333 + 45),
        "psgd/powersgd/p": 4 * 24 * 2,
        "psgd/powersgd/q": 4 * 10 * 2,
    }
    for tag, payload in expect.items():
        assert meter[tag]["payload_bytes"] == payload, tag
    int8 = Int8Blockwise(5)
    if world == 2:
        assert meter["int8/int8"]["payload_bytes"] == int8.wire_bytes(n)
        assert meter["int8/int8"]["bytes_sent"] == (world - 1) * int8.wire_bytes(n)
    else:
        assert "int8/int8" not in meter
        c = int8.chunk_bytes(n, world)
        assert meter["int8/int8/scatter"]["payload_bytes"] == world * c
        assert meter["int8/int8/gather"]["payload_bytes"] == c
        sent = meter["int8/int8/scatter"]["bytes_sent"] + meter["int8/int8/gather"]["bytes_sent"]
        assert sent == int8.sent_bytes(n, world) == 2 * (world - 1) * c < (world - 1) * int8.wire_bytes(n)
    assert meter["identity/identity"]["bytes_sent"] == 2 * (world - 1) * 4 * n // world


def _check_feedback(res: list[dict], world: int) -> None:
    for key in ["ef_topk", "ef_psgd"]:
        decoded = res[0]["feedback"][key][0]
        for i, name in enumerate(NAMES):
            inputs = sum(_data(r, s)[i].double() for r in range(world) for s in range(12)) / world
            # PowerSGD keeps its residual as the n x m matrix it compresses
            mean_res = sum(r["feedback"][key][1].get(name, torch.zeros(1)).reshape(-1) for r in res) / world
            if mean_res.numel() > 1:
                mean_res = mean_res.view(decoded[i].shape)
            torch.testing.assert_close(decoded[i] + mean_res, inputs, rtol=0, atol=2e-4, msg=f"{key} {name}")


def _check_int8_feedback(res: list[dict], world: int) -> None:
    """Int8's residual is each rank's own loss; a requantization error (3+ ranks) is not fed back.

    Exact conservation at 2 ranks (one quantization); at 3+, off by at most
    the sum over steps of each step's requantization bound, and really off.
    """
    decoded, _, requant = res[0]["feedback"]["ef_int8"]
    inputs = torch.cat([sum(_data(r, s)[i].double() for r in range(world) for s in range(12)).reshape(-1) / world
                        for i in range(len(SHAPES))])
    mean_res = torch.cat([sum(r["feedback"]["ef_int8"][1][name] for r in res).reshape(-1) / world for name in NAMES])
    gap = (_flat(decoded) + mean_res - inputs).abs()
    if world == 2:
        assert gap.max() < 2e-4
    else:
        assert torch.all(gap <= requant * (1 + 1e-5) + 2e-4)
        assert gap.max() > 2e-4  # the requantization error really is not fed back


@pytest.mark.parametrize("world", [2, 3])
def test_codecs_over_real_groups(world):
    res = run_workers(_worker, world, timeout=100)
    _check_means(res, world)
    _check_bytes(res, world)
    _check_feedback(res, world)
    _check_int8_feedback(res, world)
    if world >= 3:
        _check_int8([r["int8"] for r in res], world)
    for r in res:
        for key, v in r["nan"].items():
            assert v == {"out_finite": False, "state_kept": True, "later_finite": True}, (key, v)


BIG = 2**17 + 3  # not a whole number of blocks or of chunks; large enough for 3.9x at 3 and 4 ranks


def _int8(rank: int, group: Group) -> dict:
    """The all-to-all primitive, then Int8Blockwise's reduce-scatter method in several shapes."""
    world = group.size
    x = torch.arange(2 * world, dtype=torch.int32) + 100 * rank
    got = torch.empty_like(x)
    group.all_to_all(got, x, tag="a2a").wait()
    out: dict = {"a2a": got}
    for key, codec, dtype in [("i8_auto", Int8Blockwise(5), torch.float32),
                              ("i8_ag", Int8Blockwise(5, method="all_gather"), torch.float32),
                              ("i8_bf16", Int8Blockwise(5), torch.bfloat16)]:
        out[key] = _run(codec, rank, group, key, dtype)
    tiny = [torch.randn(3, generator=torch.Generator().manual_seed(rank))]  # 1 block, N - 1 chunks all padding
    Int8Blockwise(5, method="reduce_scatter").mean(tiny, ["t"], group, "i8_tiny")
    out["i8_tiny"] = tiny
    big = [torch.randn(BIG, generator=torch.Generator().manual_seed(50 + rank))]
    Identity().mean([big[0].clone()], ["x"], group, "i8_fp32")
    Int8Blockwise().mean(big, ["x"], group, "i8_big")
    out["i8_big"] = big
    out["meter"] = {k: v.as_dict() for k, v in group.meter.by_tag().items()}
    return out


def _int8_worker(rank: int, world: int) -> dict:
    return _int8(rank, Group())


def _check_int8(res: list[dict], world: int) -> None:
    """Ranks agree bit for bit, errors within the two-quantization bound, exact bytes."""
    for r, out in enumerate(res):  # chunk r of every rank's input lands on rank r, in rank order
        assert out["a2a"].tolist() == [100 * s + 2 * r + i for s in range(world) for i in range(2)]
    for key in ["i8_auto", "i8_ag", "i8_bf16", "i8_tiny", "i8_big"]:
        for out in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(out[key], res[0][key])), f"{key}: ranks disagree"
    xs = [_flat(_data(r)) for r in range(world)]
    true = sum(xs) / world
    n = true.numel()
    assert Int8Blockwise(5).method_for(n, world) == "reduce_scatter"
    for key, method in [("i8_auto", "reduce_scatter"), ("i8_ag", "all_gather")]:
        got = _flat(res[0][key])
        assert torch.all((got - true).abs() <= _int8_bound(xs, got, 5, method)), key
    torch.testing.assert_close(_flat(res[0]["i8_bf16"]), true, rtol=0.02, atol=0.05)
    tiny = [torch.randn(3, generator=torch.Generator().manual_seed(r)).double() for r in range(world)]
    got = _flat(res[0]["i8_tiny"])
    assert torch.all((got - sum(tiny) / world).abs() <= _int8_bound(tiny, got, 5, "reduce_scatter"))
    big = [torch.randn(BIG, generator=torch.Generator().manual_seed(50 + r)).double() for r in range(world)]
    got = _flat(res[0]["i8_big"])
    assert torch.all((got - sum(big) / world).abs() <= _int8_bound(big, got, 256, "reduce_scatter"))
    _check_int8_bytes(res[0]["meter"], n, world)


def test_int8_reduce_scatter_at_4_ranks():
    _check_int8(run_workers(_int8_worker, 4, timeout=100), 4)


def _check_int8_bytes(meter: dict, n: int, world: int) -> None:
    """Exact payload and wire bytes per tag, and >= 3.9x fewer bytes than fp32 for a large tensor."""
    assert meter["a2a"] == {**meter["a2a"], "payload_bytes": 4 * 2 * world, "bytes_sent": 4 * 2 * (world - 1),
                            "bytes_received": 4 * 2 * (world - 1)}
    c = Int8Blockwise(5).chunk_bytes(n, world)
    for prefix in ["i8_auto", "i8_bf16"]:
        scatter, gather = meter[f"{prefix}/int8/scatter"], meter[f"{prefix}/int8/gather"]
        assert (scatter["payload_bytes"], scatter["bytes_sent"], scatter["bytes_received"]) == (
            world * c, (world - 1) * c, (world - 1) * c)
        assert (gather["payload_bytes"], gather["bytes_sent"], gather["bytes_received"]) == (
            c, (world - 1) * c, (world - 1) * c)
    p = Int8Blockwise(5).wire_bytes(n)
    assert (meter["i8_ag/int8"]["payload_bytes"], meter["i8_ag/int8"]["bytes_sent"]) == (p, (world - 1) * p)
    big = meter["i8_big/int8/scatter"]["bytes_sent"] + meter["i8_big/int8/gather"]["bytes_sent"]
    assert big == Int8Blockwise().sent_bytes(BIG, world) == 2 * (world - 1) * Int8Blockwise().chunk_bytes(BIG, world)
    fp32 = meter["i8_fp32/identity"]["bytes_sent"]
    assert fp32 == 2 * (world - 1) * 4 * BIG // world
    assert fp32 / big >= 3.9
