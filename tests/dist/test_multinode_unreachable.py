"""A machine whose advertised address the others cannot reach is named, with the fix, on every launcher.

Two launchers' rendezvous on loopback; node 1 advertises a probe port where
nothing listens (as a machine behind a firewall, or advertising an address of
the wrong interface, looks to the others).
"""

from __future__ import annotations

import socket
import threading

import pytest

from shoal.cli.nodes import NodeRendezvous, NodeSpec
from shoal.cli.supervise import _free_port
from shoal.errors import ConfigError, ShoalError


class _Unreachable(NodeRendezvous):
    def _start_probe(self, addr: str) -> int:
        self._closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._closed.bind((addr, 0))          # bound, never listening: a connect is refused
        return int(self._closed.getsockname()[1])


@pytest.mark.timeout(60)
def test_an_unreachable_advertised_address_is_named_with_the_fix() -> None:
    port = _free_port()
    errors: dict[int, BaseException] = {}

    def meet(rdv: NodeRendezvous, rank: int) -> None:
        try:
            rdv.join()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors[rank] = e

    rdvs = [NodeRendezvous(NodeSpec(2, 0, "127.0.0.1", port, join_timeout_s=30), 1),
            _Unreachable(NodeSpec(2, 1, "127.0.0.1", port, join_timeout_s=30), 1)]
    threads = [threading.Thread(target=meet, args=(r, i)) for i, r in enumerate(rdvs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert sorted(errors) == [0, 1], errors
    # Node 0 finds node 1 unreachable. Node 1 reads that verdict itself (ConfigError, "this machine") or,
    # if node 0 stopped the run first, as the run's stop carrying node 0's reason (ShoalError): either way
    # the machine and the fix are named.
    assert isinstance(errors[0], ConfigError), errors[0]
    for rank, e in errors.items():
        assert isinstance(e, ShoalError), e
        assert "node 0 cannot reach" in str(e) and "at its advertised address 127.0.0.1" in str(e), e
        assert "--advertise-addr" in str(e), e
