"""An orderly leave: how many collectives each member has been through on the current quorum.

Collectives that no vote covers (``ZeroRedundancyOptimizer.consolidate_state_dict``'s
gather after the last step) end at different times on different members: one
that finished may leave at once, and its leave makes the coordinator abort
the quorum under a slower member still inside. So each member publishes how
many collectives it has been through on this quorum, and ``leave()`` waits
until every member is past its own count. A committed vote already says so for
every collective issued before it (each member votes after issuing its step's
collectives), so a member publishes its count (``past/<member id>`` under the
quorum's prefix) only for the collectives no vote covered: at a ``begin_step``
after a discarded step or after collectives outside a step, and at its leave.
A run of committed steps writes nothing to the store. :class:`PastCount` is
that bookkeeping; an :class:`~shoal.membership.elastic.ElasticGroup` holds one
(``group.past``).

A member also leaves marks for the launcher: ``trained/<label>`` once it
committed a step, ``finished/<label>`` when it finished its part
(:func:`mark_life`), and the run's ``finished`` counter (:func:`run_counter`).

Example::

    past = PastCount(client)
    past.add(handle)                 # a collective issued on this quorum
    past.agree()                     # the step's vote committed: every member is past it
    past.tell(quorum)                # published at begin_step if a collective came since
    past.await_peers(quorum, size, failures, timeouts.quorum, lambda: error)
"""

from __future__ import annotations

import os
import time
from typing import Callable

from shoal.comm.handle import Handle
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum
from shoal.membership.vote import Failures


class PastCount:
    """The collectives issued on the current quorum, and the count last published (see the module docstring).

    Args:
        client: the member's connection to the coordinator's store.
    """

    def __init__(self, client: MemberClient) -> None:
        self.client = client
        self.pending: list[Handle] = []   # collectives issued on this quorum since the last tell
        self.issued = 0                   # collectives issued on this quorum
        self.told = 0                     # the count last published, or agreed by a committed vote
        self.agreed = 0                   # the count every member is known to be past (a committed vote)

    def reset(self) -> None:
        """A new quorum: nothing issued on it yet (the heal's collectives differ per member)."""
        self.pending, self.issued, self.told, self.agreed = [], 0, 0, 0

    def agree(self) -> None:
        """A committed vote: every member voted after issuing this step's collectives, so every member is
        past this member's count, and nothing needs publishing for it."""
        self.pending = []
        self.agreed = self.told = self.issued

    def add(self, handle: Handle) -> None:
        """Count one collective issued on this quorum."""
        self.pending.append(handle)
        self.issued += 1

    def tell(self, quorum: Quorum | None) -> None:
        """Publish this member's collective count on ``quorum``, if it grew since the last time."""
        if self.issued > self.told and quorum is not None:
            self.pending = []
            try:
                self.client.store.set(f"{quorum.prefix}past/{self.client.member_id}", str(self.issued))
            except Exception:  # noqa: BLE001 - the coordinator is gone: the step fails on its own
                pass
            self.told = self.issued

    def await_peers(self, quorum: Quorum | None, size: int, failures: Failures, limit: float,
                    error: Callable[[], BaseException | None]) -> None:
        """Wait until every member is past this member's collectives on ``quorum`` (at most ``limit`` s;
        a failure, an abort or a newer quorum ends the wait)."""
        if quorum is None or self.issued <= self.agreed or size == 1:
            return   # nothing issued, or every collective was before a committed vote
        for h in self.pending:
            h.wait()
        mine = self.issued
        self.tell(quorum)
        if error() is not None:
            return
        st, deadline = self.client.store, time.monotonic() + limit
        keys = [f"{quorum.prefix}past/{m}" for m in quorum.members]
        while time.monotonic() < deadline and self.client.lost_prefix != quorum.prefix:
            try:
                if st.check(keys) and all(int(v) >= mine for v in st.multi_get(keys)):
                    return
                if failures.aborted or self.client.latest() > quorum.qid:
                    return
            except Exception:  # noqa: BLE001 - the coordinator is down: nobody can tell; leave now
                return
            time.sleep(0.002)


def life_label(member_id: int) -> str:
    """This life's launcher label, ``RANK-SHOAL_RESTART@SHOAL_LAUNCH_ID`` (``m<member id>`` outside a
    launcher; without a launch id, no ``@`` part)."""
    rank, launch = os.environ.get("RANK"), os.environ.get("SHOAL_LAUNCH_ID")
    if not rank:
        return f"m{member_id}"
    return f"{rank}-{os.environ.get('SHOAL_RESTART', '0')}" + (f"@{launch}" if launch else "")


def mark_life(client: MemberClient, what: str) -> None:
    """Set ``<what>/<life label>`` in the run's store (``trained``, ``finished``: read by ``shoal run --elastic``)."""
    try:
        client.store.set(client.key(f"{what}/{life_label(client.member_id)}"), "1")
    except Exception:  # noqa: BLE001 - the coordinator is gone: nobody is left to read it
        pass


def run_counter(client: MemberClient, key: str, n: int) -> int:
    """Add ``n`` to the run's counter ``key`` and return it (0 when the coordinator is gone)."""
    try:
        return int(client.store.add(client.key(key), n))
    except Exception:  # noqa: BLE001 - as above
        return 0
