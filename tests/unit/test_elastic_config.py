"""Elastic configuration, checked at start-up in one process."""

from __future__ import annotations

import pytest

from shoal.elastic import FailurePolicy, Timeouts, run_round, shard
from shoal.errors import ConfigError
from shoal.testing import Fault, FaultPlan
from shoal.testing.faults import FaultyBackend


def test_default_timeouts_are_a_valid_hierarchy() -> None:
    t = Timeouts()
    assert t.heartbeat_interval < t.probe <= t.heartbeat_timeout < t.quorum and t.op < t.quorum < t.join


@pytest.mark.parametrize("kwargs, first, second", [
    ({"op": 40.0, "quorum": 30.0}, "Timeouts.op (40.0 s)", "Timeouts.quorum (30.0 s)"),
    ({"quorum": 300.0, "join": 300.0}, "Timeouts.quorum (300.0 s)", "Timeouts.join (300.0 s)"),
    ({"heartbeat_interval": 1.0, "probe": 0.5}, "Timeouts.heartbeat_interval (1.0 s)", "Timeouts.probe (0.5 s)"),
    ({"heartbeat_timeout": 0.2}, "Timeouts.probe (0.5 s)", "Timeouts.heartbeat_timeout (0.2 s)"),
])
def test_invalid_hierarchy_names_both_values(kwargs: dict[str, float], first: str, second: str) -> None:
    with pytest.raises(ConfigError) as e:
        Timeouts(**kwargs)
    assert first in str(e.value) and second in str(e.value)


def test_nonpositive_timeout_is_rejected() -> None:
    with pytest.raises(ConfigError, match="Timeouts.op"):
        Timeouts(op=0)


def test_fault_plan_round_trips_and_validates() -> None:
    plan = FaultPlan().fail(rank=1, step=3).delay(rank=0, step=5, seconds=2.5, nth=1).crash(rank=2, step=7)
    assert FaultPlan.from_json(plan.to_json()).faults == plan.faults
    with pytest.raises(ConfigError, match="kind"):
        Fault("explode", 0, 1)
    with pytest.raises(ConfigError, match="seconds"):
        FaultPlan().delay(rank=0, step=1, seconds=0)
    with pytest.raises(ConfigError, match="Fault.op"):
        FaultPlan().crash(rank=0, step=1, op="bcast")
    assert FaultPlan.from_json(FaultPlan().crash(rank=2, step=4, nth=1, op="broadcast").to_json()).faults[0].op == \
        "broadcast"


def test_fault_op_counts_only_its_kind_of_collective() -> None:
    class Inner:
        def allreduce(self, tensors: object, opts: object) -> str:
            return "work"

        def broadcast(self, tensors: object, opts: object) -> str:
            return "work"

    plan = FaultPlan().fail(rank=0, step=0, nth=1, op="broadcast")
    backend = FaultyBackend(Inner(), list(plan.faults), lambda: 0, set())
    assert backend.allreduce([], None) == "work"     # collective #0
    assert backend.broadcast([], None) == "work"     # #1, broadcast #0
    assert backend.allreduce([], None) == "work"     # #2
    with pytest.raises(RuntimeError, match="broadcast #1 among broadcasts of step 0"):
        backend.broadcast([], None)                  # #3, broadcast #1


def test_shard_follows_rank_and_size() -> None:
    class G:
        rank, size = 2, 4

    assert list(shard(10, G())) == [2, 6]


class _FakeGroup:
    """Records the calls run_round makes (the step interface); commit answers from a script."""

    def __init__(self, verdicts: list[bool]) -> None:
        self.verdicts, self.calls = verdicts, []

    def begin_step(self) -> None:
        self.calls.append("start")

    def refuse_background_heal(self, why: str, when: object = None) -> None:
        self.calls.append("refuse")

    def commit(self) -> bool:
        self.calls.append("vote")
        return self.verdicts.pop(0)


def test_run_round_policies() -> None:
    g = _FakeGroup([False, True])
    assert run_round(g, lambda: g.calls.append("fn"), FailurePolicy.AVERAGE_SURVIVORS)  # type: ignore[arg-type]
    assert g.calls == ["refuse", "start", "fn", "vote", "start", "fn", "vote"]
    g = _FakeGroup([False, True])
    assert not run_round(g, lambda: None, FailurePolicy.DISCARD)  # type: ignore[arg-type]
    assert g.calls == ["refuse", "start", "vote"]
