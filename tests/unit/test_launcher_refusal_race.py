"""A refusal that reaches the launchers while they finish meeting: all of them start, or none.

A second launcher claiming a taken node rank is refused and records why; launchers still meeting
stop for it. Node 1 read that refusal while it waited for node 0's reachability verdict and left;
node 0 then found every verdict written and started alone, waiting for a node that never came
(seen once in tests/dist/test_multinode.py under load). One compare-and-set now decides: the first
launcher to find the meeting complete writes "started" where a refusal would go; whichever came first
holds for every launcher. Two NodeRendezvous on loopback, driven into that order by threads.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from shoal.cli.nodes import NodeLayout, NodeRendezvous, NodeSpec
from shoal.errors import ConfigError, ShoalError

REFUSAL = "node 1: two launchers claim --node-rank 1 in run 'shoal': give each machine its own node rank"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rdv: NodeRendezvous, out: dict[int, Any]) -> threading.Thread:
    def go() -> None:
        try:
            out[rdv.spec.node_rank] = rdv.join()
        except (ShoalError, ConfigError) as e:
            out[rdv.spec.node_rank] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _pair() -> tuple[NodeRendezvous, NodeRendezvous]:
    port = _free_port()
    return (NodeRendezvous(NodeSpec(2, 0, "127.0.0.1", port, join_timeout_s=20), 1),
            NodeRendezvous(NodeSpec(2, 1, "127.0.0.1", port, join_timeout_s=20), 1))


@pytest.mark.timeout(60)
def test_a_node_that_left_for_a_refusal_is_not_left_alone_by_one_that_met_it() -> None:
    node0, node1 = _pair()
    left = threading.Event()
    check0, wait1 = node0._check_reachable, node1._still_waiting

    def node0_checks_late(nodes: Any) -> None:   # node 0 reaches its verdict only once node 1 has left
        left.wait(20)
        check0(nodes)

    def node1_reads_the_refusal(deadline: float, what: str) -> None:
        if "check the addresses" in what and node1.failure("refused") is None:
            node1.fail(f"2:{REFUSAL}", key="refused")   # what the refused second launcher records
        try:
            wait1(deadline, what)
        finally:
            if node1.failure("refused") is not None:
                left.set()
    node0._check_reachable, node1._still_waiting = node0_checks_late, node1_reads_the_refusal  # type: ignore
    out: dict[int, Any] = {}
    threads = [_run(node0, out), _run(node1, out)]
    for t in threads:
        t.join(40)
    assert isinstance(out[1], ShoalError) and "stopped before it started" in str(out[1]), out
    # Node 0 found the meeting complete (node 1's verdict was written before it left) yet does not start.
    assert isinstance(out[0], ShoalError) and REFUSAL in str(out[0]), out
    assert not node0.joined and not node1.joined
    node0.store = node1.store = None


@pytest.mark.timeout(60)
def test_a_refusal_after_the_meeting_is_complete_stops_nobody() -> None:
    node0, node1 = _pair()
    out: dict[int, Any] = {}
    threads = [_run(node0, out), _run(node1, out)]
    for t in threads:
        t.join(40)
    assert isinstance(out[0], NodeLayout) and isinstance(out[1], NodeLayout), out
    node1.fail(f"2:{REFUSAL}", key="refused")   # too late: the run is under way and goes on
    assert node0.failure("refused") is None and node1.failure("refused") is None
