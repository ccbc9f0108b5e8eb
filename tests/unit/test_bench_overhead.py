"""`python -m shoal.bench.overhead`: argument checks, the gpt sizes, and small CPU runs of the real benchmark."""

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.bench.gpt import GPT, GPT_SIZES
from shoal.bench.overhead import _order, main


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "overhead.json"
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_without_cuda_exits_2_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda needs a CUDA GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be >= 1"),
    (["--workers", "1,two"], "comma-separated integers"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--rounds", "-1"], "--rounds must be >= 1"),
    (["--batch", "-2"], "must be >= 0"),
    (["--tasks", "mlp,resnet"], "unknown task(s) 'resnet'"),
    (["--tasks", "gpt", "--gpt-size", "tiny", "--context", "33"], "position table (32)"),
    (["--gpt-size", "huge"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_a_reason(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_gpt_sizes_count_their_parameters_and_the_default_is_in_the_issue_range() -> None:
    for name in ("tiny", "34m"):
        model = GPT(GPT_SIZES[name])
        assert sum(p.numel() for p in model.parameters()) == GPT_SIZES[name].num_parameters()
    assert 30e6 <= GPT_SIZES["34m"].num_parameters() <= 50e6  # issue #13: a 30-50M parameter transformer
    assert GPT(GPT_SIZES["tiny"])(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, 256)


def test_block_order_alternates_shoal_and_torch_and_rotates_bare() -> None:
    orders = [tuple(_order(r)) for r in range(6)]
    assert sorted(orders) == sorted(itertools.permutations(("bare", "shoal", "torch")))
    for r, order in enumerate(orders):
        assert (order.index("shoal") < order.index("torch")) == (r % 2 == 0)


@pytest.mark.timeout(60)
def test_world_1_gpt_on_cpu_trains_like_the_bare_model(tmp_path: Path) -> None:
    out = _run(tmp_path, "--workers", "1", "--tasks", "gpt", "--gpt-size", "tiny",
               "--steps", "2", "--rounds", "2", "--warmup", "1")
    assert out["device"] == "cpu" and out["steps"] == 2 and out["rounds"] == 2
    (r,) = out["results"]
    assert (r["task"], r["world"], r["gpt_size"], r["batch"], r["context"]) == ("gpt", 1, "tiny", 16, 32)
    assert r["params"] == GPT_SIZES["tiny"].num_parameters()
    ms = r["median_ms"]
    assert set(ms) == {"bare", "shoal", "torch"} and all(v > 0 for v in ms.values())
    assert r["ratio"] == pytest.approx(ms["shoal"] / ms["torch"])
    assert r["overhead_vs_bare"] == pytest.approx({k: ms[k] / ms["bare"] for k in ("shoal", "torch")})
    # One rank: nothing crosses a wire, and averaging over a 1-rank group leaves the gradients as they are.
    assert r["bytes_sent_per_step"] == r["formula_bytes"] == r["ring_bound_bytes"] == 0 and r["bytes_ok"]
    loss = r["final_loss"]
    assert loss["shoal"] == pytest.approx(loss["bare"], rel=1e-5)
    assert loss["torch"] == pytest.approx(loss["bare"], rel=1e-5)


@pytest.mark.timeout(90)
def test_world_2_mlp_bytes_equal_the_ring_formula(tmp_path: Path) -> None:
    out = _run(tmp_path, "--workers", "2", "--tasks", "mlp", "--steps", "1", "--rounds", "1", "--warmup", "1")
    (r,) = out["results"]
    assert (r["task"], r["world"], r["batch"]) == ("mlp", 2, 64)
    assert r["params"] == 5_247_232
    # Two ranks: 2(N-1)/N * S = S, the fp32 gradient bytes.
    assert r["bytes_sent_per_step"] == r["formula_bytes"] == r["ring_bound_bytes"] == 4 * 5_247_232
    assert r["bytes_ok"]
    assert r["final_loss"]["shoal"] == pytest.approx(r["final_loss"]["torch"], rel=1e-5)
