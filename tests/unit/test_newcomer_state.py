"""A newcomer copies a peer's shared codec state but starts with zero error feedback of its own."""

from __future__ import annotations

import torch

from shoal import codecs


def test_powersgd_newcomer_keeps_q_and_zeroes_residual() -> None:
    c = codecs.PowerSGD(rank=2)
    c.q = {"w": torch.randn(4, 2)}
    c.errors = {"w": torch.randn(8, 4)}
    state = c.newcomer_state(c.state_dict())
    assert torch.equal(state["q"]["w"], c.q["w"])
    assert torch.count_nonzero(state["errors"]["w"]) == 0 and state["errors"]["w"].shape == (8, 4)
    assert torch.count_nonzero(c.errors["w"]) > 0       # the peer's own state is untouched
    fresh = codecs.PowerSGD(rank=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.q["w"], c.q["w"]) and torch.count_nonzero(fresh.errors["w"]) == 0


def test_error_feedback_newcomer_zeroes_residuals_and_recurses() -> None:
    c = codecs.ErrorFeedback(codecs.Cast())
    c.residuals = {"w": torch.ones(3)}
    state = c.newcomer_state(c.state_dict())
    assert torch.count_nonzero(state["residuals"]["w"]) == 0
    assert state["inner"] == c.codec.newcomer_state(c.codec.state_dict())
    assert torch.count_nonzero(c.residuals["w"]) == 3


def test_two_level_codec_forwards_newcomer_and_rollback_state_to_its_inner_codec() -> None:
    from shoal.codecs.hierarchical import Hierarchical
    c = Hierarchical(codecs.PowerSGD(rank=2))
    c.inner.q["w"] = torch.randn(4, 2)
    c.inner.errors["w"] = torch.randn(8, 4)
    state = c.newcomer_state(c.state_dict())
    assert torch.equal(state["inner"]["q"]["w"], c.inner.q["w"])
    assert torch.count_nonzero(state["inner"]["errors"]["w"]) == 0
    snap = c.rollback_state()
    assert snap["inner"]["errors"]["w"] is c.inner.errors["w"]   # by reference, as PowerSGD's own
    fresh = Hierarchical(codecs.PowerSGD(rank=2))
    fresh.load_state_dict(state)
    assert torch.count_nonzero(fresh.inner.errors["w"]) == 0 and torch.equal(fresh.inner.q["w"], c.inner.q["w"])
