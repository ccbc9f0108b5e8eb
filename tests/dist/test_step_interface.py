"""The step interface on a static group (2 real gloo ranks): trivial steps, one state registry, subgroups by rule."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from shoal.comm import Group, HostGroups
from shoal.comm.rules import by_host, host_leaders
from shoal.comm.stepping import NotAMemberError
from shoal.errors import ConfigError, ShoalError
from shoal.testing import run_workers


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return type(e).__name__, str(e)
    return None


def _steps(group: Group) -> dict[str, Any]:
    calls: list[str] = []
    group.before_begin_step(lambda: calls.append("begin"))
    group.on_commit(lambda: calls.append("commit"))
    verdicts, sums = [], []
    for step in range(2):
        group.begin_step()
        t = torch.tensor([float(group.rank + 1 + step)])
        group.all_reduce(t, op="sum", tag="step").wait()
        sums.append(t.item())
        verdicts.append(group.commit())
    group.register_state("counter", lambda: 1, lambda _: None)
    return {"calls": calls, "verdicts": verdicts, "sums": sums, "newcomers": group.newcomers,
            "pending": group.quorum_pending, "elastic": group.elastic, "member": group.member,
            "duplicate": _error(lambda: group.register_state("counter", lambda: 2, lambda _: None)),
            "traits": group.traits, "error": group.error,
            "report": _error(lambda: group.report_error(ShoalError("found outside shoal"))),
            "start": _start_state(group)}


def _start_state(group: Group) -> tuple[list[float], bool]:
    """start_state on a static group: every rank ends with rank 0's parameters and buffers."""
    net = torch.nn.BatchNorm1d(2)
    with torch.no_grad():
        net.weight.fill_(float(group.rank + 1))
        net.running_mean.fill_(float(10 * (group.rank + 1)))
    group.start_state(net, tag="test/init")
    return net.weight.tolist() + net.running_mean.tolist(), group.error is None


def _rules(group: Group) -> dict[str, Any]:
    """This rank's subgroups by host and of host leaders, and a sum over each it belongs to."""
    host = group.subgroup(by_host, "host")
    leaders = group.subgroup(host_leaders, "leaders")
    out: dict[str, Any] = {"host": (host.size, host.rank), "leader": leaders.member}
    t = torch.tensor([float(group.rank + 1)])
    host.all_reduce(t, op="sum", tag="host").wait()
    out["host_sum"] = t.item()
    if leaders.member:
        out["leaders"] = (leaders.size, leaders.rank)
        u = torch.tensor([float(group.rank + 1)])
        leaders.all_reduce(u, op="sum", tag="leaders").wait()
        out["leaders_sum"] = u.item()
    else:
        out["outside"] = _error(lambda: leaders.all_reduce(torch.ones(1), tag="leaders"))
    return out


def _summary(levels: HostGroups) -> tuple[Any, ...]:
    leaders = levels.leaders
    return (levels.topology, levels.local.size, levels.local.rank,
            None if leaders is None else (leaders.size, leaders.rank))


def _work(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": _steps(Group())}
    os.environ["SHOAL_HOST_ID"] = f"host-{rank}"        # one host per rank
    out["apart"] = _rules(Group())
    os.environ["SHOAL_HOST_ID"] = "host-shared"         # both ranks on one host
    shared = Group()
    out["together"] = _rules(shared)
    out["taken"] = shared.unique_name("host")           # subgroup names are unique per group
    levels = shared.host_groups("levels")
    built = HostGroups.build(shared)
    out["levels"] = (_summary(levels.current()), _summary(built))
    out["levels_parent"] = levels.current().parent is shared and levels.current() is levels.current()
    return out


@pytest.mark.timeout(90)
def test_static_step_interface_on_two_gloo_ranks() -> None:
    out = run_workers(_work, 2, timeout=75)
    for rank, r in enumerate(out):
        s = r["steps"]
        # begin_step runs the before-begin hooks, commit is True and runs the on-commit hooks.
        assert s["calls"] == ["begin", "commit", "begin", "commit"], s
        assert s["verdicts"] == [True, True] and s["sums"] == [3.0, 5.0], s
        assert s["newcomers"] == () and s["pending"] is False and s["elastic"] is False and s["member"] is True
        assert s["duplicate"] is not None and s["duplicate"][0] == ConfigError.__name__, s
        assert "'counter' is already registered" in s["duplicate"][1], s
        # The rest of the interface: no failure recorded, a reported one raises at once, start_state broadcasts.
        assert s["traits"].members_change is False and s["traits"].work_in_flight is True, s
        assert s["error"] is None and s["report"] == (ShoalError.__name__, "found outside shoal"), s
        assert s["start"] == ([1.0, 1.0, 10.0, 10.0], True), s

        # One host per rank: each rank is its own host and its host's leader.
        a = r["apart"]
        assert a["host"] == (1, 0) and a["host_sum"] == rank + 1, a
        assert a["leader"] is True and a["leaders"] == (2, rank) and a["leaders_sum"] == 3.0, a

        # Both on one host: the host is the whole group, rank 0 leads it alone.
        b = r["together"]
        assert b["host"] == (2, rank) and b["host_sum"] == 3.0, b
        assert b["leader"] is (rank == 0), b
        if rank == 0:
            assert b["leaders"] == (1, 0) and b["leaders_sum"] == 1.0, b
        else:
            kind, text = b["outside"]
            # a ShoalError (and an AttributeError, so that getattr(x, name, default) falls back)
            assert issubclass(NotAMemberError, ShoalError) and issubclass(NotAMemberError, AttributeError)
            assert kind == NotAMemberError.__name__ and "not a member of subgroup 'leaders'" in text, text
            assert "check .member" in text, text
        assert r["taken"] == "host-2", r["taken"]

        # host_groups(...).current() is what HostGroups.build makes of the same group.
        mine, built = r["levels"]
        assert mine == built, (mine, built)
        assert mine[0].hosts == ((0, 1),) and mine[1:] == (2, rank, (1, 0) if rank == 0 else None), mine
        assert r["levels_parent"] is True


def _two_users(rank: int, world: int) -> dict[str, Any]:
    """Review findings: two strategies' state on one static group, and ElasticSampler on a static group
    whose steps nobody votes (plain DDP and a torch optimizer)."""
    import copy

    import shoal
    from shoal.comm.stepping import Outside
    from shoal.elastic import ElasticOptimizer, ElasticSampler

    torch.manual_seed(0)
    group = Group()
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    wrapped = [shoal.NonBlocking().wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), group) for m in models]
    opts = [ElasticOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), group) for m in models]
    sampler = ElasticSampler(100, group, batch_size=2, shuffle=False)
    batches = [sampler.next_batch() for _ in range(3)]   # no commit() between them: static steps commit anyway
    outside = Outside("leaders")
    return {"wrapped": len(wrapped), "optimizers": len(opts), "batches": batches,
            "outside": (getattr(outside, "error", None), hasattr(outside, "rank"), copy.copy(outside).member)}


@pytest.mark.timeout(90)
def test_two_strategies_share_a_static_group_and_the_sampler_advances_unvoted() -> None:
    for rank, res in enumerate(run_workers(_two_users, 2, timeout=60)):
        assert res["wrapped"] == 2 and res["optimizers"] == 2
        assert res["batches"] == [[rank * 2 + i + 4 * s for i in range(2)] for s in range(3)], res["batches"]
        assert res["outside"] == (None, False, False)
