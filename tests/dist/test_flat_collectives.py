"""The flat-tensor collectives use torch's current names: no FutureWarning at every step.

torch 2.13 deprecated ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
(FutureWarning on each call, printed by every worker of every run that shards
or gathers). :class:`~shoal.comm.Group` calls the new names where torch has
them, and the results stay right.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from shoal.comm import Group
from shoal.testing import run_workers


def _gather_and_scatter(rank: int, world: int) -> tuple[list[float], list[float], list[str]]:
    group = Group()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = torch.full((2,), float(group.rank + 1))
        gathered = torch.empty(2 * group.size)
        group.all_gather_into(gathered, mine).wait()
        full = torch.arange(2.0 * group.size) * (group.rank + 1)
        out = torch.empty(2)
        group.reduce_scatter(out, full).wait()
    return gathered.tolist(), out.tolist(), [str(w.message) for w in caught if w.category is FutureWarning]


@pytest.mark.timeout(120)
def test_gather_and_reduce_scatter_are_right_and_do_not_warn() -> None:
    results = run_workers(_gather_and_scatter, 2, timeout=100)
    for rank, (gathered, out, warned) in enumerate(results):
        assert gathered == [1.0, 1.0, 2.0, 2.0]
        assert out == [(2 * rank) * 3.0, (2 * rank + 1) * 3.0]   # sum over ranks of chunk * (rank + 1)
        assert warned == [], warned
