"""Bad input to DistributedDataParallel and init(), in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shoal
from shoal.errors import ConfigError, ShoalError
from shoal.reducer import assign_buckets


def test_no_process_group_says_how_to_start() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(ShoalError, match=r"shoal.init\(\)"):
        shoal.DistributedDataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize("cap", [0, -1.0])
def test_bucket_cap_must_be_positive(cap: float) -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        shoal.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=cap)


@pytest.mark.parametrize("value", [None, 1, "yes"])
def test_skip_nonfinite_must_be_a_bool(value: object) -> None:
    with pytest.raises(ConfigError, match="skip_nonfinite"):
        shoal.DistributedDataParallel(nn.Linear(2, 2), skip_nonfinite=value)  # type: ignore[arg-type]


def test_parameters_on_different_devices() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigError, match="several devices"):
        shoal.DistributedDataParallel(model)


def test_device_ids_on_cpu_module() -> None:
    with pytest.raises(ConfigError, match="device_ids"):
        shoal.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])


def test_init_names_missing_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ShoalError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        shoal.init()


def test_buckets_reverse_order_and_cap() -> None:
    ps = [torch.zeros(100) for _ in range(5)]  # 400 bytes each
    assert assign_buckets(ps, cap_bytes=800) == [[4, 3], [2, 1], [0]]
    assert assign_buckets(ps, cap_bytes=10**9, first_cap_bytes=10**9) == [[4, 3, 2, 1, 0]]
    # The first bucket is small by default so communication starts early.
    assert assign_buckets(ps, cap_bytes=10**9, first_cap_bytes=800) == [[4, 3], [2, 1, 0]]
    assert assign_buckets(ps, cap_bytes=1) == [[4], [3], [2], [1], [0]]


def test_buckets_split_by_dtype() -> None:
    ps = [torch.zeros(4), torch.zeros(4, dtype=torch.float16), torch.zeros(4)]
    buckets = assign_buckets(ps, cap_bytes=10**6)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1]]
