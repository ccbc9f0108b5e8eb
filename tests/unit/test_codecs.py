"""Codecs on one process (world size 1): accuracy bounds, validation, state, NaN policy."""

from __future__ import annotations

import datetime
import io
import math

import pytest
import torch
import torch.distributed as dist

from shoal.codecs import Cast, ErrorFeedback, Identity, Int8Blockwise, PowerSGD, SizeAdaptive, SparseLoCo, TopK
from shoal.codecs.int8 import dequantize_blocks, quantize_blocks
from shoal.codecs.powersgd import orthonormalize_
from shoal.comm import Group, wire_bytes
from shoal.errors import ConfigError
from shoal.testing import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def group():
    torch.set_num_threads(1)
    created = False
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )
        created = True
    yield Group()
    if created:
        dist.destroy_process_group()


def _tensors(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[str]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (16, 3, 3, 3), (1000,)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes], ["a.w", "a.b", "conv.w", "v"]


def test_identity_exact(group):
    ts, names = _tensors()
    ref = [t.clone() for t in ts]
    Identity().mean(ts, names, group, "t")
    for a, b in zip(ts, ref):
        assert torch.equal(a, b)
    assert group.meter.counters("t/identity").payload_bytes == 4 * sum(t.numel() for t in ts)


def test_identity_non_contiguous_views_of_a_bucket(group):
    bucket = torch.randn(200)
    ref = bucket.clone()
    views = [bucket[:100].view(10, 10).t(), bucket[100:].view(4, 25)]
    Identity().mean(views, ["x", "y"], group, "t")
    assert torch.equal(bucket, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_within_dtype_rounding(group, dtype):
    ts, names = _tensors()
    ref = [t.clone() for t in ts]
    Cast(dtype).mean(ts, names, group, "t")
    eps = torch.finfo(dtype).eps
    for a, b in zip(ts, ref):
        # one rounding to the wire dtype: relative error at most eps / 2
        assert torch.all((a - b).abs() <= b.abs() * eps / 2 + 1e-30)
        assert not torch.equal(a, b) or b.numel() < 10  # it really went through the cast
    assert group.meter.counters(f"t/{'fp16' if dtype == torch.float16 else 'bf16'}").payload_bytes == 2 * sum(
        t.numel() for t in ts
    )


def test_int8_within_scale_over_127_per_block(group):
    ts, names = _tensors()
    ref = torch.cat([t.reshape(-1) for t in ts])
    codec = Int8Blockwise(block_size=64)
    codec.mean(ts, names, group, "t")
    out = torch.cat([t.reshape(-1) for t in ts])
    n = ref.numel()
    pad = torch.zeros(-(-n // 64) * 64 - n)
    scale = torch.cat([ref, pad]).view(-1, 64).abs().amax(1) / 127
    err = torch.cat([(out - ref).abs(), pad]).view(-1, 64)
    assert torch.all(err <= scale.unsqueeze(1) / 2 * (1 + 1e-6))
    assert err.max() > 0
    assert codec.stats()["payload_bytes"] == codec.wire_bytes(n) == -(-n // 64) * 68


def test_int8_default_block_is_3_9x_smaller_than_fp32():
    codec = Int8Blockwise()
    n = 10**6
    assert 4 * n / codec.wire_bytes(n) >= 3.9


@pytest.mark.parametrize("block", [5, 16, 256])
def test_int8_auto_sends_the_fewest_bytes(block):
    auto = Int8Blockwise(block)
    ag, rs = Int8Blockwise(block, method="all_gather"), Int8Blockwise(block, method="reduce_scatter")
    for world in range(1, 9):
        for numel in [1, 3, block, 2 * block + 1, 7 * block, 1000, 12345, 10**6]:
            sent = {m.method: m.sent_bytes(numel, world) for m in (ag, rs)}
            method = auto.method_for(numel, world)
            assert auto.sent_bytes(numel, world) == min(sent.values())
            if world <= 2 or sent["reduce_scatter"] == sent["all_gather"]:
                assert method == "all_gather", (world, numel)  # ties: one quantization, one round
    for world in (3, 4, 8):  # large tensors: N/2 fewer bytes than all-gather, >= 3.9x fewer than fp32's ring
        n = 10**6
        assert wire_bytes("all_reduce", 4 * n, world)[0] / Int8Blockwise().sent_bytes(n, world) >= 3.9
        assert Int8Blockwise().sent_bytes(n, world) <= 2 / world * Int8Blockwise(method="all_gather").sent_bytes(n, world) * 1.01


def test_int8_forced_reduce_scatter_one_rank(group):
    ts, names = _tensors(4)
    ref = torch.cat([t.reshape(-1) for t in ts])
    codec = Int8Blockwise(block_size=64, method="reduce_scatter")
    res = [torch.empty(t.shape) for t in ts]
    codec.mean_with_residual(ts, names, group, "rs1", res)
    out = torch.cat([t.reshape(-1) for t in ts])
    n = ref.numel()
    pad = torch.zeros(-(-n // 64) * 64 - n)
    scale = torch.cat([ref, pad]).view(-1, 64).abs().amax(1, keepdim=True) / 127
    out_scale = torch.cat([out, pad]).view(-1, 64).abs().amax(1, keepdim=True) / 127
    err = torch.cat([(out - ref).abs(), pad]).view(-1, 64)
    assert torch.all(err <= (scale + out_scale) / 2 * (1 + 1e-6)) and err.max() > 0  # two quantizations
    # the residual is this rank's own (first) quantization error
    torch.testing.assert_close(torch.cat([r.reshape(-1) for r in res]), ref - out, rtol=0, atol=1e-6)
    by = group.meter.by_tag()
    c = codec.chunk_bytes(n, 1)
    assert (by["rs1/int8/scatter"].payload_bytes, by["rs1/int8/gather"].payload_bytes) == (c, c)
    assert by["rs1/int8/scatter"].bytes_sent == 0 and codec.stats()["payload_bytes"] == 2 * c


def test_group_all_to_all_checks_its_buffers(group):
    with pytest.raises(ValueError, match="input's"):
        group.all_to_all(torch.empty(4), torch.empty(3), tag="x")
    with pytest.raises(ValueError, match="input's"):
        group.all_to_all(torch.empty(4, dtype=torch.int32), torch.empty(4), tag="x")
    with pytest.raises(ValueError, match="contiguous"):
        group.all_to_all(torch.empty(4, 2).t(), torch.empty(8), tag="x")
    src = torch.arange(6.0)
    out = torch.empty(6)
    assert torch.equal(group.all_to_all(out, src, tag="a2a1").wait(), src)
    assert group.meter.by_tag()["a2a1"].payload_bytes == 24


def test_int8_roundtrip_zero_block():
    x = torch.zeros(8)
    buf = torch.empty(2 * 4 + 8, dtype=torch.uint8)
    quantize_blocks(x, 4, buf)
    assert torch.equal(dequantize_blocks(buf, 4), x)


def test_topk_keeps_exactly_the_k_largest(group):
    ts, names = _tensors(3)
    flat = torch.cat([t.reshape(-1) for t in ts])
    codec = TopK(ratio=0.05)
    k = codec.k_for(flat.numel())
    assert k == math.ceil(0.05 * flat.numel())
    codec.mean(ts, names, group, "t")
    out = torch.cat([t.reshape(-1) for t in ts])
    kept = out != 0
    assert int(kept.sum()) == k
    assert torch.equal(out[kept], flat[kept])  # values sent exactly (fp32)
    assert flat[kept].abs().min() >= flat[~kept].abs().max()
    # k fp32 values, then k Elias-Fano positions: l = floor(log2(n / k)) low bits each and a unary high part
    # of k + ((n - 1) >> l) + 1 bits; rounded up to 4 bytes (int32 indices took 4k more than the values).
    n = flat.numel()
    low = math.floor(math.log2(n / k))
    expected = 4 * k + math.ceil((k * low + k + ((n - 1) >> low) + 1) / 8)
    assert codec.stats()["payload_bytes"] == -(-expected // 4) * 4 < 8 * k


def test_powersgd_full_rank_is_exact(group):
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(12, 5, generator=g), torch.randn(4, 9, generator=g), torch.randn(6, 2, 3, generator=g)]
    ref = [t.clone() for t in ts]
    codec = PowerSGD(rank=12, min_compression_rate=0.01, error_feedback=False)
    codec.mean(ts, ["a", "b", "c"], group, "t")
    for a, b in zip(ts, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    st = codec.stats()
    assert st["numel_before"] == 60 + 36 + 36
    assert st["numel_after"] == 5 * 17 + 4 * 13 + 6 * 12  # r * (n + m), r = min(n, m)
    assert group.meter.counters("t/powersgd/p").ops == 1 and group.meter.counters("t/powersgd/q").ops == 1


def test_powersgd_low_rank_and_uncompressed_split(group):
    ts, names = _tensors()
    ref = [t.clone() for t in ts]
    before = group.meter.counters("u")
    codec = PowerSGD(rank=2)
    codec.mean(ts, names, group, "u")
    small = [torch.randn(8, 8)]  # 64 <= 2 * 2 * 16: would not shrink 2x, sent as is
    small_ref = small[0].clone()
    codec.mean(small, ["tiny"], group, "u2")
    assert torch.equal(small[0], small_ref)
    # vectors are sent as they are, batched; 64x32 and the conv as 16x27 are low-rank
    assert torch.equal(ts[1], ref[1]) and torch.equal(ts[3], ref[3])
    assert not torch.allclose(ts[0], ref[0]) and not torch.allclose(ts[2], ref[2])
    by = group.meter.by_tag()
    assert by["u/powersgd/uncompressed"].payload_bytes == 4 * (32 + 1000)
    assert by["u/powersgd/p"].payload_bytes == 4 * (64 * 2 + 16 * 2)
    assert by["u/powersgd/q"].payload_bytes == 4 * (32 * 2 + 27 * 2)
    assert group.meter.counters("u").ops - before.ops == 3


def test_powersgd_start_iter_counts_per_name(group):
    codec = PowerSGD(rank=1, start_iter=2)
    for step in range(3):
        t = torch.randn(32, 32)
        ref = t.clone()
        codec.mean([t], ["w"], group, "s")
        assert torch.equal(t, ref) == (step < 2)
    t = torch.randn(32, 32)  # a new name starts its own warm-up
    ref = t.clone()
    codec.mean([t], ["w2"], group, "s")
    assert torch.equal(t, ref)


def test_powersgd_leaves_user_rng_alone(group):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    PowerSGD(rank=2, warm_start=False).mean([torch.randn(20, 20)], ["w"], group, "r")
    torch.manual_seed(123)
    PowerSGD(rank=2, warm_start=False).mean([torch.ones(20, 20)], ["w"], group, "r")
    assert torch.equal(torch.rand(3), expected)


def test_orthonormalize_zero_column_stays_finite():
    p = torch.zeros(1, 5, 2)
    orthonormalize_(p, 1e-8)
    assert torch.equal(p, torch.zeros(1, 5, 2))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ErrorFeedback(TopK(0.1)),
        lambda: ErrorFeedback(Int8Blockwise(32)),
        lambda: ErrorFeedback(Cast(torch.bfloat16)),
        lambda: ErrorFeedback(PowerSGD(rank=1, error_feedback=False, min_compression_rate=1.0)),
        lambda: SparseLoCo(0.05, 2, 256),
    ],
)
def test_error_feedback_conserves_the_sum(group, make):
    codec = make()
    g = torch.Generator().manual_seed(7)
    total_in = [torch.zeros(40, 30, dtype=torch.float64), torch.zeros(25, dtype=torch.float64)]
    total_out = [torch.zeros_like(t) for t in total_in]
    for _ in range(30):
        ts = [torch.randn(40, 30, generator=g), torch.randn(25, generator=g)]
        for a, t in zip(total_in, ts):
            a += t.double()
        codec.mean(ts, ["w", "b"], group, "ef")
        for a, t in zip(total_out, ts):
            a += t.double()
    for name, a, b in zip(["w", "b"], total_in, total_out):
        res = codec.residuals[name].double()
        assert res.abs().max() > 0 or name == "b"
        torch.testing.assert_close(b + res, a, rtol=0, atol=1e-4)


def test_powersgd_builtin_error_feedback_conserves_the_sum(group):
    codec = PowerSGD(rank=1)
    g = torch.Generator().manual_seed(8)
    total_in = torch.zeros(40, 30, dtype=torch.float64)
    total_out = torch.zeros_like(total_in)
    for _ in range(30):
        t = torch.randn(40, 30, generator=g)
        total_in += t.double()
        codec.mean([t], ["w"], group, "ef")
        total_out += t.double()
    torch.testing.assert_close(total_out + codec.errors["w"].double(), total_in, rtol=0, atol=1e-4)


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PowerSGD(rank=2, seed=3),
        lambda: PowerSGD(rank=2, warm_start=False, error_feedback=False),
        lambda: ErrorFeedback(TopK(0.1)),
        lambda: ErrorFeedback(Int8Blockwise(16)),
        lambda: ErrorFeedback(Int8Blockwise(16, method="reduce_scatter")),
        lambda: SizeAdaptive(Identity(), ErrorFeedback(TopK(0.2)), threshold=100),
        lambda: SparseLoCo(0.05, 2, 256, decay=0.9),
    ],
)
def test_state_dict_roundtrip_continues_exactly(group, make):
    a = make()
    g = torch.Generator().manual_seed(5)
    steps = [[torch.randn(30, 20, generator=g), torch.randn(20, generator=g)] for _ in range(6)]
    for ts in steps[:3]:
        a.mean([t.clone() for t in ts], ["w", "b"], group, "sd")
    b = make()
    b.load_state_dict(_roundtrip(a.state_dict()))
    for ts in steps[3:]:
        out_a, out_b = [t.clone() for t in ts], [t.clone() for t in ts]
        a.mean(out_a, ["w", "b"], group, "sd")
        b.mean(out_b, ["w", "b"], group, "sd")
        for x, y in zip(out_a, out_b):
            assert torch.equal(x, y)


def test_load_state_dict_rejects_other_config(group):
    with pytest.raises(ConfigError, match="rank"):
        PowerSGD(rank=2).load_state_dict(PowerSGD(rank=3).state_dict())
    with pytest.raises(ConfigError, match="TopK"):
        Identity().load_state_dict(TopK(0.5).state_dict())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: PowerSGD(rank=0), "rank"),
        (lambda: PowerSGD(rank=1.5), "rank"),
        (lambda: PowerSGD(start_iter=-1), "start_iter"),
        (lambda: PowerSGD(min_compression_rate=0), "min_compression_rate"),
        (lambda: PowerSGD(orthogonalization_epsilon=-1), "orthogonalization_epsilon"),
        (lambda: TopK(0), "ratio"),
        (lambda: TopK(1.5), "ratio"),
        (lambda: TopK(-0.1), "ratio"),
        (lambda: Int8Blockwise(0), "block_size"),
        (lambda: Int8Blockwise(-4), "block_size"),
        (lambda: Int8Blockwise(method="ring"), "method"),
        (lambda: Cast(torch.float32), "float16"),
        (lambda: ErrorFeedback(Identity()), "lossy"),
        (lambda: ErrorFeedback(PowerSGD(rank=1)), "twice"),
        (lambda: SizeAdaptive(Identity(), TopK(0.1), threshold=0), "threshold"),
    ],
)
def test_bad_config(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize(
    "codec", [Identity(), Cast(), Int8Blockwise(), TopK(0.5), PowerSGD(), ErrorFeedback(TopK(0.5))]
)
def test_integer_tensors_rejected(group, codec):
    with pytest.raises(TypeError, match="floating"):
        codec.mean([torch.ones(4, 4, dtype=torch.int64)], ["steps"], group, "bad")


@pytest.mark.parametrize(
    "make",
    [
        lambda: ErrorFeedback(TopK(0.2)),
        lambda: ErrorFeedback(Int8Blockwise(16)),
        lambda: PowerSGD(rank=2),
        lambda: SparseLoCo(0.05, 2, 256),
    ],
)
def test_nan_step_does_not_poison_state(group, make):
    codec = make()
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        codec.mean([torch.randn(30, 20, generator=g), torch.randn(20, generator=g)], ["w", "b"], group, "nan")
    before = {k: v.clone() for k, v in codec.state_dict().get("residuals", codec.state_dict().get("errors")).items()}
    bad = torch.randn(30, 20, generator=g)
    bad[3, 4] = float("nan")
    out = [bad, torch.randn(20, generator=g)]
    codec.mean(out, ["w", "b"], group, "nan")
    assert not torch.isfinite(out[0]).all()  # passed through: the caller can skip the step
    after = codec.state_dict()
    state = after.get("residuals", after.get("errors"))
    assert torch.equal(state["w"], before["w"])  # the bad step left no trace
    assert after["nonfinite_steps"] == 1
    for _ in range(3):
        ts = [torch.randn(30, 20, generator=g), torch.randn(20, generator=g)]
        codec.mean(ts, ["w", "b"], group, "nan")
        assert all(torch.isfinite(t).all() for t in ts)
    if isinstance(codec, PowerSGD):
        assert all(torch.isfinite(q).all() for q in codec.q.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "make", [Identity, lambda: Cast(torch.bfloat16), lambda: Int8Blockwise(32), lambda: TopK(1.0), lambda: PowerSGD(4)]
)
def test_half_precision_inputs(group, make, dtype):
    ts, names = _tensors(dtype=dtype)
    ref = [t.float() for t in ts]
    make().mean(ts, names, group, "h")
    for a, b in zip(ts, ref):
        assert a.dtype == dtype
        assert torch.isfinite(a).all()
        if not isinstance(make(), PowerSGD):
            torch.testing.assert_close(a.float(), b, rtol=0.02, atol=0.05)


def test_size_adaptive_routes_by_numel(group):
    ts, names = _tensors()
    ref = [t.clone() for t in ts]
    codec = SizeAdaptive(Identity(), TopK(0.01), threshold=500)
    codec.mean(ts, names, group, "ad")
    assert torch.equal(ts[1], ref[1]) and torch.equal(ts[2], ref[2])  # 32 and 432 elements: exact
    assert (ts[0] == 0).sum() > 0 and (ts[3] == 0).sum() > 0
    assert codec.stats()["large"]["numel_in"] == 64 * 32 + 1000


@pytest.mark.parametrize("make", [Identity, lambda: ErrorFeedback(Int8Blockwise(16)), lambda: PowerSGD(2)])
def test_parameters_can_be_averaged_in_place(group, make):
    lin = torch.nn.Linear(20, 30)
    ref = lin.weight.detach().clone()
    make().mean([lin.weight, lin.bias], ["weight", "bias"], group, "params")
    assert lin.weight.requires_grad and lin.weight.grad_fn is None
    assert torch.allclose(lin.weight, ref, atol=0.5)
