"""NonBlocking on 2 gloo ranks against a plain-torch reference of 'apply last step's averaged gradients'."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from shoal.codecs import Identity
from shoal.parallel import DistributedDataParallel
from shoal.strategies import NonBlocking, NonBlockingModule
from shoal.testing import run_workers

STEPS = 5


class Net(nn.Module):
    """fc1 -> (branch on even steps) -> norm -> fc3; ``pos`` is owned by the top module."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(6) * 0.1)
        self.fc1 = nn.Linear(6, 8)
        self.branch = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc1(x + self.pos))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.fc3(self.norm(h))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _make(dynamic: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    return net, opt, None  # type: ignore[return-value]


def _reference(world: int, dynamic: bool) -> tuple[list[float], list[dict], dict]:
    """Plain torch, one process: step t applies the averaged gradients of step t-1 before its forward."""
    net, opt, _ = _make(dynamic)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses, visible, pending = [], [], None
    for step in range(STEPS + 1):
        if pending is not None:  # apply last step's averaged gradients
            for p, g in zip(net.parameters(), pending):
                p.grad = g
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if step == STEPS:
            break
        visible.append({k: v.clone() for k, v in net.state_dict().items()})
        use_branch = not dynamic or step % 2 == 0
        grads: list[list[torch.Tensor | None]] = []
        step_losses = []
        for rank in range(world):
            net.zero_grad(set_to_none=True)
            x, y = _batch(rank, step)
            loss = (net(x, use_branch) - y).pow(2).mean()
            loss.backward()
            step_losses.append(loss.item())
            grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
        pending = [None if gs[0] is None else sum(gs) / world for gs in zip(*grads)]  # type: ignore[misc]
        losses.append(step_losses)
    return losses, visible, {k: v.clone() for k, v in net.state_dict().items()}


def _train(rank: int, world: int, dynamic: bool, codec: object) -> tuple[list[float], list[dict], dict, bool]:
    net, opt, _ = _make(dynamic)
    model, nb_opt = NonBlocking(codec=codec).wrap(net, opt)  # type: ignore[arg-type]
    sched = torch.optim.lr_scheduler.LambdaLR(nb_opt, lambda s: 1.0 / (1 + s))
    losses, visible = [], []
    for step in range(STEPS):
        nb_opt.zero_grad()
        x, y = _batch(rank, step)
        loss = (model(x, not dynamic or step % 2 == 0) - y).pow(2).mean()
        loss.backward()
        nb_opt.step()
        sched.step()
        # What the user sees after step(): this step's update is not applied yet.
        visible.append({k: v.detach().clone() for k, v in net.state_dict().items()})
        losses.append(loss.item())
    before_eval = {k: v.detach().clone() for k, v in net.state_dict().items()}
    model.eval()  # finalises: the last step's update lands
    after = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return losses, visible, after, any(not torch.equal(before_eval[k], after[k]) for k in after)


def _fallbacks(rank: int) -> list[tuple[str, str]]:
    out = []
    for case in ("two", "subset"):
        torch.manual_seed(0)
        net = Net()
        if case == "two":
            opts: object = [torch.optim.SGD(net.fc1.parameters(), lr=0.1),
                            torch.optim.SGD([p for n, p in net.named_parameters() if not n.startswith("fc1")], lr=0.1)]
        else:
            opts = torch.optim.SGD(net.fc3.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, _ = NonBlocking().wrap(net, opts)  # type: ignore[arg-type]
        model(_batch(rank, 0)[0]).sum().backward()  # blocking DDP: gradients averaged in backward
        msg = " | ".join(str(w.message) for w in caught if issubclass(w.category, UserWarning))
        out.append((type(model).__name__, msg, net.fc1.weight.grad.clone()))
    return out  # type: ignore[return-value]


def _work(rank: int, world: int) -> dict:
    return {
        "static": _train(rank, world, False, None),
        "dynamic": _train(rank, world, True, None),
        "codec": _train(rank, world, False, Identity()),
        "fallbacks": _fallbacks(rank),
    }


@pytest.mark.timeout(120)
def test_nonblocking_equals_last_step_reference_and_finalises() -> None:
    res = run_workers(_work, 2, timeout=110)
    for key, dynamic in (("static", False), ("dynamic", True), ("codec", False)):
        ref_losses, ref_visible, ref_final = _reference(2, dynamic)
        for rank, out in enumerate(res):
            losses, visible, final, lag_then_finalised = out[key]
            assert lag_then_finalised, f"{key}: eval() should apply the last step's pending update"
            for step in range(STEPS):
                assert losses[step] == pytest.approx(ref_losses[step][rank], rel=1e-5, abs=1e-6), (key, step)
                for name, v in ref_visible[step].items():
                    torch.testing.assert_close(visible[step][name], v, rtol=1e-5, atol=1e-6, msg=f"{key} {step} {name}")
            for name, v in ref_final.items():
                torch.testing.assert_close(final[name], v, rtol=1e-5, atol=1e-6, msg=f"{key} final {name}")
    for rank, out in enumerate(res):
        for (kind, msg, grad), expect in zip(out["fallbacks"], ("2 optimizers", "outside the model")):
            assert kind == DistributedDataParallel.__name__ and "falls back to blocking" in msg and expect in msg
        torch.testing.assert_close(out["fallbacks"][0][2], res[0]["fallbacks"][0][2])  # averaged in backward


def test_layers_in_launch_order() -> None:
    layers = [layer.name for layer in __import__("shoal.strategies.nonblocking", fromlist=["x"]).find_layers(Net())]
    assert layers == ["fc3", "norm", "branch", "fc1", ""]
    assert NonBlockingModule.__name__ == "NonBlockingModule"
