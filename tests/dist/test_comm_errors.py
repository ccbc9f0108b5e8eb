"""A failed or timed-out collective is never silent (issue #14 items 1 and 3).

Two gloo ranks; one of them never takes part in a collective the other
started. The other's :meth:`Handle.future` must fail (the backend's error or
:class:`CommTimeoutError`), never yield its own unreduced data, and a comm
hook built on it (PostLocalSGD's warm-up) must make ``backward`` raise.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shoal
from shoal.comm import Group
from shoal.errors import CommTimeoutError, ConfigError
from shoal.testing import run_workers
from models import Net


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _absent_until_rank0_done() -> str:
    """Rank 1 stays alive (its sockets open) until rank 0 is done; it acknowledges so that rank 0, whose
    process hosts the store, does not exit before the notification reached rank 1."""
    _store().wait(["rank0-done"], datetime.timedelta(seconds=60))
    _store().set("rank1-done", "1")
    return "absent"


def _rank0_done() -> None:
    _store().set("rank0-done", "1")
    _store().wait(["rank1-done"], datetime.timedelta(seconds=60))


def _outcome(fut: torch.futures.Future) -> str:
    try:
        value = fut.wait()
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        return f"raised {type(e).__name__}: {e}"
    return f"completed with {value.tolist()}"


def _peer_absent(rank: int, world: int, mode: str) -> str:
    """Rank 0 all-reduces; rank 1 either waits alive without joining ("hang") or ends ("exit")."""
    group = Group(timeout=1.0)
    group.barrier()
    if rank == 1:
        if mode == "hang":   # alive, but never joins: only the op timeout can end rank 0's wait
            return _absent_until_rank0_done()
        return "absent"      # "exit": run_workers destroys this rank's group, closing its sockets
    fut = group.all_reduce(torch.full((4,), 3.0), op="avg", tag="t").future()
    out = _outcome(fut)
    if mode == "hang":
        _rank0_done()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_future_fails_when_a_peer_never_joins(mode: str) -> None:
    # op_timeout (gloo's own) is long: only Group(timeout=1.0) may end the "hang" case in time.
    out = run_workers(_peer_absent, 2, mode, timeout=50, op_timeout=30)
    assert out[1] == "absent"
    assert out[0].startswith("raised"), out[0]           # not "completed with [1.5, ...]" (3 / 2)
    if mode == "hang":
        assert out[0].startswith(f"raised {CommTimeoutError.__name__}") and "within 1.0 s" in out[0], out[0]


def _future_ok(rank: int, world: int) -> list[float]:
    group = Group(timeout=10.0)
    fut = group.all_reduce(torch.full((3,), float(rank + 1)), op="avg", tag="t").future()
    return fut.wait().tolist()


@pytest.mark.timeout(60)
def test_future_yields_the_mean() -> None:
    assert run_workers(_future_ok, 2, timeout=45) == [[1.5, 1.5, 1.5]] * 2


def _warmup_peer_lost(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # 5 s, not 1 s: the first step's collectives must not time out on a loaded machine (CI); only the
    # second step's, which rank 1 never joins, may.
    ddp, opt = shoal.wrap(model, opt, shoal.PostLocalSGD(period=2, warmup_steps=10),
                          process_group=Group(timeout=5.0))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    F.mse_loss(ddp(x), y).backward()   # one warm-up step together
    opt.step()
    opt.zero_grad()
    if rank == 1:
        return _absent_until_rank0_done()
    try:
        F.mse_loss(ddp(x), y).backward()
        result = "backward returned"
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        result = f"raised {type(e).__name__}: {e}"
    _rank0_done()
    return result


@pytest.mark.timeout(60)
def test_postlocalsgd_warmup_surfaces_a_lost_peer() -> None:
    out = run_workers(_warmup_peer_lost, 2, timeout=50, op_timeout=30)
    assert out[1] == "absent"
    assert out[0].startswith(f"raised {CommTimeoutError.__name__}"), out[0]


def _bad_op_single(rank: int, world: int) -> list[str]:
    group = Group()
    t, out = torch.ones(2), torch.ones(1)
    calls = {
        "all_reduce": lambda: group.all_reduce(t, op="mean"),
        "reduce": lambda: group.reduce(t, op="avg"),
        "reduce_scatter": lambda: group.reduce_scatter(out, t, op="max"),
        "broadcast": lambda: group.broadcast(t, src=1),
        "all_gather_into": lambda: group.all_gather_into(torch.ones(3), t),
        "broadcast_coalesced": lambda: group.broadcast_coalesced([], src=1),
    }
    refused = []
    for name, call in calls.items():
        try:
            call()
        except (ConfigError, ValueError):
            refused.append(name)
    return refused


@pytest.mark.timeout(60)
def test_world_one_validates_before_its_shortcut() -> None:
    assert run_workers(_bad_op_single, 1, timeout=45) == [
        ["all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather_into", "broadcast_coalesced"]]


def _gather_objects(rank: int, world: int) -> list:
    group = Group(timeout=10.0)
    mine = {"rank": rank, "name": "x" * (10 * rank), "shape": (rank, 2)}   # sizes differ by rank
    return group.all_gather_object(mine)


@pytest.mark.timeout(60)
def test_all_gather_object_of_different_sizes() -> None:
    want = [{"rank": r, "name": "x" * (10 * r), "shape": (r, 2)} for r in range(3)]
    assert run_workers(_gather_objects, 3, timeout=45) == [want] * 3
