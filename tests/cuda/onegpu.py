"""Multi-rank NCCL on ONE GPU, for tests/cuda (issue #13).

NCCL refuses two ranks of one communicator on the same GPU of the same host
("Duplicate GPU detected"). Giving every rank its own ``NCCL_HOSTID`` makes
each look like a host of its own, talking over sockets on loopback
(``NCCL_SOCKET_IFNAME=lo``, no InfiniBand); every rank uses ``cuda:0``
(``LOCAL_RANK=0``). ``SHOAL_HOST_ID`` is shoal's own notion of a host
(topology, hierarchical reduction): ``per_host`` consecutive ranks share one.

Example::

    results = run_nccl(worker, 4, per_host=2)     # 2 pretend hosts of 2 ranks, one GPU
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

from shoal.testing import run_workers

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/cuda: make test-cuda)")


def gpu_env(world: int, per_host: int = 1) -> list[dict[str, str]]:
    """Per rank: the variables that let ``world`` NCCL ranks share GPU 0 (see the module docstring)."""
    return [{"NCCL_HOSTID": f"shoal-test-rank{r}", "SHOAL_HOST_ID": f"host{r // per_host}",
             "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": str(per_host)} for r in range(world)]


def run_nccl(fn: Callable[..., Any], world: int, *args: Any, per_host: int = 1, timeout: float = 240.0,
             op_timeout: float = 120.0) -> list[Any]:
    """``run_workers`` with an NCCL default group, every rank on cuda:0.

    With ``SHOAL_TEST_DEVICE=cpu`` in the environment: gloo and the CPU instead
    (a dry run of the tests' logic without a GPU; the tests still skip unless
    CUDA is present, so call the test functions directly).
    """
    backend = "gloo" if os.environ.get("SHOAL_TEST_DEVICE") == "cpu" else "nccl"
    return run_workers(fn, world, *args, timeout=timeout, op_timeout=op_timeout, backend=backend,
                       rank_env=gpu_env(world, per_host))
