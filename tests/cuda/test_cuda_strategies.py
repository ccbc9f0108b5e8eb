"""Every strategy through shoal.wrap on NCCL, ranks sharing one GPU (issue #13 item 1: DASO's control tensors)."""

from __future__ import annotations

import pytest

import cuda_workers as W
from onegpu import needs_cuda, run_nccl

pytestmark = needs_cuda


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(set(W.STRATEGIES) - {"hierarchical-4"}))
def test_strategy_on_nccl(name: str) -> None:
    _, _, equal = W.STRATEGIES[name]
    # DASO refuses a host of one worker among several (daso_schedule.check_hosts): its two ranks share one
    # host here; test_strategy_on_two_hosts_of_two_ranks runs it across hosts.
    per_host = 2 if name.startswith("daso") else 1
    for r in run_nccl(W.wrapped, 2, name, per_host=per_host):
        assert r["finite"] == 1.0, r
        if equal:   # the schedule ends on a synchronisation: every rank holds the same parameters
            assert r["spread"] <= 1e-6, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["daso", "daso-skips", "hierarchical-4", "sync"])
def test_strategy_on_two_hosts_of_two_ranks(name: str) -> None:
    for r in run_nccl(W.wrapped, 4, name, per_host=2):
        assert r["finite"] == 1.0 and r["spread"] <= 1e-6, r
