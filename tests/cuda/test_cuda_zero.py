"""ZeroRedundancyOptimizer overlapped with DDP on NCCL against torch DDP + Adam (issue #13 item 3).

The overlapped step runs on the reducer's bucket-done thread (its own CUDA
stream, ordered by events); with two ranks per pretend host DDP reduces
hierarchically, over subgroups whose NCCL communicators must be created in
the same order on every rank (creation from a background thread hung).
"""

from __future__ import annotations

import pytest

import cuda_workers as W
from onegpu import needs_cuda, run_nccl

pytestmark = needs_cuda


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,per_host", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_overlapped_zero_matches_torch_adam(world: int, per_host: int) -> None:
    for r in run_nccl(W.zero_vs_torch_adam, world, True, per_host=per_host, timeout=280):
        assert r["moved"] > 1e-3, r
        assert r["hierarchical"] == float(1 < per_host < world), r   # two-level only with several hosts
        assert r["spread"] == 0.0, r
        assert r["diff"] <= 1e-6, r


@pytest.mark.timeout(300)
def test_plain_zero_matches_torch_adam() -> None:
    for r in run_nccl(W.zero_vs_torch_adam, 2, False):
        assert r["moved"] > 1e-3 and r["spread"] == 0.0 and r["diff"] <= 1e-6, r
