"""shoal.nonfinite: DDP's non-finite verdict is honoured at each optimizer's own step.

Checked without processes, on the StepVerdict the reducer holds: a verdict
of True drops, right before an optimizer steps, the gradients of exactly the
parameters that optimizer holds (a second optimizer over the same model, say
behind its own GradScaler, must still see its gradients); it lasts until the
next backward; a finite verdict expires at the first step; a parameter added
later with add_param_group is seen.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.nonfinite import StepVerdict, verdict_for


def _model() -> tuple[nn.Linear, nn.Linear]:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    for p in (*a.parameters(), *b.parameters()):
        p.grad = torch.full_like(p, float("inf"))
    return a, b


def test_a_nonfinite_verdict_drops_only_the_stepping_optimizers_gradients() -> None:
    a, b = _model()
    before_a = [p.detach().clone() for p in a.parameters()]
    verdict = StepVerdict([*a.parameters(), *b.parameters()])
    verdict.set(nonfinite=True)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    opt_a.step()
    assert all(p.grad is None for p in a.parameters())
    assert all(p.grad is not None for p in b.parameters()), "opt_b's gradients were dropped by opt_a's step"
    assert all(torch.equal(x, p) for x, p in zip(before_a, a.parameters()))
    opt_b.step()      # the verdict lasts until the next backward: opt_b skips too
    assert all(p.grad is None for p in b.parameters())
    assert verdict_for(list(a.parameters())) is True
    verdict.expire()  # what the next backward does


def test_a_finite_verdict_expires_and_later_param_groups_are_seen() -> None:
    a, b = _model()
    verdict = StepVerdict([*a.parameters(), *b.parameters()])
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    verdict.set(nonfinite=False)
    assert verdict_for(list(b.parameters())) is False
    for p in a.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert verdict.value is None
    other = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    verdict.set(nonfinite=True)
    other.step()                                # holds none of the model's parameters: nothing dropped
    assert all(p.grad is not None for p in b.parameters())
    other.add_param_group({"params": list(b.parameters())})
    other.step()                                # now it does: b's gradients are dropped
    assert all(p.grad is None for p in b.parameters())
    verdict.expire()
