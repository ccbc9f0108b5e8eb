"""The peer watch: a survivor learns of a lost member between rounds, not from the round that fails.

Averaging strategies (DiLoCo, streaming DiLoCo) run collectives only at
their outer rounds, tens of seconds apart. A member SIGKILLed in between is
otherwise seen only when the next round's collective fails (or when the
coordinator's ``heartbeat_timeout`` passes); the round is then discarded and
run again over the survivors, so a kill costs two rounds. With the watch on
(:meth:`~shoal.membership.elastic.ElasticGroup.watch_peers`), a background
thread reads the quorum's heartbeat counters every ``Timeouts.probe``
seconds (one store read per window, none on the training thread). A member
whose counter did not move over a whole window is suspected, by the same
rule as the commit vote's own probe (:mod:`shoal.membership.vote`): the watch
raises the quorum's abort flag, so that no step of that quorum can commit any
more, and asks the coordinator for a new quorum, which it forms after its own
probe (it alone decides who is gone). Before its next round the strategy
calls :meth:`~shoal.membership.elastic.ElasticGroup.renew_if_dissolved`: the
dissolved quorum is left there and the round runs once, over the quorum the
coordinator published. Only the coordinator's quorums ever commit: the watch
only forbids commits (the abort flag), it never forms a quorum itself.

Example::

    watch = PeerWatch(group.client, lambda: group.quorum, window=group.timeouts.probe).start()
    ...
    watch.stop()
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, connect, log


class PeerWatch:
    """A daemon thread that suspects a quorum member whose heartbeat stopped (see the module docstring).

    Args:
        client: this member's connection to the coordinator (the store address, its abort watch).
        quorum: returns the quorum this member is in now (None: none yet).
        window: seconds between two reads; a counter equal in two reads is a lost member.
    """

    def __init__(self, client: MemberClient, quorum: Callable[[], Quorum | None], window: float) -> None:
        self.client, self.quorum, self.window = client, quorum, window
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
        last: tuple[str, list[bytes]] | None = None   # (quorum prefix, its members' counters) a window ago
        while not self._stop.wait(self.window):
            q, c = self.quorum(), self.client
            if q is None or len(q.members) < 2 or c.down.is_set() or c.abort.raised(q.prefix):
                last = None
                continue
            try:
                if st is None:
                    st = connect(c.address, self.window)
                beats = list(st.multi_get([c.key(f"hb/{m}") for m in q.members]))
                if last is not None and last[0] == q.prefix:
                    silent = [m for m, a, b in zip(q.members, last[1], beats) if a == b and m != c.member_id]
                    if silent:
                        self._dissolve(st, q, silent)
                last = (q.prefix, beats)
            except Exception as e:  # noqa: BLE001 - the store is unreachable: the heartbeat thread handles outages
                log.debug("peer watch: reading the heartbeats failed (%s)", e)
                st, last = None, None

    def _dissolve(self, st: Any, q: Quorum, silent: list[int]) -> None:
        """Forbid ``q`` any further commit and ask the coordinator for the next quorum."""
        log.info("member(s) %s of quorum %d silent for %.1f s: asking the coordinator for a new quorum",
                 silent, q.qid, self.window)
        st.set(q.prefix + "abort", f"member(s) {silent} stopped heartbeating")
        st.set(self.client.key(f"req/{q.qid}"), str(self.client.member_id))
        self.client.abort.saw(q.prefix)
        self.suspected += 1


class PeerWatching:
    """What :class:`~shoal.membership.elastic.ElasticGroup` gets from this module: :meth:`watch_peers`,
    :meth:`renew_if_dissolved` and :meth:`stop_watch` (the group's own attributes are used as they are)."""

    watch: PeerWatch | None
    client: MemberClient
    timeouts: Any
    quorum: Quorum | None
    trace: Any
    step: int
    _in_step: bool
    _after: int
    _abandon: Callable[[], None]      # the group's: drop the quorum's process group

    def watch_peers(self) -> None:
        """Watch the quorum's heartbeats from now on (once; see the module docstring): DiLoCo and streaming
        DiLoCo turn it on, so that a member lost during inner steps is left out before the next round."""
        if self.watch is None:
            self.watch = PeerWatch(self.client, lambda: self.quorum, self.timeouts.probe).start()

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def renew_if_dissolved(self) -> bool:
        """Before a round, outside a step: leave the current quorum now if its abort flag is raised.

        A raised flag (the coordinator dropped a member, or a member's watch or
        failure raised it) means no step of that quorum can commit any more;
        leaving it now, the next ``begin_step`` adopts the coordinator's next
        quorum and the round runs once, instead of failing and running again.
        Nothing is discarded. True if it left.

        Example::

            group.renew_if_dissolved()   # a peer died during the inner steps: re-form first
            group.begin_step()           # adopts the survivors' quorum; the round then runs once
        """
        q = self.quorum
        if self._in_step or q is None or self._after >= q.qid or not self.client.abort.raised(q.prefix):
            return False
        self.trace("dissolved", qid=q.qid, step=self.step)
        self._abandon()
        self.client.request_quorum(q.qid)
        self._after = q.qid
        return True
