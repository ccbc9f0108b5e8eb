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


def _deferred(params: list[torch.Tensor], bad: bool) -> tuple[StepVerdict, list[int]]:
    """A verdict handed over unread, as DDP does; ``warned`` counts the on_bad calls (warn + count)."""
    warned: list[int] = []
    verdict = StepVerdict(params)
    verdict.defer(torch.tensor(2.0 if bad else 0.0), lambda: warned.append(1))
    return verdict, warned


def test_a_deferred_verdict_is_lent_to_a_fused_adamw_as_found_inf_and_taken_back() -> None:
    a, _ = _model()
    before = [p.detach().clone() for p in a.parameters()]
    opt = torch.optim.AdamW(a.parameters(), lr=0.1, fused=True)
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.found_inf.clone()))   # runs after shoal's global hook
    verdict, warned = _deferred(list(a.parameters()), bad=True)
    opt.step()
    assert [float(t) for t in seen] == [1.0], "the fused optimizer did not get the verdict as found_inf == 1"
    assert not hasattr(opt, "found_inf"), "found_inf was not taken back after the step"
    assert all(torch.equal(x, p) for x, p in zip(before, a.parameters())), "the skipped step moved the parameters"
    assert all(float(s["step"]) == 0.0 for s in opt.state.values()), "the skipped step was counted"
    assert verdict.pending and not warned, "the verdict was read on the host before the step"
    verdict.expire()                                  # the next backward reads it: warn and count once
    assert warned == [1] and not verdict.pending


def test_fused_sgd_before_its_momentum_exists_and_other_optimizers_read_the_verdict() -> None:
    # Fused SGD's first step creates the momentum buffers from the gradient even when found_inf skips
    # it, so there the verdict is read on the host and the gradients dropped, as for any optimizer.
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
                 lambda ps: torch.optim.Adam(ps, lr=0.1),                            # not fused
                 lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps, lr=0.1, fused=True)):   # a subclass
        a, _ = _model()
        opt = make(a.parameters())
        verdict, warned = _deferred(list(a.parameters()), bad=True)
        opt.step()
        assert all(p.grad is None for p in a.parameters()), f"{type(opt).__name__}: gradients not dropped"
        assert warned == [1] and not verdict.pending and not hasattr(opt, "found_inf")
        verdict.expire()


def test_a_found_inf_set_by_a_grad_scaler_is_left_alone_and_a_failed_step_leaves_none_of_ours() -> None:
    a, _ = _model()
    opt = torch.optim.AdamW(a.parameters(), lr=0.1, fused=True)
    theirs = torch.zeros(())
    opt.found_inf = theirs                              # what GradScaler.step does for a fused optimizer
    verdict, warned = _deferred(list(a.parameters()), bad=False)
    opt.step()
    assert opt.found_inf is theirs and not verdict.pending and warned == []
    del opt.found_inf
    verdict.expire()
    b = nn.Linear(2, 2)
    broken = torch.optim.AdamW(b.parameters(), lr=0.1, fused=True)
    verdict, _ = _deferred(list(b.parameters()), bad=True)
    broken.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("user hook failed")))
    try:
        broken.step()
    except RuntimeError:
        pass
    assert getattr(broken, "found_inf", None) is not None      # lent, and the step never finished
    broken._optimizer_step_pre_hooks.clear()
    verdict.expire()
    for p in b.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in b.parameters()]
    broken.step()              # no verdict now: the stale loan (a skip) is taken back first, so this step moves
    assert not hasattr(broken, "found_inf")
    assert not any(torch.equal(x, p) for x, p in zip(before, b.parameters())), "a stale found_inf skipped a step"


def test_a_deferred_verdict_of_a_step_that_failed_since_is_no_verdict() -> None:
    # An elastic step whose collective failed after backward is discarded by its vote; the flag was
    # computed from what the failed collective left in the buffers and must not warn, count or drop.
    a, _ = _model()
    failed = [False]
    warned: list[int] = []
    verdict = StepVerdict(list(a.parameters()))
    verdict.defer(torch.tensor(1.0), lambda: warned.append(1), void=lambda: failed[0])
    failed[0] = True
    assert verdict.resolve() is False and warned == []
    verdict.expire()


def test_a_fused_optimizer_that_also_steps_other_parameters_is_not_lent_the_verdict() -> None:
    # found_inf skips the optimizer's whole step; the verdict covers only the model's parameters, so an
    # extra parameter must still train: the gradients of the model are dropped instead, as for any optimizer.
    a, _ = _model()
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    opt = torch.optim.AdamW([*a.parameters(), extra], lr=0.1, fused=True)
    verdict, warned = _deferred(list(a.parameters()), bad=True)
    opt.step()
    assert not torch.equal(extra.detach(), torch.ones(3)), "the extra parameter did not step"
    assert all(p.grad is None for p in a.parameters()) and warned == [1]
    verdict.expire()


def test_taking_back_a_stale_loan_leaves_a_grad_scalers_found_inf_alone() -> None:
    a, _ = _model()
    opt = torch.optim.AdamW(a.parameters(), lr=0.1, fused=True)
    verdict, _ = _deferred(list(a.parameters()), bad=False)
    opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("user hook failed")))
    try:
        opt.step()                                   # lent, and the step never finished
    except RuntimeError:
        pass
    opt._optimizer_step_pre_hooks.clear()
    verdict.expire()
    theirs = torch.zeros(())
    opt.found_inf = theirs                           # GradScaler.step sets its own, then steps
    opt.step()
    assert getattr(opt, "found_inf", None) is theirs, "GradScaler's found_inf was taken as ours"
    del opt.found_inf
