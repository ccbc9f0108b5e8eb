"""SparseLoCo / QuantizedTopK against a plain reference of the same maths.

The reference below is written element by element in numpy float32 (the
codec's arithmetic, in the same order): chunk, keep each chunk's k largest
magnitudes, quantise sign + magnitude on a uniform grid from the smallest to
the largest kept magnitude, decode, add the ranks in rank order, divide; error
feedback keeps ``x + e - decoded``. Several ranks are simulated in one process
(threads behind a fake group whose all-gather is a barrier) and run for real
over a 2-rank gloo group.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest
import torch

from shoal.codecs import QuantizedTopK, SparseLoCo
from shoal.comm import Group
from shoal.errors import ConfigError
from shoal.testing import run_workers

pytestmark = pytest.mark.timeout(120)

SHAPES = [(12, 20), (7,), (3, 5, 9), (333,)]   # 715 elements: 6 chunks of 128, the last padded
NAMES = ["l.w", "l.b", "conv.w", "v"]


def _inputs(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


# --- the reference ------------------------------------------------------------------
def ref_encode(x: np.ndarray, ratio: float, bits: int, chunk: int) -> list[tuple[np.float32, np.float32, list]]:
    """Per chunk: (lo, hi, [(position, negative, level)]) of the kept elements."""
    c = min(chunk, len(x))
    n = math.ceil(len(x) / c)
    padded = np.zeros(n * c, dtype=np.float32)
    padded[: len(x)] = x
    k = min(c, max(1, math.ceil(ratio * c)))
    levels = 2 ** (bits - 1)
    out = []
    for j in range(n):
        part = padded[j * c:(j + 1) * c]
        keep = sorted(range(c), key=lambda i: -abs(float(part[i])))[:k]
        mags = [np.float32(abs(part[i])) for i in keep]
        if levels == 1:
            lo = hi = np.float32(np.mean(np.array(mags, dtype=np.float32), dtype=np.float32))
            out.append((lo, hi, [(i, bool(part[i] < 0), 0) for i in keep]))
            continue
        lo, hi = min(mags), max(mags)
        span = hi - lo if hi > lo else np.float32(1)
        entries = []
        for i, m in zip(keep, mags):
            level = int(np.clip(np.round((m - lo) / span * np.float32(levels - 1)), 0, levels - 1))
            entries.append((i, bool(part[i] < 0), level))
        out.append((lo, hi, entries))
    return out


def ref_decode(enc: list, numel: int, bits: int, chunk: int) -> np.ndarray:
    c = min(chunk, numel)
    out = np.zeros(len(enc) * c, dtype=np.float32)
    levels = 2 ** (bits - 1)
    for j, (lo, hi, entries) in enumerate(enc):
        for i, neg, level in entries:
            mag = lo + (hi - lo) * np.float32(level / max(levels - 1, 1))
            out[j * c + i] += -mag if neg else mag
    return out[:numel]


def ref_run(inputs: list[list[np.ndarray]], ratio: float, bits: int, chunk: int, decay: float = 1.0
            ) -> tuple[list[np.ndarray], list[np.ndarray], list[list[np.ndarray]]]:
    """inputs[step][rank] (flat) -> (mean per step, residual per rank, decoded own contribution per step/rank)."""
    world, numel = len(inputs[0]), len(inputs[0][0])
    res = [np.zeros(numel, dtype=np.float32) for _ in range(world)]
    means, owns = [], []
    for xs in inputs:
        sends = [x + np.float32(decay) * e for x, e in zip(xs, res)]
        decoded = [ref_decode(ref_encode(s, ratio, bits, chunk), numel, bits, chunk) for s in sends]
        total = np.zeros(numel, dtype=np.float32)
        for d in decoded:                # rank order
            total += d
        means.append(total / np.float32(world))
        res = [s - d for s, d in zip(sends, decoded)]
        owns.append(decoded)
    return means, res, owns


def _flat(ts: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1) for t in ts]).numpy().astype(np.float32)


# --- several ranks in one process ------------------------------------------------------
class _Done:
    def wait(self) -> None:
        pass


class SimGroup:
    """One simulated rank of ``size``: its all-gather meets the other threads at a barrier."""

    def __init__(self, rank: int, size: int, board: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.size, self.board, self.barrier = rank, size, board, barrier
        self.sent: list[int] = []

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "") -> _Done:
        self.sent.append(inp.numel())
        self.board[self.rank] = inp.clone()
        self.barrier.wait()
        torch.cat(self.board, out=out)
        self.barrier.wait()
        return _Done()


def _simulate(world: int, steps: int, make: Any) -> tuple[list[list[list[torch.Tensor]]], list[Any], list[SimGroup]]:
    board: list[Any] = [None] * world
    barrier = threading.Barrier(world)
    codecs = [make() for _ in range(world)]
    groups = [SimGroup(r, world, board, barrier) for r in range(world)]
    outs: list[list[list[torch.Tensor]]] = [[] for _ in range(world)]

    def rank_main(r: int) -> None:
        for s in range(steps):
            ts = _inputs(r, s)
            codecs[r].mean(ts, NAMES, groups[r], "t")
            outs[r].append(ts)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs, codecs, groups


@pytest.mark.parametrize("bits, ratio, chunk, decay", [(2, 0.05, 128, 1.0), (1, 0.02, 100, 1.0),
                                                       (4, 0.1, 4096, 1.0), (2, 0.03, 128, 0.9)])
def test_matches_the_reference_over_simulated_ranks(bits, ratio, chunk, decay):
    world, steps = 3, 4
    outs, codecs, _ = _simulate(world, steps, lambda: SparseLoCo(ratio, bits, chunk, decay))
    inputs = [[_flat(_inputs(r, s)) for r in range(world)] for s in range(steps)]
    means, res, _ = ref_run(inputs, ratio, bits, chunk, decay)
    for s in range(steps):
        for r in range(world):   # every rank holds the reference mean
            np.testing.assert_allclose(_flat(outs[r][s]), means[s], rtol=1e-5, atol=1e-6)
        assert all(torch.equal(torch.cat([t.reshape(-1) for t in outs[r][s]]),
                               torch.cat([t.reshape(-1) for t in outs[0][s]])) for r in range(world))
    for r in range(world):
        np.testing.assert_allclose(_flat([codecs[r].residuals[n] for n in NAMES]), res[r], rtol=1e-5, atol=1e-5)


def test_error_feedback_conserves_what_was_not_sent():
    """Over steps: mean of what was decoded + mean of the residuals == mean of the inputs (decay 1)."""
    world, steps = 3, 6
    outs, codecs, _ = _simulate(world, steps, lambda: SparseLoCo(0.02, 2, 128))
    sent = sum(_flat(outs[0][s]).astype(np.float64) for s in range(steps))
    residual = sum(_flat([codecs[r].residuals[n] for n in NAMES]).astype(np.float64) for r in range(world)) / world
    given = sum(_flat(_inputs(r, s)).astype(np.float64) for r in range(world) for s in range(steps)) / world
    np.testing.assert_allclose(sent + residual, given, rtol=0, atol=1e-4)
    assert np.abs(residual).max() > 0.1   # it really held back most of the input


def test_bytes_handed_to_the_all_gather_are_exact():
    world, steps = 2, 3
    _, codecs, groups = _simulate(world, steps, lambda: SparseLoCo(0.05, 2, 128))
    numel = sum(math.prod(s) for s in SHAPES)
    n, k = math.ceil(numel / 128), math.ceil(0.05 * 128)            # 6 chunks, 7 kept each
    # Elias-Fano positions: 4 low bits each (floor(log2(128 / 7))) + a unary high part of 7 + 128 / 16 bits.
    pos_bytes = math.ceil((k * 4 + k + 128 // 16) / 8)                  # 43 bits: 6 bytes (14 as int16)
    per_rank = n * (2 * 4 + pos_bytes + math.ceil(k * 2 / 8))           # scales, positions, 2-bit codes
    per_rank = -(-per_rank // 4) * 4
    assert groups[0].sent == [per_rank] * steps
    assert codecs[0].stats()["payload_bytes"] == per_rank * steps
    assert QuantizedTopK(0.05, 2, 128).wire_bytes(numel) == per_rank
    # 2 % in 2 bits on 4096-element chunks: 82 x (5 + 1) + 128 bits of positions (78 bytes), 21 bytes of
    # codes, 8 of scales: 107 bytes per 16384 (153x; 152.6x over 245 chunks, the last one padded).
    assert 4 * 10**6 / QuantizedTopK(0.02, 2, 4096).wire_bytes(10**6) == pytest.approx(152.6, abs=0.1)   # 84.6x with int16 positions


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_element_is_sent_and_the_residual_is_kept(bad):
    world = 2
    board: list[Any] = [None] * world
    barrier = threading.Barrier(world)
    codecs = [SparseLoCo(0.02, 2, 128) for _ in range(world)]
    groups = [SimGroup(r, world, board, barrier) for r in range(world)]
    outs: list[Any] = [None] * world

    def rank_main(r: int) -> None:
        codecs[r].mean(_inputs(r, 0), NAMES, groups[r], "t")
        before = {n: v.clone() for n, v in codecs[r].residuals.items()}
        ts = _inputs(r, 1)
        if r == 1:
            ts[3][200] = bad
        codecs[r].mean(ts, NAMES, groups[r], "t")
        outs[r] = (ts, before)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(world):
        ts, before = outs[r]
        assert not torch.isfinite(ts[3]).all()                       # the bad value travelled: every rank sees it
        assert torch.equal(codecs[r].residuals["v"], before["v"])    # that tensor's residual is kept as it was
        assert torch.isfinite(ts[0]).all()                            # the other tensors are averaged as usual
        assert codecs[r].stats()["nonfinite_steps"] == 1


@pytest.mark.parametrize("kwargs, match", [({"ratio": 0}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"bits": 3}, "bits"),
                                           ({"chunk": 2**16 + 1}, "chunk"), ({"decay": 0}, "decay"),
                                           ({"decay": 1.1}, "decay")])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SparseLoCo(**kwargs)


# --- a real 2-rank gloo group ---------------------------------------------------------
def _gloo_worker(rank: int, world: int) -> dict[str, Any]:
    group = Group()
    codec = SparseLoCo(0.05, 2, 128)
    outs = []
    for s in range(3):
        ts = _inputs(rank, s)
        codec.mean(ts, NAMES, group, "sl")
        outs.append(_flat(ts))
    c = group.meter.counters("sl/sparse")
    return {"outs": outs, "res": _flat([codec.residuals[n] for n in NAMES]), "sent": c.bytes_sent,
            "payload": codec.stats()["payload_bytes"]}


def test_two_gloo_ranks_match_the_reference():
    res = run_workers(_gloo_worker, 2, timeout=100)
    inputs = [[_flat(_inputs(r, s)) for r in range(2)] for s in range(3)]
    means, resid, _ = ref_run(inputs, 0.05, 2, 128)
    for r in range(2):
        for s in range(3):
            np.testing.assert_allclose(res[r]["outs"][s], means[s], rtol=1e-5, atol=1e-6)
            assert np.array_equal(res[r]["outs"][s], res[0]["outs"][s])
        np.testing.assert_allclose(res[r]["res"], resid[r], rtol=1e-5, atol=1e-5)
        # all-gather at 2 ranks: each rank sends its payload once per call
        assert res[r]["sent"] == res[r]["payload"] == 3 * QuantizedTopK(0.05, 2, 128).wire_bytes(715)


@pytest.mark.parametrize("numel", [1000, 1001, 1003])
def test_topk_fp64_rows_stay_aligned_across_ranks(numel):
    """TopK sends values first: every rank's row must start at a multiple of 8 for fp64 (TopK shares the
    Elias-Fano positions of this codec). Each rank keeps its own top k; the mean is their sum / world."""
    from shoal.codecs import TopK

    world = 3
    board: list[Any] = [None] * world
    barrier = threading.Barrier(world)
    groups = [SimGroup(r, world, board, barrier) for r in range(world)]
    xs = [torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    outs: list[Any] = [None] * world

    def rank_main(r: int) -> None:
        t = xs[r].clone()
        TopK(0.1).mean([t], ["w"], groups[r], "t")
        outs[r] = t

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    k = TopK(0.1).k_for(numel)
    want = torch.zeros(numel, dtype=torch.float64)
    for x in xs:
        idx = x.abs().topk(k).indices
        want[idx] += x[idx].float().double()     # the codec works in fp32 and sends the values as fp64
    assert groups[0].sent[0] % 8 == 0
    for r in range(world):
        assert outs[r] is not None, f"rank {r} raised"
        torch.testing.assert_close(outs[r], want / world, rtol=1e-6, atol=1e-7)
