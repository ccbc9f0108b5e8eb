"""run_workers survives the race between free_port() and rank 0 binding the master port.

free_port() returns a port that was free a moment ago; another process (a coordinator's liveness server
binding port 0, another test's store) can take it before rank 0's TCPStore listens on it. Rank 0's
init_process_group then fails with EADDRINUSE. Seen once in a full ``make test``
(test_elastic_topology, static group). No rank has run ``fn`` at that point, so run_workers starts over on
a new port.
"""

from __future__ import annotations

import socket

import pytest
import torch

from shoal.testing import procs
from shoal.testing.procs import WorkerError, run_workers


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.ones(1) * rank
    torch.distributed.all_reduce(t)
    return float(t.item())


def _listening() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.mark.timeout(120)
def test_a_master_port_taken_before_rank_0_binds_it_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    held = _listening()
    given: list[int] = []
    real = procs.free_port

    def first_taken() -> int:
        given.append(held.getsockname()[1] if not given else real())
        return given[-1]

    monkeypatch.setattr(procs, "free_port", first_taken)
    try:
        assert run_workers(_sum_ranks, 2, timeout=90) == [1.0, 1.0]
    finally:
        held.close()
    assert len(given) == 2 and given[0] != given[1]


@pytest.mark.timeout(120)
def test_a_port_taken_on_every_try_is_an_error_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    held = _listening()
    monkeypatch.setattr(procs, "free_port", lambda: held.getsockname()[1])
    try:
        with pytest.raises(WorkerError, match="taken by another process"):
            run_workers(_sum_ranks, 2, timeout=90)
    finally:
        held.close()
