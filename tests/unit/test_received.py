"""What a heal accepts (shoal.membership.received.check_received): non-finite values only where the receiver has them.

A receiver's own copy is the reference: a model's constants (an additive
-inf mask) are non-finite on both sides and pass, a NaN or Inf where the
receiver holds a finite value (parameters, gradients, optimizer state) or
holds nothing yet is refused, for every floating and complex dtype.
"""

from __future__ import annotations

import pytest
import torch

from shoal.membership.received import check_received

INF, NAN = float("inf"), float("nan")


def _mask(n: int = 4) -> torch.Tensor:
    return torch.triu(torch.full((n, n), -INF), 1)


def test_the_same_inf_mask_is_accepted() -> None:
    local = {"module": {"w": torch.zeros(3), "mask": _mask()}}
    assert check_received({"module": {"w": torch.ones(3), "mask": _mask()}}, local) is None


def test_a_finite_value_where_the_receiver_holds_inf_is_accepted() -> None:
    # e.g. a running maximum that starts at -inf and has been updated by the run
    local = {"running_max": torch.full((3,), -INF)}
    assert check_received({"running_max": torch.tensor([1.0, -INF, 2.0])}, local) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.complex64, torch.complex128])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_nonfinite_value_where_the_receiver_is_finite_is_refused(dtype: torch.dtype, bad: float) -> None:
    local = {"module": {"w": torch.zeros(4, dtype=dtype), "mask": _mask()}}
    w = torch.zeros(4, dtype=dtype)
    w[2] = bad
    why = check_received({"module": {"w": w, "mask": _mask()}}, local)
    assert why == "state: holds NaN or Inf in state.module.w where this worker's own copy is finite or absent"


@pytest.mark.parametrize("sent", [NAN, INF])
def test_another_nonfinite_value_than_the_receivers_is_refused(sent: float) -> None:
    mask = _mask()
    mask[0, 3] = sent   # where the receiver holds -inf
    assert check_received({"mask": mask}, {"mask": _mask()}) is not None


def test_a_nonfinite_value_in_state_the_receiver_does_not_hold_is_refused() -> None:
    # optimizer moments before the newcomer's first step: nothing to compare with, so they must be finite
    local = {"opt": {"state": {}}}
    why = check_received({"opt": {"state": {0: {"exp_avg": torch.tensor([1.0, INF])}}}}, local)
    assert why is not None and "state.opt.state.0.exp_avg" in why
