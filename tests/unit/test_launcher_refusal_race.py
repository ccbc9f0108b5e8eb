"""A refusal that reaches the launchers while they finish meeting: all of them start, or none.

A second launcher claiming a taken node rank is refused and records why; launchers still meeting
stop for it. Node 1 read that refusal while it waited for node 0's reachability verdict and left (or
left for a signal, which it now records the same way);
node 0 then found every verdict written and started alone, waiting for a node that never came
(seen once in tests/dist/test_multinode.py under load). One compare-and-set now decides: the first
launcher to find the meeting complete writes "started" where a refusal would go; whichever came first
holds for every launcher. Two NodeRendezvous on loopback, driven into that order by threads.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

from shoal.cli.nodes import NodeLayout, NodeRendezvous, NodeSpec
from shoal.errors import ConfigError, ShoalError
from shoal.testing import free_port

REFUSAL = "node 1: two launchers claim --node-rank 1 in run 'shoal': give each machine its own node rank"


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
    port = free_port()
    return (NodeRendezvous(NodeSpec(2, 0, "127.0.0.1", port, join_timeout_s=20), 1),
            NodeRendezvous(NodeSpec(2, 1, "127.0.0.1", port, join_timeout_s=20), 1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("why", ["a refusal", "a signal"])
def test_a_node_that_left_is_not_left_alone_by_one_that_met_it(why: str) -> None:
    # Node 1 leaves while it waits for node 0's reachability verdict: it read another launcher's refusal,
    # or it got a signal (its wait running out is the same path).
    node0, node1 = _pair()
    left, signalled = threading.Event(), threading.Event()
    node1.interrupted = signalled.is_set
    check0, wait1 = node0._check_reachable, node1._still_waiting

    def node0_checks_late(nodes: Any) -> None:   # node 0 reaches its verdict only once node 1 has left
        left.wait(20)
        check0(nodes)

    def node1_leaves(deadline: float, what: str) -> None:
        if "check the addresses" in what:
            if why == "a signal":
                signalled.set()
            elif node1.failure("refused") is None:
                node1.fail(f"2:{REFUSAL}", key="refused")   # what the refused second launcher records
        try:
            wait1(deadline, what)
        except ShoalError:
            left.set()
            raise
    node0._check_reachable, node1._still_waiting = node0_checks_late, node1_leaves  # type: ignore
    out: dict[int, Any] = {}
    threads = [_run(node0, out), _run(node1, out)]
    for t in threads:
        t.join(40)
    said = "stopped before it started" if why == "a refusal" else "interrupted while waiting"
    assert isinstance(out[1], ShoalError) and said in str(out[1]), out
    # Node 0 found the meeting complete (node 1's verdict was written before it left) yet does not start.
    assert isinstance(out[0], ShoalError) and "the run stopped before it started: node" in str(out[0]), out
    assert (REFUSAL if why == "a refusal" else "node 1: interrupted") in str(out[0]), out
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


@pytest.mark.timeout(60)
def test_node_0_serves_until_the_claimant_of_a_rank_has_read_its_refusal() -> None:
    # Node 1 twice, node 2 not yet started. The second node 1 is refused and acknowledges; node 0 stops for
    # the refusal and serves on until the first node 1, which holds the rank, has read why too. It once
    # took the refused launcher's ack for node 1's and closed its store, so the first node 1 met a closed
    # store and said only "node 0's launcher is gone" (seen in tests/dist/test_multinode.py under load).
    port = free_port()
    node0, first, second = (NodeRendezvous(NodeSpec(3, r, "127.0.0.1", port, join_timeout_s=20), 1)
                            for r in (0, 1, 1))
    claimed, node0_left = threading.Event(), threading.Event()
    wait_all = first._wait_all

    def first_waits_late(what: str, step: str) -> Any:
        claimed.set()
        node0_left.wait(5)   # node 0 leaves only once this launcher acknowledged (or after _ACK_S, 10 s)
        if node0_left.is_set():
            node0.store = None   # what its process's exit does: the store goes with it
            gc.collect()
        return wait_all(what, step)
    first._wait_all = first_waits_late  # type: ignore[method-assign]
    out: dict[str, Any] = {}

    def run(name: str, rdv: NodeRendezvous) -> threading.Thread:
        def go() -> None:
            try:
                out[name] = rdv.join()
            except (ShoalError, ConfigError) as e:
                out[name] = e.with_traceback(None)   # its frames would hold node 0's store open
            if rdv is node0:
                node0_left.set()
        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t

    threads = [run("node0", node0), run("first", first)]
    assert claimed.wait(20)
    threads.append(run("second", second))
    for t in threads:
        t.join(40)
    assert isinstance(out["second"], ConfigError) and "two launchers claim --node-rank 1" in str(out["second"]), out
    for name in ("node0", "first"):
        assert isinstance(out[name], ShoalError), out
        assert f"the run stopped before it started: {REFUSAL}" in str(out[name]), out
    node0.store = first.store = second.store = None
