"""OuterSGD: the outer-optimizer factory for DiLoCo (validated settings, the optimizer it builds)."""

from __future__ import annotations

import pytest
import torch

import shoal
from shoal.errors import ConfigError


def test_builds_sgd_with_its_settings_and_one_step_matches_torch():
    p = torch.zeros(3, requires_grad=True)
    opt = shoal.OuterSGD(lr=0.5, momentum=0.5)([p])
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["lr"] == 0.5 and opt.defaults["momentum"] == 0.5 and opt.defaults["nesterov"]
    ref = torch.zeros(3, requires_grad=True)
    ref_opt = torch.optim.SGD([ref], lr=0.5, momentum=0.5, nesterov=True)
    for g in (torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.5, 0.5, 0.5])):
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(p, ref)


def test_lr_one_without_momentum_is_plain_averaging():
    """global - 1.0 * (global - mean(local)) = mean(local)."""
    g = torch.tensor([1.0, 2.0], requires_grad=True)
    g.grad = torch.tensor([1.0, 2.0]) - torch.tensor([0.25, 1.5])   # pseudo-gradient to the mean of the locals
    shoal.OuterSGD(lr=1.0, momentum=0.0, nesterov=False)([g]).step()
    assert torch.equal(g.detach(), torch.tensor([0.25, 1.5]))


@pytest.mark.parametrize("kwargs, match", [({"lr": 0}, "lr"), ({"lr": -1.0}, "lr"), ({"momentum": 1.0}, "momentum"),
                                           ({"momentum": -0.1}, "momentum"),
                                           ({"momentum": 0.0, "nesterov": True}, "Nesterov")])
def test_bad_settings_say_why(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        shoal.OuterSGD(**kwargs)


def test_diloco_accepts_it():
    cfg = shoal.strategies.DiLoCoConfig(inner_steps=10, outer_optimizer=shoal.OuterSGD(1.0, 0.0, False))
    assert cfg.inner_steps == 10
