"""shoal.comm.objects: one serialisation, and gathers that never read what a failed collective left.

An elastic group records a failure and returns later collectives at once,
their outputs untouched: what such an output holds is undefined. The fake
group below fills it with garbage (a negative size) to make that visible.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal.membership.elastic import ElasticGroup
from shoal.comm.objects import all_gather_bytes, broadcast_bytes, from_bytes, to_bytes
from shoal.errors import PeerLostError, ShoalError

GARBAGE = -1   # what a failed collective may leave in its output


class _Done:
    def wait(self, timeout: float | None = None) -> None:
        return None


class _FailingGroup:
    """A group of ``size`` whose collectives from number ``fail_at`` on fail as an elastic group's do."""

    def __init__(self, size: int, fail_at: int, peers: list[bytes] | None = None) -> None:
        self.size, self.rank, self.device = size, 0, torch.device("cpu")
        self.error: BaseException | None = None
        self.calls, self.fail_at = 0, fail_at
        self.peers = peers

    def _fails(self) -> bool:
        self.calls += 1
        if self.calls > self.fail_at and self.error is None:
            self.error = PeerLostError("peer lost")
        return self.error is not None

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> _Done:
        if self._fails():
            output.fill_(GARBAGE)
        else:
            output.copy_(tensor.repeat(self.size))   # every rank sent what this one did
        return _Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "misc") -> _Done:
        if self._fails():
            tensor.fill_(GARBAGE)
        return _Done()

    def report_error(self, err: BaseException) -> None:
        self.error = self.error or err


@pytest.mark.parametrize("fail_at", [0, 1])
def test_elastic_all_gather_object_after_a_failure_is_obj_times_size(fail_at: int) -> None:
    # fail_at=0: the sizes all-gather fails (the bug: it sized a buffer from garbage); 1: the payload's.
    group = _FailingGroup(3, fail_at)
    obj = {"host": "a", "n": 3}
    assert ElasticGroup.all_gather_object(group, obj) == [obj] * 3   # type: ignore[arg-type]


def test_all_gather_bytes_returns_none_after_a_failure() -> None:
    for fail_at in (0, 1):
        assert all_gather_bytes(_FailingGroup(2, fail_at), to_bytes([1, 2]), "t") is None


def test_all_gather_bytes_slices_each_rank() -> None:
    blobs = all_gather_bytes(_FailingGroup(2, fail_at=99), to_bytes(("x", 7)), "t")
    assert blobs is not None and [from_bytes(b) for b in blobs] == [("x", 7)] * 2


def test_broadcast_bytes_after_a_failure_or_an_absurd_size() -> None:
    assert broadcast_bytes(_FailingGroup(2, fail_at=0), torch.ones(3, dtype=torch.uint8), 0, "t") is None
    g = _FailingGroup(2, fail_at=99)
    g.rank = 1
    assert broadcast_bytes(g, None, 0, "t", max_bytes=10) is None      # announced 0 bytes
    assert isinstance(g.error, PeerLostError) and "outside (0, max_bytes=10]" in str(g.error)


def test_roundtrip_refuses_code() -> None:
    state = {"w": torch.arange(3.0), "step": 4, "names": ("a", "b")}
    back = from_bytes(to_bytes(state))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 4 and back["names"] == ("a", "b")

    class Evil:
        def __reduce__(self) -> Any:
            return (print, ("ran code",))

    with pytest.raises(Exception, match="[Ww]eights only"):
        from_bytes(to_bytes(Evil()))
    with pytest.raises(ShoalError, match="1-d uint8"):
        all_gather_bytes(_FailingGroup(2, 99), torch.ones(2), "t")
