"""The peer watch: a survivor learns of a lost member between rounds, not from the round that fails.

Averaging strategies (local SGD, post-local SGD, Hierarchical, DiLoCo,
streaming DiLoCo) run collectives only at their rounds, up to tens of
seconds apart; DASO's rounds are its steps. A member SIGKILLed in between is
otherwise seen only when the next round's collective fails (or when the
coordinator's ``heartbeat_timeout`` passes); the round is then discarded and
run again over the survivors, so a kill costs two rounds. With the watch on
(:meth:`~shoal.membership.elastic.ElasticGroup.watch_peers`, which starts
the group's :class:`PeerWatcher`), a background thread reads the quorum's
heartbeat counters every ``Timeouts.probe`` seconds (one store read per
window, none on the training thread). A member whose counter did not move
over two whole windows in a row is suspected (the commit vote's own probe,
:mod:`shoal.membership.vote`, judges one window, but it runs only while a
vote waits; the watch runs all the time, and a heartbeat thread starved for
one window on a loaded machine must not dissolve a quorum): the watch raises the quorum's abort
flag, so that no step of that quorum can commit any more, and asks the
coordinator for a new quorum, which it forms after its own probe (it alone
decides who is gone). Before its next round the strategy calls
:meth:`~shoal.membership.elastic.ElasticGroup.renew_if_dissolved`, which asks
the watcher whether a dissolved quorum is due to be left
(:meth:`PeerWatcher.due`) and leaves it: the round then runs once, over the
quorum the coordinator published. Only the coordinator's quorums ever
commit: the watch only forbids commits (the abort flag), it never forms a
quorum itself. Strategies renew only before rounds that a failure runs
again (or, DASO, before the empty round that adopts a quorum), so a member
that missed the flag meets the renewed ones in the same round
(docs/elastic.md, "A member lost between two rounds").

Example::

    group.watch_peers()            # the group's PeerWatcher starts its PeerWatch thread
    ...
    group.renew_if_dissolved()     # before a round: leave a quorum the watch dissolved
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, connect, log


class Stillness:
    """The rule that judges a member lost: its heartbeat counter did not move over ``windows`` reads in a row.

    Shared by the peer watch (between rounds) and the quorum rendezvous
    (:mod:`shoal.membership.rendezvous`, while a group forms). Feed it one read
    of the counters per window; a counter read as a negative int (the
    rendezvous reads ints; the member left) counts as ``windows`` at once (the
    peer watch reads raw bytes: a left member's ``-1`` then just stands still).

    Example::

        judge = Stillness(windows=2)
        judge.update({2: 5, 3: 9}); judge.update({2: 6, 3: 9}); judge.update({2: 7, 3: 9})   # -> [3]
    """

    def __init__(self, windows: int = 2) -> None:
        self.windows = windows
        self._last: dict[int, Any] | None = None
        self._still: dict[int, int] = {}

    def update(self, beats: dict[int, Any]) -> list[int]:
        """The members judged lost after this read (sorted)."""
        if self._last is not None:
            self._still = {m: self.windows if _left(b) else self._still.get(m, 0) + 1
                           for m, b in beats.items() if _left(b) or b == self._last.get(m)}
        self._last = dict(beats)
        return sorted(m for m, n in self._still.items() if n >= self.windows)

    def reset(self) -> None:
        self._last, self._still = None, {}


def _left(beat: Any) -> bool:
    return isinstance(beat, int) and beat < 0


def dissolve(store: Any, client: MemberClient, q: Quorum, why: str) -> None:
    """Forbid ``q`` any further commit (its abort flag) and ask the coordinator for the next quorum.

    ``store``: the caller's store client (the peer watch's thread uses its own; the rendezvous uses the
    member's, whose calls torch serialises).
    Raises what the store raises (the caller decides whether an unreachable coordinator matters).
    """
    store.set(q.prefix + "abort", why)
    store.set(client.key(f"req/{q.qid}"), str(client.member_id))
    client.abort.saw(q.prefix)


class PeerWatch:
    """A daemon thread that suspects a quorum member whose heartbeat stopped (see the module docstring).

    Args:
        client: this member's connection to the coordinator (the store address, its abort watch).
        quorum: returns the quorum this member is in now (None: none yet).
        window: seconds between two reads; a counter unchanged over ``windows`` consecutive
            windows is a lost member.
        windows: how many windows in a row (2: a heartbeat thread starved for one window on a
            loaded machine, or a GC pause, is not taken for a death; a kill is seen after 2-3
            windows, still seconds before the coordinator's ``heartbeat_timeout``).
    """

    def __init__(self, client: MemberClient, quorum: Callable[[], Quorum | None], window: float,
                 windows: int = 2) -> None:
        self.client, self.quorum, self.window, self.windows = client, quorum, window, windows
        self.suspected = 0            # quorums this watch dissolved (read by tests and the bench)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PeerWatch":
        self._thread = threading.Thread(target=self._run, name="shoal-peer-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.window + 1)
            self._thread = None

    def _run(self) -> None:
        st: Any = None          # its own store client: the training and heartbeat threads use theirs
        judge, judged = Stillness(self.windows), ""     # judged: the prefix of the quorum being judged
        while not self._stop.wait(self.window):
            q, c = self.quorum(), self.client
            if q is None or len(q.members) < 2 or c.down.is_set() or c.abort.raised(q.prefix):
                judge.reset()
                continue
            try:
                if st is None:
                    st = connect(c.address, self.window)
                others = [m for m in q.members if m != c.member_id]
                beats = list(st.multi_get([c.key(f"hb/{m}") for m in others]))
                if judged != q.prefix:
                    judge.reset()
                    judged = q.prefix
                silent = judge.update(dict(zip(others, beats)))
                if silent:
                    log.info("member(s) %s of quorum %d silent for %.1f s: asking the coordinator for a new "
                             "quorum", silent, q.qid, self.windows * self.window)
                    dissolve(st, c, q, f"member(s) {silent} stopped heartbeating")
                    self.suspected += 1
            except Exception as e:  # noqa: BLE001 - the store is unreachable: the heartbeat thread handles outages
                log.debug("peer watch: reading the heartbeats failed (%s)", e)
                st = None
                judge.reset()


class PeerWatcher:
    """The elastic group's watch over its quorum's members: owned by the group, which asks it before each round.

    It starts the :class:`PeerWatch` thread on :meth:`start` (once; a strategy
    whose members can fall silent between rounds turns it on) and answers
    :meth:`due`: the quorum this member should leave before its next round,
    because that quorum's abort flag is raised (the watch, the coordinator or a
    failed collective raised it) and no step of it can commit any more. The
    group does the leaving (:meth:`~shoal.membership.elastic.ElasticGroup.renew_if_dissolved`):
    the watcher holds no process group and forms no quorum.

    Args:
        client: this member's connection to the coordinator.
        quorum: returns the quorum this member is in now (None: none yet).
        window: seconds between two reads of the heartbeats (``Timeouts.probe``).

    Example::

        watcher = PeerWatcher(group.client, lambda: group.quorum, group.timeouts.probe)
        watcher.start()                                    # idempotent
        q = watcher.due(in_step=False, after=0)            # a dissolved quorum to leave, or None
        watcher.stop()
    """

    def __init__(self, client: MemberClient, quorum: Callable[[], Quorum | None], window: float) -> None:
        self.client, self.quorum, self.window = client, quorum, window
        self.thread: PeerWatch | None = None

    @property
    def suspected(self) -> int:
        """Quorums this member's watch dissolved so far (0 once stopped; read by tests)."""
        return self.thread.suspected if self.thread is not None else 0

    def start(self) -> None:
        if self.thread is None:
            self.thread = PeerWatch(self.client, self.quorum, self.window).start()

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None

    def due(self, in_step: bool, after: int) -> Quorum | None:
        """The current quorum if it should be left before the next round, else None.

        Only outside a step (inside one, the step's vote discards it and leaves),
        only a quorum not left already (``after``: the group adopts a quorum newer
        than this one at its next ``begin_step``), and only once its abort flag is
        raised: a raised flag means no step of that quorum can commit any more.
        """
        q = self.quorum()
        if in_step or q is None or after >= q.qid or not self.client.abort.raised(q.prefix):
            return None
        return q
