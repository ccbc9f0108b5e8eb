"""MASTER_PORT and the test helpers' ports come from below the kernel's ephemeral range (shoal.comm.ports)."""

from __future__ import annotations

import random
import socket
from typing import Any

from shoal.comm import ports
from shoal.testing import free_port


def test_a_picked_port_is_below_the_ephemeral_range_and_binds() -> None:
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.pick_port()
        end = min(low, 30000)
        assert max(1024, end - 12000) <= port < end, (port, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))   # free when picked (nothing else on this box binds it meanwhile)
    assert free_port() < low   # what the tests and the launcher use


class _Scripted(random.Random):
    """Draws the given ports in turn."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__(0)
        self.draws = list(draws)

    def randrange(self, *args: Any, **kwargs: Any) -> int:   # type: ignore[override]
        return self.draws.pop(0)


def test_a_port_in_use_is_skipped(monkeypatch: Any) -> None:
    free = ports.pick_port()   # below the range: no connection holds it (drawn before the patch below)
    for where in ("127.0.0.1", "127.0.0.2"):   # held on the address asked for, or only on another one (a store
        # listens on every interface: 127.0.0.2 is caught by the bind on 0.0.0.0)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
            busy.bind((where, 0))
            busy.listen()
            taken = busy.getsockname()[1]
            monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, 60999))
            monkeypatch.setattr(ports, "_CEILING", 65536)
            assert ports.pick_port(rng=_Scripted([taken, free])) == free, where


def test_a_high_ephemeral_range_still_gets_a_port_below_it(monkeypatch: Any) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (49152, 65535))   # e.g. Windows' and BSD's range
    port = ports.pick_port()
    assert 30000 - 12000 <= port < 30000, port


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: Any) -> None:
    low, high = ports.ephemeral_range()
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1100, 60999))   # 76 ports below: too few
    port = ports.pick_port(rng=_Scripted([]))   # no draw at all
    assert low <= port <= high, (port, low, high)   # the kernel's pick, from its ephemeral range


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path: Any) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    f.write_text("garbage\n")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
