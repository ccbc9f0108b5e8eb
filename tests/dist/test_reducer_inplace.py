"""Gradients accumulate straight into the bucket buffers: no per-parameter copy or division."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import shoal
from shoal.testing import run_workers

# Ops that move or scale gradient data (autograd's own in-place accumulation, add_, is not one).
_COPYING = ("copy", "div", "clone", "mul")


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _deep(depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])  # 2 * depth parameters, one bucket


def _copy_ops_per_backward(depth: int, as_view: bool) -> tuple[int, bool, list[bool]]:
    """Data-moving ops of the second synchronised backward; whether the gradients are the
    averaged ones; which ``.grad`` lie inside the bucket buffer."""
    model = shoal.DistributedDataParallel(_deep(depth), gradient_as_bucket_view=as_view)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(model.group.rank))
    model(x).sum().backward()  # warm-up step (lazy init, the buffer hand-over)
    model.zero_grad(set_to_none=True)
    out = model(x).sum()
    with _CountOps() as mode:
        out.backward()
    copies = sum(n for name, n in mode.counts.items() if any(w in name for w in _COPYING))
    (bucket,) = model.reducer.buckets
    lo = bucket.buffer.data_ptr()
    hi = lo + bucket.buffer.numel() * bucket.buffer.element_size()
    inside = [lo <= p.grad.data_ptr() < hi for p in model.module.parameters() if p.grad is not None]
    # The average, against an all-reduce of locally computed gradients.
    plain = _deep(depth)
    plain(x).sum().backward()
    ok = True
    for p, q in zip(model.module.parameters(), plain.parameters()):
        assert q.grad is not None and p.grad is not None
        torch.distributed.all_reduce(q.grad)
        ok = ok and torch.allclose(p.grad, q.grad / model.group.size, rtol=1e-5, atol=1e-6)
    return copies, ok, inside


def _inplace(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for as_view in (False, True):
        for depth in (3, 12):
            out[f"{as_view}/{depth}"] = _copy_ops_per_backward(depth, as_view)
    return out


@pytest.mark.timeout(90)
def test_gradients_accumulate_in_bucket_views_without_per_parameter_copies() -> None:
    for res in run_workers(_inplace, 2, timeout=75):
        for as_view in (False, True):
            (small, ok_s, in_s), (big, ok_b, in_b) = res[f"{as_view}/3"], res[f"{as_view}/12"]
            assert ok_s and ok_b, f"as_view={as_view}: gradients are not the average"
            # 6 vs 24 parameters, one bucket: the copy/div work must not grow with the parameters.
            assert small == big, f"as_view={as_view}: {small} copy/div ops for 6 parameters, {big} for 24"
            # Every gradient is accumulated in its view; only the first one to arrive (autograd made
            # it before the backward's first hook) is a tensor of its own when not as_view.
            assert sum(in_b) >= len(in_b) - (0 if as_view else 1), f"as_view={as_view}: {in_b}"


def _grad_not_aliased(rank: int, world: int) -> bool:
    """gradient_as_bucket_view=False (torch's semantics): a .grad kept from one step is not
    overwritten by the next step's reduction; a forward alone does not create .grad."""
    model = shoal.DistributedDataParallel(_deep(2))
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
    kept = [p.grad for p in model.module.parameters()]
    values = [t.clone() for t in kept]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
    fresh = [p.grad for p in model.module.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(kept, values))  # type: ignore[arg-type]
    moved = all(not torch.equal(a, b) for a, b in zip(fresh, values))  # type: ignore[arg-type]
    # A forward that no backward follows (evaluation with grad enabled) leaves .grad alone.
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 8, generator=g))
    untouched = all(p.grad is None for p in model.module.parameters())
    return unchanged and moved and untouched


@pytest.mark.timeout(60)
def test_kept_grad_is_not_overwritten_by_the_next_step() -> None:
    assert run_workers(_grad_not_aliased, 2, timeout=45) == [True, True]


def _buffer_taken_back(rank: int, world: int) -> dict[str, Any]:
    """gradient_as_bucket_view=False: once the user drops every .grad (zero_grad's default), the
    next backward reduces in the same bucket buffer (a fresh one would be page-faulted in at every
    step); while anything still sees the old buffer (a kept .grad, a view of one), it does not."""
    model = shoal.DistributedDataParallel(_deep(2))
    (bucket,) = model.reducer.buckets
    g = torch.Generator().manual_seed(rank)

    def step() -> int:
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        return bucket.buffer.data_ptr()

    first = step()
    model.zero_grad(set_to_none=True)
    same = [step() == first]
    model.zero_grad(set_to_none=True)
    same.append(step() == first)
    # A view of a dropped .grad still sees the buffer: the next backward must not write into it.
    (param, *_) = model.module.parameters()
    assert param.grad is not None
    held = param.grad.view(-1)
    value = held.clone()
    model.zero_grad(set_to_none=True)
    moved = step() != first
    return {"reused": same, "moved_when_held": moved, "held_intact": torch.equal(held, value)}


@pytest.mark.timeout(60)
def test_dropped_grads_give_the_buffer_back_to_the_reducer() -> None:
    for res in run_workers(_buffer_taken_back, 2, timeout=45):
        assert res == {"reused": [True, True], "moved_when_held": True, "held_intact": True}, res


def _kept_across_set_to_none_false(rank: int, world: int) -> dict[str, bool]:
    """A .grad kept through zero_grad(set_to_none=False) is still a view of the bucket buffer after
    that backward; if it is dropped later while someone holds it, the next backward must not zero
    and reuse the buffer under it (it takes a fresh one), and the held tensor stays as it was."""
    model = shoal.DistributedDataParallel(_deep(2))
    g = torch.Generator().manual_seed(rank)

    def step(scale: float = 1.0) -> None:
        model(torch.randn(4, 8, generator=g) * scale).pow(2).sum().backward()

    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=False)   # the views stay .grad, zeroed
    step()
    (param, *_) = model.module.parameters()
    saved = param.grad
    assert saved is not None
    value = saved.clone()
    model.zero_grad(set_to_none=True)
    step(10.0)
    return {"intact": torch.equal(saved, value), "not_the_new_grad": saved is not param.grad}


@pytest.mark.timeout(60)
def test_grad_kept_through_set_to_none_false_is_never_reused_under_its_holder() -> None:
    for res in run_workers(_kept_across_set_to_none_false, 2, timeout=45):
        assert res == {"intact": True, "not_the_new_grad": True}, res
