"""ZeroRedundancyOptimizer: input validation and partitioning, on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shoal
from shoal.errors import ConfigError
from shoal.optim.zero import assign_bucket_owners, partition_by_size


def _params() -> list[nn.Parameter]:
    return list(nn.Linear(4, 2).parameters())


@pytest.mark.parametrize("bad", [torch.optim.SGD(_params(), lr=0.1), "adam", torch.nn.Linear, None, 3])
def test_optimizer_class_must_be_an_optimizer_class(bad: object) -> None:
    with pytest.raises(ConfigError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        shoal.ZeroRedundancyOptimizer(_params(), bad, lr=0.1)  # type: ignore[arg-type]


def test_optimizer_class_cannot_be_zero_itself() -> None:
    with pytest.raises(ConfigError, match="cannot be ZeroRedundancyOptimizer"):
        shoal.ZeroRedundancyOptimizer(_params(), shoal.ZeroRedundancyOptimizer, lr=0.1)


@pytest.mark.parametrize("params", [[], iter([]), [{"params": []}, {"params": []}]])
def test_no_parameters(params: object) -> None:
    with pytest.raises(ConfigError, match="empty"):
        shoal.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)


def test_params_must_be_tensors_in_an_iterable() -> None:
    with pytest.raises(ConfigError, match="iterable of tensors"):
        shoal.ZeroRedundancyOptimizer(torch.zeros(3, requires_grad=True), torch.optim.SGD, lr=0.1)
    with pytest.raises(ConfigError, match="item #1 is a str"):
        shoal.ZeroRedundancyOptimizer([torch.zeros(3), "w"], torch.optim.SGD, lr=0.1)


def test_mixed_device_types() -> None:
    cpu = nn.Parameter(torch.zeros(3))
    meta = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ConfigError, match="several device types.*cpu.*meta"):
        shoal.ZeroRedundancyOptimizer([{"params": [cpu]}, {"params": [meta]}], torch.optim.SGD, lr=0.1)


def test_torch_only_switches_say_what_to_do_instead() -> None:
    with pytest.raises(ConfigError, match="optimizer=zero"):
        shoal.ZeroRedundancyOptimizer(_params(), torch.optim.SGD, lr=0.1, overlap_with_ddp=True)
    with pytest.raises(ConfigError, match="parameters_as_bucket_view"):
        shoal.ZeroRedundancyOptimizer(_params(), torch.optim.SGD, lr=0.1, parameters_as_bucket_view=True)


def test_ddp_optimizer_must_be_zero() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="must be a shoal.ZeroRedundancyOptimizer"):
        shoal.DistributedDataParallel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]


def test_partition_is_balanced_and_stable_under_appended_groups() -> None:
    sizes = [[400, 100, 300, 200, 50, 50]]
    owners = partition_by_size(sizes, 3)[0]
    load = [sum(s for s, r in zip(sizes[0], owners) if r == k) for k in range(3)]
    assert sorted(load) == [350, 350, 400]
    assert partition_by_size(sizes + [[10, 20]], 3)[0] == owners  # add_param_group moves nothing
    assert assign_bucket_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert assign_bucket_owners([1], 3) == [0]
