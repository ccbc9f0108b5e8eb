"""shoal.codecs.largest.topk_indices: torch.topk's set through group maxima, on any row length."""

from __future__ import annotations

import pytest
import torch

from shoal.codecs.largest import topk_indices


def _sets(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    got = torch.sort(topk_indices(x, k), dim=1).values
    want = torch.sort(torch.topk(x, k, dim=1, sorted=False).indices, dim=1).values
    return got, want


@pytest.mark.parametrize("n, c, k", [(796, 4096, 41), (3, 4096, 82), (2, 4096, 256), (1, 100_003, 1000),
                                     (1, 3_000, 1), (4, 17, 3), (2, 64, 4), (1, 8 * 2 * 5 + 7, 5)])
def test_the_same_set_as_torch_topk(n, c, k):
    g = torch.Generator().manual_seed(c + k)
    got, want = _sets(torch.randn(n, c, generator=g).abs(), k)
    assert torch.equal(got, want)


def test_a_top_element_in_the_leftover_columns_is_found():
    x = torch.rand(2, 8 * 20 + 5)
    x[0, -1] = 5.0          # among the c % 8 columns outside the groups
    x[1, -3:] = 7.0
    got, want = _sets(x, 4)
    assert torch.equal(got, want) and 164 in got[0].tolist() and {162, 163, 164} <= set(got[1].tolist())


def test_nan_and_inf_rank_first_as_in_torch_topk():
    x = torch.rand(3, 4096)
    x[0, 5] = float("nan")
    x[1, 4095] = float("inf")
    x[2, [0, 1000, 2000]] = float("nan")
    got, want = _sets(x, 20)
    assert torch.equal(got, want)
    assert 5 in got[0].tolist() and 4095 in got[1].tolist() and {0, 1000, 2000} <= set(got[2].tolist())


def test_every_element_of_one_group_in_the_top():
    x = torch.rand(1, 4096) * 0.1
    x[0, torch.arange(8) * 512 + 3] = torch.arange(1, 9, dtype=torch.float32)   # all of group 3
    got, want = _sets(x, 10)
    assert torch.equal(got, want)
