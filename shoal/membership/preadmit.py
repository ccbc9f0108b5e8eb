"""A restart trains before its admission: an averaging strategy's joiner that already holds the survivors' state.

A worker that joins a DiLoCo run in progress is admitted only at the
survivors' next outer round (a period can be minutes), and until then it
used to wait at that quorum's barrier. Yet the state it needs for the round
(the global copies and outer state, which no inner step changes) is often
in its hands long before: the survivors offer it between two rounds
(:meth:`~shoal.membership.catchup.CatchUp.offer_early`) and a restart on the
same host takes it from its own copy in a fraction of a second
(:mod:`shoal.membership.seed`).

So, in the strategy's set-up, such a worker asks to join, starts that
early download and waits only for it (:meth:`EarlyEntry.wait`). Once it is
in, the worker loads it as a joiner loads between two rounds (its model
restarts from the global copies, its inner optimizer empty) and set-up
returns: it trains its inner steps while the survivors finish theirs. After
each inner step it looks whether the survivors wait at the quorum's
barrier (store reads, :meth:`EarlyEntry.due`; another restart of the same
quorum that trains before its admission too counts as there, so two of
them never wait for each other); then it enters, and the
round that admits it takes the inner steps it trained, weighted by their
share of the period like any joiner that loaded between two rounds
(``k`` steps of ``H``: weight ``k/H``, agreed in the round's weight
exchange). The survivors wait at most one of its inner steps at that
barrier.

That is exact only if what it trained from is the state at the admitting
step's begin: the admission keeps the early download only if its sources
named that step (:meth:`~shoal.membership.fetch.Fetch.want`: no round
committed since the offer). Otherwise (a round committed in between, a
newer quorum with another early download, a blocking heal) the steps it
trained are dropped: it is admitted as a zero-weight downloader as before,
and its next download keeps the ranges the loaded copy still has right.

It waits for a source's offer for at most :data:`OFFER_WAIT_S`, and
altogether for ``Timeouts.join``; without an offer it waits at the barrier
as before (its download goes on there). It applies only where someone in
the run has committed a step (a mark in the coordinator's store), so the
workers of a new run, all fresh, meet at their first barrier at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from shoal.membership.fetch import Fetch

log = logging.getLogger("shoal.elastic")
OFFER_WAIT_S = 5.0   # how long a joiner waits for a source's offer before it waits at the barrier instead
POLL_S = 0.01        # how often it looks whether its download has ended
LOOK_S = 0.1         # ... and whether the others wait at the barrier (store reads) meanwhile
ADMIT_WAIT_S = 5.0   # at the admission, how long it waits for the download that checks its host's copy
__all__ = ["ADMIT_WAIT_S", "EarlyEntry", "OFFER_WAIT_S", "held_mark"]


def held_mark(client: Any) -> str:
    """The store key a member sets once it has committed a step: the run holds state (read by a joiner)."""
    return str(client.key("held"))


@dataclass
class EarlyEntry:
    """A joiner that loaded the run's state before its admission: where it waits to be admitted."""

    q: Any                 # the published quorum it will enter (its barrier)
    fetch: Fetch           # the early download (the admission keeps it only if it is of that step)
    deadline: float        # after this it enters anyway (the barrier's own wait takes over)
    counted: bool = False  # it added itself to the quorum's count of members training before their admission
    blob: bytes = b""      # what it loaded: the download's result, or its host's copy until the download ends
    from_seed: bool = False   # ``blob`` is the host's copy, not checked against the download yet

    @classmethod
    def wait(cls, catchup: Any) -> "EarlyEntry | None":
        """In the strategy's set-up, a fresh worker: ask to join, start the early download of the quorum that
        holds it and return what to load (``blob``, loaded and announced by the caller): its host's copy at once
        if it has one (``from_seed``: checked against the download once that ends, or at the admission), else
        the download once it ends. None: enter the usual way (wait at the quorum's barrier); at once where the
        run holds no state yet or this worker could not be admitted in the background between two rounds."""
        g = catchup.group
        if not (catchup.enabled and g._fresh and g.quorum is None and catchup.hid < 0 and catchup.replayers
                and catchup._between_rounds() and catchup.column()[1]):
            return None
        client = g.client
        if client.member_id == 0:
            client.join()
        try:
            if not client.store.check([held_mark(client)]):
                return None   # a new run: its first workers meet at their first barrier
        except Exception as e:  # noqa: BLE001 - the coordinator does not answer: the barrier's wait handles it
            log.debug("could not read whether the run holds state (%s)", e)
            return None
        q = client.wait_quorum(g._after, g.timeouts.join)
        if not any(m != client.member_id for m in q.members):
            return None
        client.peek_latest.set()   # the heartbeat thread reads the newest quorum id (due() looks at it)
        catchup.prefetch(q)
        fetch = catchup.early
        if fetch is None:
            return None
        entry = cls(q, fetch, time.monotonic() + g.timeouts.join)
        copy = catchup.host_copy()
        if copy is not None:   # this slot's last life's copy: most often the state the survivors' round starts from
            entry.blob, entry.from_seed = copy, True
            return entry
        offered_by, looked = time.monotonic() + OFFER_WAIT_S, 0.0
        while not fetch.done.is_set():
            if fetch.step is None and time.monotonic() > offered_by:
                return None   # nobody offered: the barrier
            if time.monotonic() - looked > LOOK_S:
                looked = time.monotonic()
                if entry.due(catchup):
                    return None   # the others reached their round first: the barrier (the download goes on)
            time.sleep(POLL_S)
        blob, error = fetch.result
        if blob is None or error is not None:
            log.info("the early download for quorum %d failed (%s): waiting for the admission", q.qid, error)
            return None
        entry.blob = blob
        return entry

    def announce(self, catchup: Any) -> bool:
        """Once loaded: count itself among the quorum's members training before their admission (another
        restart of this quorum then counts it as good as at the barrier); False if the store did not answer."""
        try:
            catchup.group.client.store.add(self.q.prefix + "early", 1)
        except Exception as e:  # noqa: BLE001 - the coordinator does not answer: the barrier's wait handles it
            log.debug("could not count itself among quorum %d's early joiners (%s)", self.q.qid, e)
            return False
        self.counted = True
        log.info("loaded %s for quorum %d (%d bytes) before its admission: training until the survivors' round",
                 "this host's copy of the state" if self.from_seed else "the state offered", self.q.qid,
                 len(self.blob))
        return True

    def fresher(self) -> bytes | None:
        """Trained from the host's copy: once the download has ended with other bytes (the copy was stale), those
        bytes, to load instead; None otherwise (then the copy is checked: kept, or found right)."""
        if not self.from_seed or not self.fetch.done.is_set():
            return None
        self.from_seed = False
        blob, error = self.fetch.result
        if blob is None or error is not None or blob == self.blob:
            return None
        return blob

    def due(self, catchup: Any) -> bool:
        """Whether to enter the quorum now: every other member waits at its barrier or trains before its
        admission too (two restarts in one quorum: each counts the other as there, so neither waits for the
        other), the quorum was dissolved or a newer one published, the coordinator does not answer, or the
        wait is over. Three store reads."""
        client, q = catchup.group.client, self.q
        if time.monotonic() > self.deadline or client.latest_seen > q.qid or client.down.is_set():
            return True
        try:
            st = client.store
            others = int(st.add(q.prefix + "arrive", 0)) + int(st.add(q.prefix + "early", 0)) - int(self.counted)
            return others >= len(q.members) - 1 or bool(st.check([q.prefix + "abort"]))
        except Exception as e:  # noqa: BLE001 - the coordinator does not answer: the barrier's wait handles it
            log.debug("could not read quorum %d's barrier (%s)", q.qid, e)
            return True
