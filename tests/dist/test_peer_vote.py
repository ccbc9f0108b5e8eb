"""The commit vote without the coordinator (shoal.membership.vote.peer_vote), on 3 gloo processes.

Every member reads rank 0's one decision: commit with the newest quorum id
anyone knows when all voted; discard everywhere when a member that saw a
failure stays out; and votes of two different steps never match (their p2p
tags carry the step), so a member a step behind discards instead of
counting as a voter of the other step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shoal.membership.vote import peer_vote
from shoal.testing import run_workers


def _worker(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    pg: Any = dist.distributed_c10d._get_default_group()
    cpu = torch.device("cpu")
    out = [peer_vote(pg, rank, world, 3, latest=[4, 6, 5][rank], device=cpu, timeout=10.0)]
    step = 9 if rank == 1 else 10   # rank 1 is a step behind: its vote must not count for step 10
    out.append(peer_vote(pg, rank, world, step, latest=6, device=cpu, timeout=1.5))
    if rank == 2:          # saw a failure in step 20: votes discard alone and sends nothing
        out.append("discard")
        time.sleep(3.0)
    else:
        out.append(peer_vote(pg, rank, world, 20, latest=6, device=cpu, timeout=1.5))
    return out


@pytest.mark.timeout(120)
def test_peer_vote_one_decision_and_a_missing_or_stale_voter_discards_everywhere() -> None:
    res = run_workers(_worker, 3, timeout=90, op_timeout=20)
    assert [r[0] for r in res] == ["commit:6"] * 3
    assert [r[1] for r in res] == ["discard"] * 3
    assert [r[2] for r in res] == ["discard"] * 3
