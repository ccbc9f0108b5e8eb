"""Strategy and averager configuration, schedules and fragment layouts, in one process."""

from __future__ import annotations

import warnings

import pytest
import torch

import shoal
from shoal.averagers import Hierarchy, Periodic, params_to_average
from shoal.errors import ConfigError
from shoal.strategies.diloco import DiLoCoConfig, split_fragments


def test_hierarchical_errors_name_the_problem() -> None:
    with pytest.raises(ConfigError, match="empty"):
        shoal.Hierarchical({})
    with pytest.raises(ConfigError, match="smallest period must be positive.*got 0"):
        shoal.Hierarchical({0: 2, 4: 4})
    with pytest.raises(ConfigError, match="smallest period must be positive.*got -2"):
        shoal.Hierarchical({-2: 2, 4: 4})
    with pytest.raises(ConfigError, match="warmup_steps must be >= 0, got -1"):
        shoal.Hierarchical({2: 2, 4: 4}, warmup_steps=-1)
    with pytest.raises(ConfigError, match="strictly increasing"):
        shoal.Hierarchical({4: 2, 2: 4})
    h = Hierarchy.from_dict({2: 2, 4: 4})
    with pytest.raises(ConfigError, match=r"last group size .* is 4 but the process group has 8 ranks"):
        h.check_world(8)
    with pytest.raises(ConfigError, match="does not divide"):
        Hierarchy.from_dict({2: 3, 4: 4}).check_world(4)
    h.check_world(4)  # a valid map passes


def test_hierarchical_warns_when_largest_period_is_one() -> None:
    with pytest.warns(UserWarning, match="largest period is 1.*DDP"):
        shoal.Hierarchical({1: 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shoal.Hierarchical({1: 2, 2: 4})  # largest period 2: no warning


def test_periodic_schedule_matches_torch_counting() -> None:
    # torch averages at step == warmup and every period after (steps from 0).
    assert [s for s in range(12) if Periodic(3, 4).due(s)] == [4, 7, 10]
    assert [s for s in range(5) if Periodic(2).due(s)] == [0, 2, 4]
    with pytest.raises(ConfigError, match="period must be >= 1"):
        shoal.LocalSGD(0)
    with pytest.raises(ConfigError, match="warmup_steps"):
        shoal.LocalSGD(2, warmup_steps=-1)
    with pytest.warns(UserWarning, match="period is 1"):
        shoal.LocalSGD(1)


def test_hierarchy_level_per_step() -> None:
    h = Hierarchy.from_dict({2: 2, 4: 4, 8: 8}, warmup_steps=3)
    assert [h.level_at(s) for s in range(10)] == [None, None, None, None, 1, None, 0, None, 2, None]


def test_diloco_config_validation() -> None:
    with pytest.raises(ConfigError, match="inner_steps must be >= 1"):
        shoal.DiLoCo(0)
    with pytest.raises(ConfigError, match="fragments must be between 1 and inner_steps=4"):
        shoal.StreamingDiLoCo(4, fragments=5)
    with pytest.raises(ConfigError, match="overlap_steps must be in"):
        shoal.StreamingDiLoCo(4, fragments=2, overlap_steps=4)
    with pytest.raises(ConfigError, match="mixing"):
        shoal.StreamingDiLoCo(4, fragments=2, mixing=1.0)
    with pytest.raises(ConfigError, match="layout"):
        shoal.StreamingDiLoCo(4, fragments=2, layout="random")
    with pytest.raises(ConfigError, match="codec"):
        shoal.DiLoCo(4, codec="int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="merge must be 'mix' or 'carry'"):
        shoal.StreamingDiLoCo(4, fragments=1, merge="keep")
    with pytest.raises(ConfigError, match="needs overlap_steps >= 1 and mixing == 0.*mixing=0.5"):
        shoal.StreamingDiLoCo(4, fragments=1, merge="carry", mixing=0.5)
    with pytest.raises(ConfigError, match="overlap_steps=0"):
        shoal.StreamingDiLoCo(4, fragments=1, overlap_steps=0, merge="carry")
    carry = shoal.StreamingDiLoCo(4, fragments=1, merge="carry")   # mixing left out: 0, the only value allowed
    assert (carry.config.merge, carry.config.mixing) == ("carry", 0.0)
    assert shoal.StreamingDiLoCo(4, fragments=2).config.mixing == 0.5   # the paper's default for "mix"
    assert [DiLoCoConfig(8, fragments=4).launch_offset(p) for p in range(4)] == [2, 4, 6, 0]


def test_fragment_layouts_cover_every_parameter_once() -> None:
    sizes = [512, 32, 1024, 32, 128, 4]
    modules = ["a", "a", "b", "b", "c", "c"]
    for layout in ("sequential", "strided"):
        for n in range(1, 7):
            frags = split_fragments(sizes, n, layout, modules)
            assert sorted(i for f in frags for i in f) == list(range(6)) and all(frags)
    # sequential fragments are contiguous and the first is not everything
    assert split_fragments(sizes, 2, "sequential") == [[0, 1], [2, 3, 4, 5]]
    with pytest.raises(ConfigError, match="non-empty"):
        split_fragments(sizes, 7, "sequential")


def test_params_to_average_takes_params_or_groups() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    assert params_to_average([w, frozen]) == [w]
    assert params_to_average([{"params": [w, frozen]}]) == [w]
    with pytest.raises(ConfigError, match="param groups"):
        params_to_average([3])
