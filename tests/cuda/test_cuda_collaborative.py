"""CollaborativeOptimizer with the model on the GPU (issue #13 item 4), in every mode.

Two peers run as threads of one worker process (so CUDA starts there, not in
pytest's process), around an in-process coordinator; their averaging groups
are gloo on the CPU, their parameters and accumulators on cuda:0.
"""

from __future__ import annotations

import pytest
import torch

import cuda_workers as W
from collab_peers import raise_errors
from onegpu import needs_cuda
from shoal.testing import run_workers

pytestmark = needs_cuda


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["plain", "offload", "delayed"])
def test_collaborative_on_cuda(mode: str) -> None:
    [peers] = run_workers(W.collaborative_worker, 1, mode, init_group=False, timeout=220)
    raise_errors(peers)
    for p in peers:
        assert p["device"] == W.DEV.type and p["epoch"] >= 3, p
        assert "averaged" in p["outcomes"], p
    # Every round averaged by both peers together (none alone, none loading state).
    in_step = all(set(zip(p["outcomes"], p["peers"])) == {("averaged", 2)} for p in peers)
    if mode != "delayed" and in_step:   # same start, same averaged gradients, same optimizer: same parameters
        for a, b in zip(peers[0]["params"], peers[1]["params"]):
            assert torch.allclose(a, b, atol=1e-6), (mode, (a - b).abs().max())
