"""Elias-Fano position coding (shoal.codecs.positions): exact round trips, and the size it promises."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shoal.codecs import positions
from shoal.errors import ConfigError


def _round_trip(rows: list[list[int]], universe: int) -> torch.Tensor:
    pos = torch.tensor(rows, dtype=torch.int64)
    buf = torch.full((len(rows), positions.layout(universe, len(rows[0]))[2]), 0xAB, dtype=torch.uint8)  # dirty
    positions.encode(pos, universe, buf)
    return positions.decode(buf, universe, len(rows[0]))


@pytest.mark.parametrize("universe, rows", [
    (1, [[0]]),                                   # one of one: no low bits
    (2, [[0], [1]]),
    (4096, [list(range(41)), list(range(4055, 4096))]),     # packed at either end: the unary part's extremes
    (4096, [[0, 4095]]),
    (100, [list(range(100))]),                     # every position: k == universe
    (65536, [[0, 1, 65534, 65535]]),
    (7, [[1, 3, 5]]),                              # universe not a power of two
])
def test_edge_cases_round_trip(universe, rows):
    assert _round_trip(rows, universe).tolist() == rows


def test_random_rows_round_trip():
    rng = random.Random(3)
    for _ in range(300):
        universe = rng.choice([3, 64, 100, 4095, 4096, rng.randint(1, 70000)])
        k = rng.randint(1, min(universe, 200))
        rows = [sorted(rng.sample(range(universe), k)) for _ in range(rng.randint(1, 3))]
        assert _round_trip(rows, universe).tolist() == rows, (universe, k)


@pytest.mark.parametrize("universe, k", [(4096, 41), (4096, 82), (128, 7), (65536, 655), (10, 10)])
def test_size_is_within_two_bits_a_position_of_the_information(universe, k):
    low, high, nbytes = positions.layout(universe, k)
    assert low == math.floor(math.log2(universe / k))
    assert nbytes == math.ceil((k * low + k + ((universe - 1) >> low) + 1) / 8)
    information = math.log2(math.comb(universe, k))      # bits to name one k-subset of universe
    assert nbytes * 8 <= information + 2 * k + 8


def test_layout_refuses_an_impossible_k():
    with pytest.raises(ConfigError, match="1 <= k <= universe"):
        positions.layout(10, 11)
    with pytest.raises(ConfigError, match="1 <= k <= universe"):
        positions.layout(10, 0)


def test_encode_checks_its_output_buffer():
    with pytest.raises(ValueError, match="uint8 of shape"):
        positions.encode(torch.tensor([[1, 2]]), 10, torch.empty(1, 1, dtype=torch.uint8))


def test_low_bits_beyond_int32():
    """TopK over a huge call with a tiny ratio: 33 low bits a position (int64 arithmetic)."""
    for universe, rows in [(2**33, [[2**33 - 5]]), (2**33, [[0]]), (2**31 * 3, [[2**31 + 7, 2**32 + 1]])]:
        assert _round_trip(rows, universe).tolist() == rows
