"""Strategies that cannot run on an ElasticGroup say so at set-up, before any collective.

One process: the group is connected to a coordinator in this process but never
joins a quorum, so a strategy that got past its check would wait for one and
fail with the short join timeout below instead of raising ConfigError.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import shoal
from shoal.elastic import Coordinator, ElasticGroup, Timeouts
from shoal.errors import ConfigError

# Generous connect/quorum limits: the checks raise before any quorum is awaited, and torch's
# TCPStore sometimes takes seconds to accept a connection when many clients are open.
_FAST = Timeouts(op=1.0, heartbeat_interval=0.05, probe=0.2, heartbeat_timeout=0.5, quorum=15.0, join=20.0)

TOKEN = "config-test-token"


@pytest.fixture(scope="module")
def coord() -> Iterator[Coordinator]:
    # A store server only: nobody publishes quorums. One per module: setting one up after another
    # was torn down sometimes took 5 s here.
    c = Coordinator(port=0, token=TOKEN)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def group(coord: Coordinator) -> Iterator[ElasticGroup]:
    g = ElasticGroup(f"config-test-{uuid.uuid4().hex[:8]}", coordinator=coord.address, timeouts=_FAST,
                     min_workers=1, token=TOKEN)
    try:
        yield g
    finally:
        g.leave()


def _setup(strategy: shoal.Strategy, group: ElasticGroup) -> Any:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in net.parameters()]
    try:
        return shoal.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy, process_group=group)
    finally:  # refused or not, set-up must not have touched the model
        assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))


@pytest.mark.timeout(30)
def test_hierarchical_needs_the_launch_rank(group: ElasticGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its levels are groups of launch slots (RANK, stable across restarts): without one it cannot place a worker.
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"by its launch RANK.*RANK is ''"):
        _setup(shoal.Hierarchical({2: 1, 4: 2}), group)


@pytest.mark.timeout(30)
def test_hierarchical_map_is_checked_against_the_launched_world(group: ElasticGroup,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"last group size .* is 2 but the process group has 3 ranks"):
        _setup(shoal.Hierarchical({2: 1, 4: 2}), group)


@pytest.mark.timeout(30)
def test_post_local_sgd_local_groups_need_the_launch_rank(group: ElasticGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    # Supported on an elastic group (tests/faults/test_strategy_faults.py); its groups are launch slots.
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"PostLocalSGD with local_group_size on an ElasticGroup .* launch RANK"):
        _setup(shoal.PostLocalSGD(period=4, warmup_steps=2, local_group_size=1), group)


@pytest.mark.timeout(30)
def test_post_local_sgd_map_needs_the_launch_rank(group: ElasticGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"PostLocalSGD on an ElasticGroup .* by its launch RANK"):
        _setup(shoal.PostLocalSGD(period={2: 1, 8: 2}, warmup_steps=2), group)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", [lambda: shoal.Hierarchical({2: 1, 4: 2}),
                                      lambda: shoal.PostLocalSGD(period=4, warmup_steps=2, local_group_size=2)],
                         ids=["hierarchical", "postlocalsgd-local-groups"])
def test_slot_groups_are_refused_in_an_elastic_run_across_machines(group: ElasticGroup, strategy: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # `shoal run --elastic --nnodes 2` labels workers RANK = i * nnodes + node_rank: groups of consecutive
    # RANKs would span machines (the launcher says so in SHOAL_SLOTS_INTERLEAVED), so they are refused.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SHOAL_SLOTS_INTERLEAVED", "2")
    with pytest.raises(ConfigError, match=r"spans 2 machines.*would mix machines"):
        _setup(strategy(), group)


@pytest.mark.timeout(30)
def test_nonblocking_hierarchical_on_an_elastic_group_builds_without_a_collective(group: ElasticGroup) -> None:
    # The host and leader subgroups follow each quorum (group.host_groups): nothing is awaited here.
    from shoal.codecs.hierarchical import Hierarchical

    strategy = shoal.NonBlocking(hierarchical=True)
    model, _ = _setup(strategy, group)
    assert isinstance(model._exchange.codec, Hierarchical)


@pytest.mark.timeout(30)
def test_nonblocking_fallback_to_blocking_on_an_elastic_group_builds_without_a_collective(group: ElasticGroup) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opts = [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[2].parameters(), lr=0.1)]
    with pytest.warns(UserWarning, match=r"falls back to blocking.*2 optimizers"):
        model, got = shoal.NonBlocking().wrap(net, opts, process_group=group)
    assert isinstance(model, shoal.DistributedDataParallel) and got is opts


@pytest.mark.timeout(30)
def test_zero_overlapped_with_ddp_on_an_elastic_group_attaches_without_a_collective(group: ElasticGroup) -> None:
    # The broadcast subgroup is a rule applied per quorum and the layout waits for the first bucket:
    # attaching awaits nothing (a collective here would wait for a quorum that never forms).
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
    model = shoal.DistributedDataParallel(net, process_group=group, optimizer=zero, bucket_cap_mb=0.0001)
    assert zero._shards is not None and zero._overlap is not None
    assert model.reducer.on_bucket_reduced == zero._overlap.on_bucket
    assert not zero._overlap.pending


@pytest.mark.timeout(30)
def test_zero_overlapped_with_ddp_on_another_group_is_refused(group: ElasticGroup) -> None:
    coord = Coordinator(port=0, token=TOKEN)
    other = ElasticGroup("config-test-2", coordinator=coord.address, timeouts=_FAST, min_workers=1, token=TOKEN)
    try:
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
        with pytest.raises(ConfigError, match=r"must use the same ElasticGroup"):
            shoal.DistributedDataParallel(net, process_group=other, optimizer=zero)
        assert zero._buckets is None and zero._shards is not None and zero._overlap is None
    finally:
        other.leave()
        coord.stop()


def test_zero_replicate_needs_an_elastic_group() -> None:
    net = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"replicate=True .* needs an ElasticGroup"):
        shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, replicate=True, lr=0.1)
    with pytest.raises(ConfigError, match=r"replicate must be True or False"):
        shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, replicate=1, lr=0.1)


@pytest.mark.timeout(30)
def test_zero_step_closure_is_refused_on_an_elastic_group(group: ElasticGroup) -> None:
    net = nn.Linear(4, 2)
    zero = shoal.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
    with pytest.raises(ConfigError, match=r"step\(closure\) is not supported on an elastic group"):
        zero.step(lambda: 0.0)


def test_ddp_hierarchical_on_an_elastic_group_builds_without_a_collective(group: ElasticGroup) -> None:
    # The host and leader subgroups are rules applied per quorum: nothing is awaited here
    # (a collective would wait for a quorum that never forms and fail on the join timeout).
    from shoal.codecs.hierarchical import Hierarchical

    model = shoal.DistributedDataParallel(nn.Linear(4, 2), process_group=group, hierarchical=True)
    assert isinstance(model.reducer.codec, Hierarchical) and model.topology is None


def test_ddp_automatic_choice_on_an_elastic_group_waits_for_the_quorum(group: ElasticGroup) -> None:
    auto = shoal.DistributedDataParallel(nn.Linear(4, 2), process_group=group)   # hierarchical=None
    assert auto.reducer.codec is None and auto.topology is None      # chosen in forward, per quorum
    assert auto._per_quorum is not None and auto._per_quorum.automatic


def test_ddp_hierarchical_refusals_on_elastic_groups_say_why(group: ElasticGroup) -> None:
    from shoal.codecs.hierarchical import Hierarchical
    from shoal.membership.views import ElasticSubgroup, by_host

    host = ElasticSubgroup(group, "test/host", by_host)
    with pytest.raises(ConfigError, match=r"needs a whole elastic group.*cannot be split again"):
        shoal.DistributedDataParallel(nn.Linear(4, 2), process_group=host, hierarchical=True)
    with pytest.raises(ConfigError, match=r"Hierarchical codec but hierarchical=False"):
        shoal.DistributedDataParallel(nn.Linear(4, 2), process_group=group, codec=Hierarchical(),
                                      hierarchical=False)
    with pytest.raises(ConfigError, match=r"hierarchical must be True, False or None"):
        shoal.DistributedDataParallel(nn.Linear(4, 2), process_group=group, hierarchical="yes")  # type: ignore[arg-type]
