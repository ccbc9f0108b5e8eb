"""The state cache's host copy on CUDA (shoal.membership.stateserve.host_copy): taken without a host sync, it
holds the values of the moment it was issued once its event completed, however the training stream changes
the originals afterwards, and it takes no device memory."""

from __future__ import annotations

import torch

from onegpu import needs_cuda

pytestmark = needs_cuda


def test_the_host_copy_holds_the_values_it_was_taken_at() -> None:
    from shoal.membership.stateserve import host_copy

    dev = torch.device("cuda", 0)
    state = {0: {"exp_avg": torch.randn(4096, 1024, device=dev), "step": torch.tensor(3.0)},
             1: {"exp_avg_sq": torch.rand(2048, 512, device=dev)}}
    before = {i: {k: v.detach().cpu().clone() for k, v in st.items()} for i, st in state.items()}
    used = torch.cuda.memory_allocated(dev)
    copy, ready = host_copy(state)
    assert ready is not None and torch.cuda.memory_allocated(dev) == used   # nothing cloned on the GPU
    for _ in range(20):   # the training stream moves on, in place, before anyone waits for the copy
        state[0]["exp_avg"].mul_(3.0).add_(1.0)
        state[1]["exp_avg_sq"].add_(5.0)
    ready.synchronize()
    for i, st in copy.items():
        for k, v in st.items():
            assert v.device.type == "cpu" and torch.equal(v, before[i][k]), (i, k)
    assert copy[0]["step"] is not state[0]["step"]   # a CPU tensor is cloned, not shared
