"""Node 0's launcher says so when its --master-port is taken by another process.

torch's TCPStore reports only "EADDRINUSE" in its own words; the launcher names the port, that another
process on this machine holds it, and the fix (stop it, or another --master-port on every launcher).
The multi-launcher tests (tests/dist/test_multinode.py) also start a run again on a new port on this message.
"""

from __future__ import annotations

import socket

import pytest

from shoal.cli.nodes import NodeRendezvous, NodeSpec
from shoal.errors import ShoalError


@pytest.mark.timeout(60)
def test_a_taken_master_port_is_named_with_the_fix() -> None:
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    rdv = NodeRendezvous(NodeSpec(2, 0, "127.0.0.1", port, join_timeout_s=30), 1)
    try:
        with pytest.raises(ShoalError, match=f"port {port} is taken by another process on this machine; .*"
                                             "give every launcher of the run another --master-port"):
            rdv.join()
    finally:
        rdv.finish(0, print)   # closes its probe socket
        held.close()


def test_another_failure_to_serve_is_not_called_a_taken_port() -> None:
    rdv = NodeRendezvous(NodeSpec(2, 0, "127.0.0.1", 29511), 1)
    what = rdv._what_failed(RuntimeError("code: -13, name: EACCES, message: permission denied"))
    assert what == "serve the rendezvous on port 29511", what
