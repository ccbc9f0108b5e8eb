"""CatchUp's side of a joiner's kept progress (shoal.membership.catchup, OuterReplay in diloco_heal): the drift guard
reads the longest span of any replayer, and a blocking heal tells each replayer its model was replaced."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from test_heal_abandon import _Group, _Store

from shoal.membership.catchup import CatchUp


class _Spans:
    def __init__(self, longest: int) -> None:
        self._longest, self.calls = longest, []

    def longest(self) -> int:
        return self._longest

    def trained(self) -> int:
        return 1

    def replaced(self) -> None:
        self.calls.append("replaced")

    def forget_base(self) -> None:
        self.calls.append("forget_base")


def _catchup(*replayers: Any) -> CatchUp:
    c = CatchUp(_Group(_Store(dist.HashStore())))
    c.replayers.extend(replayers)
    return c


def test_the_drift_guard_reads_the_longest_span() -> None:
    assert _catchup(_Spans(3), _Spans(9)).longest() == 9
    assert _catchup().longest() == 0   # nothing loaded: no span


def test_a_blocking_heal_tells_each_replayer_its_model_was_replaced() -> None:
    r = _Spans(0)
    c = _catchup(r)
    c.state_replaced()
    assert r.calls == ["replaced"]   # (its spans then count from the heal; forget_base alone would not say so)
