"""Forming one quorum's group: the store barrier and the gloo group, given up as soon as they cannot form.

The members of a new quorum meet at a store counter (``<prefix>arrive``),
then build the quorum's gloo group on its own store prefix. Either wait can
outlive a member. A joiner admitted in a new quorum arrives at its barrier
while the others finish their step, and may be killed there: the others
then pass the barrier (its arrival was counted), and the gloo constructor
waits for its address until ``Timeouts.op``. (Run F of docs/BENCHMARKS.md:
one DDP step hung 64 s so; the coordinator had published a quorum without
the dead joiner 7 s into the wait, and nobody looked.) So a
:class:`Rendezvous` watches, while it waits, for three signs that the group
can no longer form, and gives up at the first:

- a newer quorum is published (the coordinator dropped or admitted someone);
- the quorum's abort flag is raised (a member gave up on it, or the
  coordinator dropped one of its members);
- a member's heartbeat counter did not move over two whole ``Timeouts.probe``
  windows in a row (the peer watch's rule, :mod:`shoal.membership.watch`: a
  heartbeat thread starved for one window on a loaded machine is no death).
  The member is judged lost here, seconds before the coordinator's
  ``heartbeat_timeout``; the coordinator's own probe, which the request for
  a new quorum starts, still decides who is gone.

Giving up on a lost member, or on anything once the barrier is passed,
dissolves the quorum: its abort flag is raised (a member whose gloo group
did form must not wait in a collective for one that left) and the
coordinator is asked for the next quorum. The gloo constructor cannot be
interrupted: it runs in a helper thread, which is left behind when the
member gives up; it ends by itself within ``Timeouts.op``, and drops
whatever it built there, never in the training thread.

A subgroup of the quorum (:mod:`shoal.membership.views`: a host's
members, the hosts' leaders) forms the same way, on its own store prefix and
over its own members: a member late to a subgroup's gloo constructor, after
its peers gave up on it, would otherwise retry connecting to their closed
sockets for gloo's whole connect limit (five times ``Timeouts.op``).

Example (what :meth:`~shoal.membership.elastic.ElasticGroup.begin_step` does for each quorum)::

    rv = Rendezvous(client, link, q, deadline, timeouts.probe)
    if rv.meet() is None:                       # every member arrived
        pg = rv.build(q.rank_of(client.member_id))   # or PeerLostError: the quorum is dissolved

    sub = Rendezvous(client, link, q, deadline, timeouts.probe, Circle(prefix, members=(3, 7)))
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass
from typing import Any

from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, log
from shoal.membership.transport import Link
from shoal.membership.watch import Stillness, dissolve
from shoal.errors import PeerLostError

SUPERSEDED = "superseded"   # meet(): a newer quorum exists; nothing to dissolve


class LeftBehind:
    """The gloo constructors given up on, still running in their helper threads, waited for at exit.

    Gloo cannot be interrupted, and a thread still inside it when the
    interpreter finalizes aborts the process ("terminate called without an
    active exception", exit 134), after a run that otherwise went well. So at
    exit the process waits for each one, up to its own limit (it ends by
    itself: its store waits time out after ``Timeouts.op``, a connect gloo
    retries after 5 x ``op``), and says so if it has to wait.

    Example::

        LEFT_BEHIND.add(thread, 6 * timeouts.op)   # on giving up on a build
        LEFT_BEHIND.wait()                          # at exit (registered with atexit)
    """

    def __init__(self) -> None:
        self._threads: list[tuple[threading.Thread, float]] = []
        self._lock = threading.Lock()

    def add(self, thread: threading.Thread, limit: float) -> None:
        with self._lock:
            self._threads = [(t, d) for t, d in self._threads if t.is_alive()] + [(thread, time.monotonic() + limit)]

    def wait(self) -> None:
        with self._lock:
            alive = [(t, d) for t, d in self._threads if t.is_alive()]
        if alive:
            log.warning("waiting up to %.0f s for %d abandoned gloo group constructor(s) to end before exiting "
                        "(gloo cannot be interrupted; exiting with one running aborts the process)",
                        max(d for _, d in alive) - time.monotonic(), len(alive))
        for t, deadline in alive:
            t.join(max(0.0, deadline - time.monotonic()))


LEFT_BEHIND = LeftBehind()
atexit.register(LEFT_BEHIND.wait)


class Heartbeats:
    """The other members of a quorum whose heartbeat stopped, judged by this member's own reads.

    Reads every member's counter once per ``window`` (one store call each: a
    joiner's counter may not exist yet, and ``add(key, 0)`` never waits for
    a key); a member whose counter did not move over ``windows`` reads in a
    row, or that left (-1), is silent.

    Example::

        beats = Heartbeats(client, q.members, timeouts.probe)
        lost = beats.silent()     # [] until a member's counter stood still for 2 windows
    """

    def __init__(self, client: MemberClient, members: tuple[int, ...], window: float, windows: int = 2) -> None:
        self.client, self.window, self.windows = client, window, windows
        self.keys = {m: client.key(f"hb/{m}") for m in members if m != client.member_id}
        self.judge = Stillness(windows)
        self._silent: list[int] = []
        self._next = time.monotonic()

    def silent(self) -> list[int]:
        """The members judged lost so far (at most one store read per member and window)."""
        now = time.monotonic()
        if now >= self._next:   # a new window: read every counter once
            self._next = now + self.window
            self._silent = self.judge.update({m: int(self.client.store.add(k, 0)) for m, k in self.keys.items()})
        return self._silent


@dataclass(frozen=True)
class Circle:
    """Who meets, and where: a subgroup's store prefix and member ids (in subgroup rank order).

    ``subgroup``: also give up once this member's step has failed (a subgroup forms inside a step,
    whose failure the quorum's vote discards anyway), but not at a newer quorum: the step still
    commits then (its verdict names the newer quorum, adopted at the next step).
    """

    prefix: str
    members: tuple[int, ...]
    subgroup: bool = True


class Rendezvous:
    """The meeting of one quorum's members and the building of its gloo group (see the module docstring).

    Args:
        client: this member's connection to the coordinator.
        link: builds the quorum's process group (:meth:`shoal.membership.transport.Link.build`).
        q: the quorum.
        deadline: ``time.monotonic()`` past which this member stops waiting.
        window: ``Timeouts.probe``, the heartbeat judge's window.
        circle: a subgroup of ``q`` instead of the whole quorum (its own prefix and members); giving up on
            it dissolves ``q`` all the same (the step needs every subgroup).
    """

    def __init__(self, client: MemberClient, link: Link, q: Quorum, deadline: float, window: float,
                 circle: Circle | None = None) -> None:
        self.client, self.link, self.q, self.deadline = client, link, q, deadline
        self.circle = circle or Circle(q.prefix, q.members, subgroup=False)
        self.beats = Heartbeats(client, self.circle.members, window)

    def meet(self) -> str | None:
        """The store barrier: None once every member arrived, else why this member stopped waiting.

        :data:`SUPERSEDED`: a newer quorum exists. Any other answer (a lost
        member, a raised abort flag, this member's deadline) dissolves the
        quorum: this member's arrival is counted, so the others would pass
        the barrier and wait in the gloo constructor for it.
        """
        st, c = self.client.store, self.circle
        st.add(c.prefix + "arrive", 1)
        while st.add(c.prefix + "arrive", 0) < len(c.members):
            why = self._doomed()
            if why is not None:
                if why != SUPERSEDED:
                    self._dissolve(why)
                return why
            time.sleep(0.002)
        return None

    def build(self, rank: int, deadline: float | None = None) -> Any:
        """The circle's process group (``rank`` in it); raises PeerLostError (the quorum dissolved) if it
        cannot form. ``deadline``: a new one for the build (a subgroup's build has its own ``Timeouts.op``,
        as its barrier had); else the rendezvous's."""
        if deadline is not None:
            self.deadline = deadline
        box: dict[str, Any] = {}
        lock, done = threading.Lock(), threading.Event()

        def construct() -> None:
            try:
                pg = self.link.build(self.circle.prefix + "pg/", rank, len(self.circle.members))
            except Exception as e:  # noqa: BLE001 - handed to the training thread
                pg, box["error"] = None, e
            with lock:
                if not box.get("left"):
                    box["pg"] = pg   # else it is dropped here, in this thread, with its last reference
                    done.set()

        builder = threading.Thread(target=construct, name=f"shoal-build-q{self.q.qid}", daemon=True)
        builder.start()
        while not done.wait(0.005):
            try:
                why = self._doomed()
            except Exception as e:  # noqa: BLE001 - the coordinator's store is unreachable: gloo's own
                log.debug("rendezvous of quorum %d: %s", self.q.qid, e)   # timeout still ends the wait
                continue
            if why is None:
                continue
            with lock:
                if not done.is_set():   # else it has just finished: take what it built
                    box["left"] = True
                    LEFT_BEHIND.add(builder, 6 * self.link.timeouts.op)   # gloo retries a connect 5 x op
                    why = "a newer quorum was published" if why == SUPERSEDED else why
                    self._dissolve(why)
                    raise PeerLostError(f"gave up waiting for its members to connect: {why}")
        if box["pg"] is None:
            self._dissolve(str(box["error"]))
            raise PeerLostError(str(box["error"]))
        return box["pg"]

    def _doomed(self) -> str | None:
        """Why the group can no longer form, or None."""
        c, q = self.client, self.q
        if not self.circle.subgroup and c.latest() > q.qid:   # a subgroup forms inside q's step, which still
            return SUPERSEDED                                  # commits when a newer quorum is published
        if time.monotonic() > self.deadline:
            return ("this member's deadline to form a group passed (Timeouts.quorum, or Timeouts.join when fresh)"
                    if not self.circle.subgroup else "the subgroup did not form within Timeouts.op")
        if c.abort.raised(q.prefix):
            return "its abort flag is raised (a member gave up on it, or the coordinator dropped one)"
        if self.circle.subgroup and self.link.failures.error is not None:
            return f"this member's step already failed ({self.link.failures.error})"
        lost = self.beats.silent()
        if lost:
            return (f"member(s) {lost} stopped heartbeating for {self.beats.windows} x {self.beats.window} s "
                    "(Timeouts.probe)")
        return None

    def _dissolve(self, why: str) -> None:
        """Forbid the quorum any step (its abort flag) and ask the coordinator for the next one."""
        log.warning("member %d gave up forming the group of quorum %d: %s; asking the coordinator for the "
                    "next quorum", self.client.member_id, self.q.qid, why)
        try:
            dissolve(self.client.store, self.client, self.q, f"rendezvous: {why}")
        except Exception:  # noqa: BLE001 - the coordinator's store is down: the quorum is gone anyway
            self.client.abort.saw(self.q.prefix)
