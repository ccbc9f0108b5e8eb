"""Every parameter dtype torch's DDP accepts, on every shoal path that checks finiteness (issue #24).

torch's DDP trains fp16, bf16, fp32, fp64, complex64 and complex128 models
on gloo; shoal's fused NaN/Inf check once asked ``torch._foreach_norm`` to
narrow fp64 to fp32 and crashed in backward, and ignored complex tensors. Here
two gloo ranks run, in one pair of worker processes, for each dtype:

- shoal DDP on a static group and on an elastic group, shoal.wrap(Sync) and
  ZeRO under shoal DDP, each against torch's DDP with a plain optimizer as the
  oracle. Rank 1 feeds a NaN at step ``NAN_STEP``: shoal skips that step on
  both ranks (SPEC G5), so the oracle trains on the same data without it;
- the averaging strategies (every rank equal and finite after the last
  round, the NaN step skipped) and each codec (the same, for real dtypes; a
  complex tensor is refused by a codec with a clear error).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shoal
from shoal import codecs
from shoal.elastic import Coordinator, ElasticGroup, Timeouts
from shoal.testing import run_workers

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64,
          "c64": torch.complex64, "c128": torch.complex128}
STEPS, NAN_STEP = 6, 2
_T = Timeouts(op=20.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=10.0, quorum=30.0, join=60.0)


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _train(model: nn.Module, opt: Any, rank: int, dtype: torch.dtype, nan: bool,
           after: Callable[[], None] = lambda: None) -> None:
    """STEPS steps of different data per rank; ``nan``: rank 1's input holds a NaN at NAN_STEP (shoal
    skips the step), else NAN_STEP is left out (torch's DDP, the oracle of that skip)."""
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x, y = torch.randn(8, 8, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)
        if step == NAN_STEP and not nan:
            continue
        if step == NAN_STEP and rank == 1:
            x[0, 0] = float("nan")
        (model(x) - y).abs().pow(2).float().mean().backward()
        opt.step()
        opt.zero_grad()
        after()


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.complex128) for p in model.parameters()])


def _oracle(dtype: torch.dtype, rank: int) -> torch.Tensor:
    ref = TorchDDP(_net(dtype))
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), rank, dtype, nan=False)
    return _params(ref)


def _skips(stats: Any) -> int:
    return int(stats.comm_stats().total.nonfinite_skips)


def _ddp(rank: int, dtype: torch.dtype, group: Any) -> dict[str, Any]:
    model = shoal.DistributedDataParallel(_net(dtype), process_group=group)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank, dtype, nan=True)
    return {"params": _params(model), "skips": _skips(model)}


def _zero(rank: int, dtype: torch.dtype, group: Any) -> dict[str, Any]:
    net = _net(dtype)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.05,
                                         momentum=0.9)
    model = shoal.DistributedDataParallel(net, process_group=group)
    _train(model, zero, rank, dtype, nan=True)
    zero.wait_for_params()
    return {"params": _params(model), "skips": _skips(model)}


def _sync(rank: int, dtype: torch.dtype, group: Any) -> dict[str, Any]:
    net = _net(dtype)
    strategy = shoal.Sync()
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), strategy,
                            process_group=group)
    _train(model, opt, rank, dtype, nan=True)
    return {"params": _params(net), "skips": _skips(strategy)}


def _elastic(run: Callable[[int, torch.dtype, Any], dict[str, Any]], rank: int, dtype: torch.dtype,
             coord: tuple[str, str, str]) -> dict[str, Any]:
    group = ElasticGroup(f"dtype-{run.__name__}-{dtype}-{coord[2]}", coordinator=coord[0], timeouts=_T, min_workers=2, token=coord[1])
    try:
        out = run(rank, dtype, group)
        out["discards"] = group.stats.discards
        return out
    finally:
        group.leave()


# --- the averaging strategies and the codecs: the invariants (equal, finite, the NaN step skipped) ---

STRATEGIES: dict[str, Callable[[], shoal.Strategy]] = {
    "localsgd": lambda: shoal.LocalSGD(period=2, average_optimizer_state=True),
    "diloco": lambda: shoal.DiLoCo(inner_steps=2),
    "nonblocking": lambda: shoal.NonBlocking(),
    "daso": lambda: shoal.DASO(total_epochs=3, steps_per_epoch=2, warmup_epochs=1, cooldown_epochs=1),
}
EQUAL_AFTER = {"localsgd": 4, "diloco": 5, "nonblocking": 5, "daso": 5}   # the last step that ends a round
REAL_ONLY = {"localsgd", "diloco"}   # average through a codec: complex parameters are refused
CODECS: dict[str, Callable[[], codecs.Codec]] = {
    "identity": codecs.Identity,
    "bf16": lambda: codecs.Cast(torch.bfloat16),
    "int8": lambda: codecs.Int8Blockwise(64),
    "topk": lambda: codecs.ErrorFeedback(codecs.TopK(0.1)),
    "powersgd": lambda: codecs.PowerSGD(rank=2, min_compression_rate=1),
}


def _strategy(rank: int, dtype: torch.dtype, name: str) -> dict[str, Any]:
    net = _net(dtype)
    strategy = STRATEGIES[name]()
    model, opt = shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy)
    trail: list[torch.Tensor] = []
    _train(model, opt, rank, dtype, nan=True, after=lambda: trail.append(_params(net)))
    strategy.close()
    return {"params": trail[EQUAL_AFTER[name]], "skips": _skips(strategy)}


def _codec(rank: int, dtype: torch.dtype, name: str) -> dict[str, Any]:
    model = shoal.DistributedDataParallel(_net(dtype), codec=CODECS[name](), bucket_cap_mb=0.0005)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), rank, dtype, nan=True)
    return {"params": _params(model), "skips": _skips(model)}


ORACLE_RUNS = {"ddp": _ddp, "zero": _zero, "sync": _sync}
CASES = ([f"{run}/{where}/{dt}" for run in ORACLE_RUNS for where in ("static", "elastic") for dt in DTYPES]
         + [f"strategy/{s}/{dt}" for s in STRATEGIES for dt in DTYPES]
         + [f"codec/{c}/{dt}" for c in CODECS for dt in DTYPES])


def _case(rank: int, case: str, coord: tuple[str, str, str]) -> dict[str, Any]:
    kind, name, dt = case.split("/")
    dtype = DTYPES[dt]
    if kind == "strategy":
        return _strategy(rank, dtype, name)
    if kind == "codec":
        return _codec(rank, dtype, name)
    run = ORACLE_RUNS[kind]
    out = _elastic(run, rank, dtype, coord) if name == "elastic" else run(rank, dtype, None)
    out["oracle"] = _oracle(dtype, rank)
    return out


def _all_cases(rank: int, world: int, coord: tuple[str, str, str]) -> dict[str, Any]:
    """Every case in one pair of worker processes; a case that raises is reported by its test."""
    out: dict[str, Any] = {}
    for case in CASES:
        try:
            out[case] = _case(rank, case, coord)
        except Exception as e:  # noqa: BLE001 - reported by the case's test
            out[case] = f"raised {e!r}"
    return out


@pytest.fixture(scope="module")
def results() -> Any:
    token = "dtype-test-token"
    coord = Coordinator(port=0, initial_workers=2, token=token).start()
    try:
        yield run_workers(_all_cases, 2, (coord.address, token, coord.address.rsplit(":", 1)[1]), timeout=500)
    finally:
        coord.stop()


def _get(results: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    got = [r[case] for r in results]
    for rank, r in enumerate(got):
        assert isinstance(r, dict), f"rank {rank}, {case}: {r}"
    return got


TOL = {"fp16": 2e-3, "bf16": 2e-2, "fp32": 1e-6, "fp64": 1e-12, "c64": 1e-6, "c128": 1e-12}


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", [c for c in CASES if c.split("/")[0] in ORACLE_RUNS])
def test_matches_torch_ddp_and_skips_the_nan_step(results: list[dict[str, Any]], case: str) -> None:
    tol = TOL[case.split("/")[2]]
    for rank, r in enumerate(_get(results, case)):
        assert r["skips"] == 1, f"rank {rank}, {case}: {r['skips']} non-finite skips, expected 1"
        assert r.get("discards", 0) == 0, f"rank {rank}, {case}: a skipped step must be no discard"
        diff = float((r["params"] - r["oracle"]).abs().max())
        assert diff <= tol, f"rank {rank}, {case}: max |shoal - torch DDP| = {diff:.3g} > {tol}"
        moved = float((r["oracle"] - _params(_net(DTYPES[case.split("/")[2]]))).abs().max())
        assert moved > 1e-3, f"{case}: training did not move the parameters; the comparison would be vacuous"


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", [c for c in CASES if c.split("/")[0] not in ORACLE_RUNS])
def test_strategies_and_codecs_skip_the_nan_and_agree(results: list[dict[str, Any]], case: str) -> None:
    kind, name, dt = case.split("/")
    if (kind == "codec" or name in REAL_ONLY) and DTYPES[dt].is_complex:
        for rank, r in enumerate(r[case] for r in results):
            assert isinstance(r, str) and "TypeError" in r and "complex" in r, f"rank {rank}, {case}: {r}"
        return
    got = _get(results, case)
    assert got[1]["skips"] >= 1, f"rank 1, {case}: its NaN step was not skipped"
    for rank, r in enumerate(got):
        assert bool(r["params"].isfinite().all()), f"rank {rank}, {case}: parameters went non-finite"
    assert torch.equal(got[0]["params"], got[1]["params"]), f"{case}: the ranks disagree after the last round"
