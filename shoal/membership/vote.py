"""The end of an elastic step: the first failure, the run's abort flag, the commit vote, the discard limit.

Owned here, used by :class:`~shoal.membership.elastic.ElasticGroup` (and, through
it, by its subgroups, which share its :class:`Failures`):

:class:`Failures`
    This step's first failure (a :class:`~shoal.errors.PeerLostError` or
    :class:`~shoal.errors.CommTimeoutError`). Recording one also raises the
    quorum's abort flag (``<prefix>abort`` in the coordinator's store), which
    every member's heartbeat thread watches, so that the others give up this
    step's collectives at once instead of waiting out ``Timeouts.op``.
:class:`Ballot`
    The commit vote through the store: each member that saw no failure adds
    one to ``<prefix>ok/<step>``; the member whose add completes the count
    writes ``commit`` to ``<prefix>d/<step>`` with compare-and-set; a member
    that failed, sees the abort flag, or waits past ``Timeouts.quorum``, writes
    ``discard`` the same way. The first write wins, so every member reads one
    decision. Decisions are signed by their writer (:mod:`shoal.membership.records`);
    one that does not verify reads as ``discard`` everywhere.

    While the coordinator is down (its store unreachable) the vote goes peer
    to peer over the quorum's own process group instead (:func:`peer_vote`),
    for the rest of that quorum; see docs/elastic.md, "When the coordinator fails".
:class:`DiscardStreak`
    Why each step since the last commit was discarded; once
    ``Timeouts.max_consecutive_discards`` steps in a row were, every member
    raises (the streak travels with the healed state, so newcomers agree).

Example (what :meth:`ElasticGroup.commit` does with them)::

    verdict = ballot.vote(quorum, step, size)     # "commit:<latest qid>" or "discard"
    if not verdict.startswith("commit"):
        streak.count(failures.error, aborted, limit)   # raises PeerLostError at the limit
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import Counter
from typing import Any, Callable

import torch

from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, Timeouts, Trace
from shoal.errors import PeerLostError

log = logging.getLogger("shoal.elastic")


class Failures:
    """This step's first failure, shared by a quorum group and its subgroups (see the module docstring).

    Args:
        client: the member's connection to the coordinator (its store holds the abort flag).
        prefix: returns the current quorum's store prefix (``None`` between quorums: no flag to raise).
        trace: where the first failure is logged for post-mortems.
    """

    def __init__(self, client: MemberClient, prefix: Callable[[], str | None], trace: Trace) -> None:
        self.error: BaseException | None = None
        self.client = client
        self._prefix = prefix
        self.trace = trace      # also the subgroups', which log their formation to it
        self._lock = threading.Lock()
        self._abort_store = client.store.clone()  # type: ignore[attr-defined]
        self._abort_of = client.store   # the store it was cloned from (a restarted coordinator: a new one)
        self.on_failure: list[Callable[[], None]] = []   # called at each step's first failure, on the recording
        # thread (e.g. the paced heal's pause: shoal.membership.pace); quick, and never raising

    @property
    def aborted(self) -> bool:
        """Whether another member raised this quorum's abort flag (never an older quorum's: see AbortWatch)."""
        return self.client.abort.raised(self._prefix())

    def record(self, err: BaseException) -> None:
        """Keep ``err`` if it is this step's first failure, and raise the quorum's abort flag."""
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
        if not first:
            return
        self.trace("error", what=str(err)[:200])
        prefix = self._prefix()
        if prefix is not None:
            try:
                with self._lock:
                    if self._abort_of is not self.client.store:
                        self._abort_of = self.client.store
                        self._abort_store = self._abort_of.clone()  # type: ignore[attr-defined]
                    self._abort_store.set(prefix + "abort", type(err).__name__)
            except Exception:  # noqa: BLE001 - coordinator unreachable: peers time out instead
                pass
        for fn in self.on_failure:   # after the flag: telling the others comes first
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a listener's error must not hide the step's failure
                log.warning("a step-failure listener raised %s: %s", type(e).__name__, e)


class Ballot:
    """The commit vote of one member (see the module docstring)."""

    def __init__(self, client: MemberClient, timeouts: Timeouts, failures: Failures,
                 group: Callable[[], tuple[Any, int, torch.device]] | None = None) -> None:
        self.client, self.timeouts, self.failures = client, timeouts, failures
        self.group = group   # (process group, rank, device) of the current quorum: for peer_vote

    def vote(self, q: Quorum, step: int, size: int) -> str:
        """``"commit:<latest quorum id>"`` or ``"discard"``: the same string on every member of ``q``
        (without the coordinator: see :func:`peer_vote` for what a peer lost during the vote does)."""
        if self.client.dropped_prefix == q.prefix:
            return "discard"                  # the coordinator dropped this quorum: rejoin, never commit on it
        alone = self.failures.error is None and size == 1
        if alone and self.client.lost_prefix == q.prefix:
            return f"commit:{q.qid}"          # the coordinator is down: a quorum of one trains on
        if self.client.lost_prefix == q.prefix and self.group is not None:
            return self._by_peers(q, step, size)
        try:
            return self._by_store(q, step, size)   # reads the quorum's abort flag before any commit
        except Exception:  # noqa: BLE001 - the coordinator's store went away during the vote
            if self.group is None:
                return "discard"
            self.client.lost_prefix = q.prefix
            return f"commit:{q.qid}" if alone else self._by_peers(q, step, size)

    def _by_peers(self, q: Quorum, step: int, size: int) -> str:
        if self.group is None or self.failures.error is not None:
            return "discard"
        pg, rank, device = self.group()
        if pg is None:
            return "discard"
        return peer_vote(pg, rank, size, step, self.client.latest_or(q.qid), device, self.timeouts.op)

    def _by_store(self, q: Quorum, step: int, size: int) -> str:
        st, key = self.client.store, f"{q.prefix}d/{step}"
        failures = self.failures
        if failures.error is None and size == 1:
            return "discard" if self._dissolved(q) else f"commit:{self.client.latest()}"
        if failures.error is not None:
            return self.decide(key, "discard")
        if st.add(f"{q.prefix}ok/{step}", 1) == size:
            return self.decide(key, "discard" if self._dissolved(q) else f"commit:{self.client.latest()}")
        start = time.monotonic()
        deadline, pause, beats = start + self.timeouts.quorum, 5e-5, self._beats(q)
        next_probe = start + self.timeouts.probe
        while not st.check([key]):
            now = time.monotonic()
            if now > next_probe:
                # A peer that died after its last collective never votes; its
                # heartbeat stops too. Judge it here rather than wait for the
                # coordinator's heartbeat_timeout.
                latest, next_probe = self._beats(q), now + self.timeouts.probe
                if any(a == b for a, b in zip(beats, latest)):
                    failures.record(PeerLostError("a member stopped heartbeating before voting"))
                beats = latest
            if failures.error is not None or failures.aborted or now > deadline:
                return self.decide(key, "discard")
            time.sleep(pause)
            pause = min(2 * pause, 0.001)   # the decision is read at most ~1 ms late (a store RTT is ~15 us)
        return self.decision(st.get(key))

    def _dissolved(self, q: Quorum) -> bool:
        """Whether ``q``'s abort flag is raised: a member failed, or the coordinator dropped one.

        Read in the store, not from the heartbeat thread's watch, before any commit is decided. A
        quorum cut off whole from the coordinator (all its members behind a link that went down, or
        a quorum of one) has nobody on the coordinator's side to write ``discard`` first; when the
        link returns its votes would complete the count, and it would commit a step of a quorum
        the coordinator has dropped while the run went on without it (a split brain).
        """
        return bool(self.client.store.check([q.prefix + "abort"]))

    def decide(self, key: str, verdict: str) -> str:
        """Write ``verdict`` as the step's decision unless one is there; return the one that stands.

        Signed by this member (:mod:`shoal.membership.records`): a decision written by someone without the
        run token (say a forged ``commit`` for a step that failed) reads as ``discard`` on every member.
        """
        return self.decision(self.client.store.compare_set(key, "", self.client.book.seal({"d": verdict})))

    def decision(self, raw: Any) -> str:
        """The verdict a signed decision record holds (``discard`` if it does not verify)."""
        rec = self.client.book.open(raw, kind="vote")
        d = rec.get("d") if rec is not None else None
        return d if isinstance(d, str) and (d == "discard" or d.startswith("commit:")) else "discard"

    def _beats(self, q: Quorum) -> list[bytes]:
        return list(self.client.store.multi_get([self.client.key(f"hb/{m}") for m in q.members]))


_VOTE_TAG = 1 << 29   # p2p tags of peer votes: above any slot the heal uses; two per step (in, out)


def peer_vote(pg: Any, rank: int, size: int, step: int, latest: int, device: torch.device, timeout: float) -> str:
    """The commit vote without the coordinator, over the quorum's process group (each member calls it).

    Called only by members that saw no failure in the step (one that did votes ``discard`` alone and
    sends nothing, so the others' wait fails). Rank 0 receives every other member's newest known
    quorum id, decides ``commit:<max>`` if it received all of them, and sends that one decision to
    each; a member that does not receive it (a peer lost during the vote, ``timeout`` passed) returns
    ``discard``. So every member that returns ``commit`` read the same decision, but a peer lost in
    the middle can leave some members with ``commit`` and others with ``discard``. That is safe: the
    ones that discarded cannot go on without a new quorum, those that committed fail their next step
    (the others no longer take part), and the next quorum, which needs the coordinator back, heals
    every member to the furthest committed step (heals go by committed step), so all survivors hold
    one state again. The p2p tags carry the step, so messages of two different steps never match.

    Example::

        verdict = peer_vote(pg, rank=0, size=3, step=12, latest=4, device=torch.device("cpu"), timeout=20)
    """
    slot = _VOTE_TAG + 2 * (step % (1 << 20))
    wait = datetime.timedelta(seconds=timeout)
    try:
        if rank != 0:
            pg.send([torch.tensor([latest], dtype=torch.int64, device=device)], 0, slot).wait(wait)
            out = torch.zeros(1, dtype=torch.int64, device=device)
            pg.recv([out], 0, slot + 1).wait(wait)
            top = int(out.item())
            return f"commit:{top}" if top >= 0 else "discard"
        top = latest
        for r in range(1, size):
            got = torch.zeros(1, dtype=torch.int64, device=device)
            pg.recv([got], r, slot).wait(wait)
            top = max(top, int(got.item()))
    except Exception:  # noqa: BLE001 - a peer was lost or timed out: this member cannot know the verdict
        if rank != 0:
            return "discard"
        top = -1      # rank 0 missed a member's vote: it tells the others to discard (those it still reaches)
    decision = torch.tensor([top], dtype=torch.int64, device=device)
    works = []
    for r in range(1, size):
        try:
            works.append(pg.send([decision], r, slot + 1))
        except Exception:  # noqa: BLE001 - that peer is gone; the others still get the decision
            pass
    for w in works:
        try:
            w.wait(wait)
        except Exception:  # noqa: BLE001 - as above: rank 0's decision stands (see the docstring)
            pass
    return f"commit:{top}" if top >= 0 else "discard"


class DiscardStreak:
    """Why each step since the last commit was discarded, and the limit on how many in a row.

    Retrying cannot cure a failure that repeats at every step (a deterministic
    error, a NaN reported every step): without a limit the run would loop
    forever without training. Every member of a quorum reads the same
    verdicts, and the streak is healed into newcomers (register :meth:`state`
    and :meth:`load`), so all members raise at the same step.
    """

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def state(self) -> dict[int, str]:
        """The streak, as healed into newcomers: ``{position: reason}``.

        A dict, not a list: the received-state check refuses a list whose
        length differs from the receiver's own (:mod:`shoal.membership.received`),
        and a member that discarded steps and then rejoins (a partition, a
        probe it missed) legitimately holds a streak of another length than
        its healer's.
        """
        return dict(enumerate(self.reasons))

    def load(self, reasons: dict[int, str] | list[str]) -> None:
        """Take a peer's streak (from a heal, or this member's own rollback snapshot)."""
        items = [reasons[k] for k in sorted(reasons)] if isinstance(reasons, dict) else list(reasons)
        self.reasons = [str(r) for r in items]

    def reset(self) -> None:
        """A step committed: the streak ends."""
        self.reasons = []

    def count(self, error: BaseException | None, aborted: bool, limit: int) -> None:
        """Add a discarded step; raise PeerLostError once ``limit`` steps in a row were discarded."""
        if error is not None:
            why = f"{type(error).__name__}: {error}"
        elif aborted:
            why = "another member reported a failure"
        else:
            why = "another member voted to discard (or the vote outlasted Timeouts.quorum)"
        self.reasons.append(why[:300])
        if len(self.reasons) < limit:
            return
        seen = Counter(self.reasons).most_common(3)
        raise PeerLostError(
            f"{len(self.reasons)} steps in a row were discarded (Timeouts.max_consecutive_discards="
            f"{limit}): the failure repeats at every step, so retrying cannot help; fix its cause (or raise the "
            "limit if peers are lost that often). Reasons seen by this member: "
            + "; ".join(f"{why} (x{n})" for why, n in seen))
