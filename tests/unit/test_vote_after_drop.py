"""No split brain when a whole quorum is cut off from the coordinator: its members cannot commit.

The coordinator drops members whose heartbeat stopped (a partition between them and the coordinator)
and raises their quorum's abort flag. If every member of that quorum was cut off (all of a quorum on
one host whose link went down; or a quorum of one), nobody on the coordinator's side writes the
step's verdict first, and the run may go on without them (a new quorum, e.g. restarts). When their
link returns, their commit votes reach the store: they used to complete the count and decide
``commit`` (or, alone, commit without asking), committing a step of a quorum the coordinator had
already dissolved. The vote now reads the quorum's abort flag before deciding a commit.

Deterministic: heartbeats are stopped by hand (no network is cut), the test waits for the
coordinator's ``dropped/<id>`` marks, then votes.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Coordinator, Quorum, Timeouts, Trace
from shoal.membership.vote import Ballot, Failures

TOKEN = "vote-after-drop-token"
TIMEOUTS = Timeouts(op=2.0, heartbeat_interval=0.05, probe=0.2, heartbeat_timeout=0.4, quorum=5.0, join=10.0)


def _members(coord: Coordinator, n: int) -> tuple[list[MemberClient], Quorum]:
    run = uuid.uuid4().hex[:8]
    clients = [MemberClient(coord.address, run, TIMEOUTS, min_workers=n, token=TOKEN) for _ in range(n)]
    for c in clients:
        c.join()
    qs = [c.wait_quorum(0, timeout=10) for c in clients]
    assert len({q.qid for q in qs}) == 1 and len(qs[0].members) == n
    return clients, qs[0]


def _cut_off(clients: list[MemberClient]) -> None:
    """Their heartbeats stop (as behind a link that went down) until the coordinator drops them all."""
    for c in clients:
        c._stop.set()
        assert c._hb is not None
        c._hb.join(timeout=5)
    deadline = time.monotonic() + 10
    while not all(c.store.check([c.key(f"dropped/{c.member_id}")]) for c in clients):
        assert time.monotonic() < deadline, "the coordinator never dropped the silent members"
        time.sleep(0.02)


def _ballot(c: MemberClient, q: Quorum) -> Ballot:
    return Ballot(c, TIMEOUTS, Failures(c, lambda: q.prefix, Trace()))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [1, 2])
def test_a_quorum_the_coordinator_dropped_whole_cannot_commit_when_it_comes_back(size: int) -> None:
    coord = Coordinator(port=0, initial_workers=size, token=TOKEN).start()
    try:
        clients, q = _members(coord, size)
        _cut_off(clients)
        verdicts: list[str] = [""] * size

        def vote(i: int) -> None:
            verdicts[i] = _ballot(clients[i], q).vote(q, 0, size)

        threads = [threading.Thread(target=vote, args=(i,)) for i in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert verdicts == ["discard"] * size, verdicts
    finally:
        coord.stop()


@pytest.mark.timeout(30)
def test_a_live_quorum_still_commits() -> None:
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    try:
        clients, q = _members(coord, 2)
        verdicts: list[str] = ["", ""]

        def vote(i: int) -> None:
            verdicts[i] = _ballot(clients[i], q).vote(q, 0, 2)

        threads = [threading.Thread(target=vote, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert verdicts[0] == verdicts[1] and verdicts[0].startswith("commit:"), verdicts
        for c in clients:
            c.leave()
    finally:
        coord.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2])
def test_a_quorum_cut_off_past_the_heartbeat_timeout_never_commits_once_the_coordinator_answers(size: int) -> None:
    # The heartbeat thread took the cut-off for a dead coordinator (it cannot tell them apart) and its
    # members went on voting without the store. When the link returns, the live coordinator does not take
    # them back (it dropped them): from then on no vote of that quorum may commit (before the fix a quorum
    # of one committed alone for good, and a larger one by peer vote, beside the run going on elsewhere).
    coord = Coordinator(port=0, initial_workers=size, token=TOKEN).start()
    try:
        clients, q = _members(coord, size)
        _cut_off(clients)
        for c in clients:
            c.abort.watch(q.prefix)
            # The same coordinator (not restarted) answers: its verdict stands; the member keeps beating
            # under its dropped id and joins anew at its next quorum wait.
            assert c._outage(c.member_id, threading.Event(), ConnectionError("link down")) is True
            assert c.lost_prefix == q.prefix and c.dropped_prefix == q.prefix and not c.down.is_set()
            assert c._rejoin
        group = (lambda: (None, 0, torch.device("cpu")))
        verdicts = [Ballot(c, TIMEOUTS, Failures(c, lambda: q.prefix, Trace()), group).vote(q, 0, size)
                    for c in clients]
        assert verdicts == ["discard"] * size, verdicts
    finally:
        coord.stop()
