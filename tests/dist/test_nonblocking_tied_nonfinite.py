"""NonBlocking with shared (tied) weights, and with NaN/Inf gradients, against plain-torch references.

The reference is NonBlocking's exact semantics in one process: before step
t's forward, the optimizer applies the mean over ranks of step t-1's
gradients, with the learning rate of step t-1 (the scheduler steps right
after). A skipped step applies nothing but its scheduler step still happens.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import Net, TiedGPT
from shoal.codecs import Identity
from shoal.strategies import NonBlocking
from shoal.testing import run_workers

Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def _gpt_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, 16, (3, 7), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)


def _mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _make(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    net: nn.Module = TiedGPT() if kind == "gpt" else Net(width=16)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    return net, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _reference(kind: str, world: int, steps: int, skip: int | None) -> tuple[list[list[float]], list[dict], dict]:
    """Plain torch, one process; the update of step ``skip`` is left out."""
    batch, loss_fn = (_gpt_batch, _gpt_loss) if kind == "gpt" else (_mlp_batch, _mlp_loss)
    net, opt, sched = _make(kind)
    params = list(net.parameters())  # a tied parameter once, its gradient summed over its uses
    losses: list[list[float]] = []
    visible: list[dict] = []
    pending: list[torch.Tensor | None] = []
    for step in range(steps + 1):
        if step > 0:
            if step - 1 != skip:
                for p, g in zip(params, pending):
                    p.grad = g
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if step == steps:
            break
        visible.append(_state(net))
        per_rank = []
        step_losses = []
        for rank in range(world):
            net.zero_grad(set_to_none=True)
            loss = loss_fn(net, batch(rank, step))
            loss.backward()
            step_losses.append(loss.item())
            per_rank.append([p.grad.clone() if p.grad is not None else None for p in params])
        net.zero_grad(set_to_none=True)
        pending = [None if gs[0] is None else torch.stack(gs).mean(0) for gs in zip(*per_rank)]  # type: ignore[misc]
        losses.append(step_losses)
    return losses, visible, _state(net)


def _train(rank: int, kind: str, steps: int, codec: Any, bad: tuple[int, float] | None,
           finalise_bad: bool = False) -> dict[str, Any]:
    """NonBlocking; with ``bad = (step, value)`` rank 1 fills its output layer's gradient with ``value`` then.

    ``finalise_bad``: at that step every rank calls ``model.finalize()`` between backward and ``step()``
    (the means land in ``.grad`` first, then ``step()`` must skip them).
    """
    batch, loss_fn = (_gpt_batch, _gpt_loss) if kind == "gpt" else (_mlp_batch, _mlp_loss)
    net, opt, _ = _make(kind)
    model, nb_opt = NonBlocking(codec=codec).wrap(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(nb_opt, lambda s: 1.0 / (1 + s))
    losses, visible = [], []
    for step in range(steps):
        nb_opt.zero_grad()
        loss = loss_fn(model, batch(rank, step))
        hook = None
        if bad is not None and rank == 1 and step == bad[0]:
            # The output layer: launched first in backward, used last in the forward.
            hook = net.out.weight.register_hook(lambda g: torch.full_like(g, bad[1]))  # type: ignore[union-attr]
        loss.backward()
        if hook is not None:
            hook.remove()
        if finalise_bad and bad is not None and step == bad[0]:
            model.finalize()  # type: ignore[operator]
        nb_opt.step()
        sched.step()
        visible.append(_state(net))
        losses.append(loss.item())
    model.eval()
    return {"losses": losses, "visible": visible, "final": _state(net),
            "skips": model.comm_stats().total.nonfinite_skips}  # type: ignore[operator]


def _compare(out: dict[str, Any], ref: tuple[list[list[float]], list[dict], dict], rank: int, what: str) -> None:
    ref_losses, ref_visible, ref_final = ref
    for step, (loss, seen) in enumerate(zip(out["losses"], out["visible"])):
        assert loss == pytest.approx(ref_losses[step][rank], rel=1e-5, abs=1e-6), (what, rank, step)
        for name, v in ref_visible[step].items():
            torch.testing.assert_close(seen[name], v, rtol=1e-5, atol=1e-6, msg=f"{what} rank {rank} step {step} {name}")
    for name, v in ref_final.items():
        torch.testing.assert_close(out["final"][name], v, rtol=1e-5, atol=1e-6, msg=f"{what} rank {rank} final {name}")


def _tied_work(rank: int, world: int) -> dict[str, Any]:
    return _train(rank, "gpt", 4, None, None)


@pytest.mark.timeout(150)
def test_tied_weights_transformer_equals_reference_on_4_ranks() -> None:
    res = run_workers(_tied_work, 4, timeout=140)
    ref = _reference("gpt", 4, 4, None)
    for rank, out in enumerate(res):
        assert torch.equal(out["final"]["tok.weight"], out["final"]["head.weight"])  # still one matrix
        _compare(out, ref, rank, "tied")
        assert out["skips"] == 0


STEPS, BAD_STEP = 5, 2
CASES = {"nan": (None, float("nan"), False), "inf_codec": (Identity(), float("inf"), False),
         "nan_finalised": (None, float("nan"), True)}


def _nonfinite_work(rank: int, world: int) -> dict[str, Any]:
    return {case: _train(rank, "mlp", STEPS, codec, (BAD_STEP, value), fin)
            for case, (codec, value, fin) in CASES.items()}


@pytest.mark.timeout(120)
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank() -> None:
    res = run_workers(_nonfinite_work, 2, timeout=110)
    ref = _reference("mlp", 2, STEPS, BAD_STEP)
    for case in CASES:
        for rank, outs in enumerate(res):
            out = outs[case]
            assert out["skips"] == 1, (case, rank)
            for state in out["visible"] + [out["final"]]:
                assert all(bool(v.isfinite().all()) for v in state.values()), (case, rank)
            for name, v in out["final"].items():
                assert torch.equal(v, res[0][case]["final"][name]), (case, rank, name)  # ranks agree bitwise
            _compare(out, ref, rank, case)
        # The skipped step: parameters seen after step BAD_STEP + 1 are those seen after BAD_STEP.
        for name, v in res[0][case]["visible"][BAD_STEP].items():
            assert torch.equal(res[0][case]["visible"][BAD_STEP + 1][name], v), (case, name)
