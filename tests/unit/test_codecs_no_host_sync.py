"""Codecs decide about non-finite means on the device: no host sync inside ``mean`` (issue #13 item 2).

A host read between a codec's collectives (``bool(t)``, ``.item()``,
``.tolist()``, an op whose output size depends on the data) blocks its
communication thread until the device catches up; with NCCL and a training
stream waiting on that thread it deadlocks. On the CPU such a read costs
nothing, so the tests make it fail instead: a dispatch mode raises on every
op that reads a tensor's value on the host, and ``Tensor.tolist`` is patched
to raise.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shoal.codecs import ErrorFeedback, Int8Blockwise, PowerSGD, SparseLoCo, TopK
from shoal.comm import Group
from shoal.testing import free_port

pytestmark = pytest.mark.timeout(60)

# Ops that hand a tensor's data to the host (or size their output by it: a sync on CUDA).
_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
}


# Indexing with a boolean mask sizes its output (or work) by the mask's contents.
_MASKED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class HostSyncError(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSyncError` on any op that reads tensor data on the host."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _HOST_READS or (func in _MASKED and _bool_index(args)):
            raise HostSyncError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def group():
    torch.set_num_threads(1)
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        created = True
    yield Group()
    if created:
        dist.destroy_process_group()


@pytest.fixture
def no_tolist(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: torch.Tensor) -> Any:
        raise HostSyncError("host sync: Tensor.tolist")
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)


def test_the_guard_catches_host_reads(no_tolist: None) -> None:
    t = torch.tensor([1.0, float("nan")])
    for read in (lambda: bool(t.isfinite().all()), lambda: t.sum().item(), lambda: t.tolist(),
                 lambda: t[t > 0], lambda: float(t[0])):
        with NoHostSync(), pytest.raises(HostSyncError):
            read()


STATEFUL: dict[str, Callable[[], Any]] = {
    "ef_topk": lambda: ErrorFeedback(TopK(0.2)),
    "ef_int8": lambda: ErrorFeedback(Int8Blockwise(16)),
    "sparseloco": lambda: SparseLoCo(0.1, 2, 64),
    "powersgd": lambda: PowerSGD(rank=2),
    "powersgd_no_ef": lambda: PowerSGD(rank=2, error_feedback=False),
}


def _state(codec: Any) -> dict[str, torch.Tensor]:
    if isinstance(codec, ErrorFeedback):
        return {f"res/{k}": v.clone() for k, v in codec.residuals.items()}
    return {**{f"q/{k}": v.clone() for k, v in codec.q.items()},
            **{f"err/{k}": v.clone() for k, v in codec.errors.items()}}


@pytest.mark.parametrize("name", list(STATEFUL))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_mean_keeps_state_without_host_sync(group: Group, no_tolist: None, name: str, value: float) -> None:
    codec = STATEFUL[name]()
    g = torch.Generator().manual_seed(3)
    names = ["w", "b", "w2"]

    def batch() -> list[torch.Tensor]:
        return [torch.randn(30, 20, generator=g), torch.randn(20, generator=g), torch.randn(12, 40, generator=g)]

    for _ in range(2):
        with NoHostSync():
            codec.mean(batch(), names, group, "warm")
    before = _state(codec)
    bad = batch()
    bad[0][3, 4] = value
    with NoHostSync():
        codec.mean(bad, names, group, "bad")   # a host read anywhere in here raises
    assert not torch.isfinite(bad[0]).all()    # passed through for the caller's check
    after = _state(codec)
    assert before.keys() == after.keys()
    for k in before:
        if k.endswith("/w") or k == "res/w":
            assert torch.equal(after[k], before[k]), f"{name}: {k} changed on a non-finite mean"
        assert torch.isfinite(after[k]).all(), f"{name}: {k} poisoned"
    moved = [k for k in before if not k.endswith("/w") and not torch.equal(after[k], before[k])]
    assert moved, f"{name}: the finite tensors' state did not move: the comparison would be vacuous"
    assert codec.stats()["nonfinite_steps"] == 1
    for _ in range(2):
        ts = batch()
        codec.mean(ts, names, group, "later")
        assert all(torch.isfinite(t).all() for t in ts)


def test_empty_tensors_are_finite(group: Group) -> None:
    codec = ErrorFeedback(TopK(0.5))
    ts = [torch.randn(4, 3), torch.empty(0), torch.randn(5)]
    with NoHostSync():
        codec.mean(ts, ["w", "empty", "b"], group, "empty")
    assert ts[1].numel() == 0 and codec.stats()["nonfinite_steps"] == 0
