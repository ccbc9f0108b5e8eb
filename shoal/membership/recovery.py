"""A restarted coordinator learns the run from its live members (the coordinator's side of a recovery).

The coordinator keeps everything in its store, and a restarted one starts
with an empty store. The members re-announce themselves
(:mod:`shoal.membership.reclaim`): each claims its member id, proves it holds
the run token (a fresh challenge under ``claim/<id>/``), and hands in the last
quorum it was in, as the old coordinator signed it. :class:`Recovery` checks
each claim and admits the member under its old id; it never accepts a
claim that does not verify (a wrong proof is denied, a quorum record without
the coordinator's signature is refused), so a stranger cannot make itself a
member.

While claims come in, no quorum is published: the coordinator waits until
every member of the newest quorum claimed (or ``Timeouts.heartbeat_timeout``
since the first claim: the missing ones are taken for dead). Then it
publishes a *new* quorum (the newest claimed id + 1) of the members it
admitted, so that every member moves to it at the same step and the run goes
on with no worker restarted; a member that was lost meanwhile is left out and
the others are healed to one state. A standalone coordinator (``shoal
coordinator``) also waits ``CLAIM_GRACE_S`` after its start before it
publishes a run's first quorum (``Coordinator(claim_grace=...)``), so that a
surviving run's members are back before a newcomer could start one alone.

Ids: the first verified claim raises ``next_id`` above every member of the
quorum it hands in, so a newcomer never takes the id of a member that is yet
to re-announce itself. Before it (a newcomer that joins a restarted
coordinator before any member is back) a claim wins over a join of the same
id whose proof is not verified yet (the joiner is told ``taken`` and takes a
new id); a join already verified wins over a later claim (the claimer joins
anew, at the new coordinator, and is healed).

Example (inside :meth:`Coordinator._tick_run`)::

    run.recovery.tick(store, run, token, now, admit)
    if run.recovery.holding(run, now, timeouts.heartbeat_timeout, born + claim_grace): return
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from shoal.membership import auth

CLAIM_GRACE_S = 1.0   # a fresh coordinator's wait for survivors before it publishes a run's first quorum
log = logging.getLogger("shoal.elastic")


def quorum_text(qid: int, members: tuple[int, ...] | list[int], prefix: str) -> str:
    """What the coordinator signs of a quorum record."""
    return f"{qid}|{','.join(str(m) for m in members)}|{prefix}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Recovery:
    """One run's claims at a (restarted) coordinator; see the module docstring."""

    def __init__(self) -> None:
        self.seen = 0                      # claims read so far (``claims/n``)
        self.pending: set[int] = set()     # claimed ids not yet admitted nor refused
        self.claiming: set[int] = set()    # ids a claim holds: joins of these ids are refused
        self.nonces: dict[int, str] = {}
        self.verified: set[int] = set()
        self.admitted: set[int] = set()
        self.first: float | None = None    # when the first claim was admitted
        self.top = 0                       # the newest quorum id claimed
        self.expect: set[int] = set()      # its members
        self.done = False

    def tick(self, st: Any, run: Any, token: str | None, now: float, admit: Callable[[int, dict[str, Any]], None]) -> None:
        """Read new claims and advance each one (challenge, proof, records, admission)."""
        n = int(st.add(run.key("claims/n"), 0))
        while self.seen < n:
            self.seen += 1
            raw = _text(st.get(run.key(f"claims/{self.seen}")))
            if raw.isdigit():
                self.pending.add(int(raw))
        for i in sorted(self.pending):
            base = run.key(f"claim/{i}/")
            if i in run.members or i in run.authed:
                st.set(base + "verdict", "taken")   # a newcomer that proved itself holds the id
                self.pending.discard(i)
                continue
            self.claiming.add(i)
            if i not in self.verified and not self._verify(st, run, token, i, base):
                continue
            self._admit(st, run, token, i, now, admit)

    def _verify(self, st: Any, run: Any, token: str | None, i: int, base: str) -> bool:
        if token is not None:
            if i not in self.nonces:
                self.nonces[i] = auth.new_nonce()
                st.set(base + "nonce", self.nonces[i])
                return False
            if not st.check([base + "proof"]):
                return False
            if not auth.verify(token, f"{run.run_id}/{i}/claim", self.nonces[i], _text(st.get(base + "proof"))):
                log.warning("run %s: refused a claim of member id %d: its proof of the run token is wrong",
                            run.run_id, i)
                self._refuse(st, i, base, "denied")
                return False
            st.set(run.key(f"auth/{i}/nonce"), self.nonces[i])   # the member's new session key derives from it
        self.verified.add(i)
        st.set(base + "verdict", "ok")
        return True

    def _refuse(self, st: Any, i: int, base: str, why: str) -> None:
        st.set(base + "verdict", why)
        self.pending.discard(i)
        self.claiming.discard(i)

    def _admit(self, st: Any, run: Any, token: str | None, i: int, now: float,
               admit: Callable[[int, dict[str, Any]], None]) -> None:
        keys = [run.key(f"join/{i}"), run.key(f"claimrec/{i}")]
        if not st.check(keys):
            return
        info = run.book.open(st.get(keys[0]), writer=i, kind="join")
        claim = run.book.open(st.get(keys[1]), writer=i, kind="claim")
        if info is None or claim is None:
            return      # not (yet) the member's own records: a stranger's writes are ignored
        q = claim.get("quorum")
        try:
            qid, members, prefix = int(q["qid"]), [int(m) for m in q["members"]], str(q["prefix"])
        except (TypeError, KeyError, ValueError):
            qid, members, prefix = 0, [], ""
        signed = token is None or auth.verify(token, "record", quorum_text(qid, members, prefix), str(q.get("mac", "")))
        if not signed or i not in members or qid < 1:
            log.warning("run %s: refused the claim of member %d: its quorum record is not one the coordinator "
                        "signed with the run token", run.run_id, i)
            self._refuse(st, i, run.key(f"claim/{i}/"), "denied")
            return
        self.pending.discard(i)
        self.admitted.add(i)
        run.pending_join.discard(i)
        run.authed.add(i)
        admit(i, info)
        # Above every member of the quorum it hands in, not only its own id: a newcomer must not take the id of
        # a member yet to re-announce itself (that one would be told "taken" and had to join anew).
        top = max([i, *members])
        cur = int(st.add(run.key("next_id"), 0))
        if cur < top:
            st.add(run.key("next_id"), top - cur)
        if self.first is None:
            self.first = now
        if qid > self.top:
            self.top, self.expect = qid, set(members)
        if self.done:
            run.qid = max(run.qid, qid)
        log.warning("run %s: member %d re-announced itself (it was in quorum %d)", run.run_id, i, qid)

    def holding(self, run: Any, now: float, patience: float, grace_until: float) -> bool:
        """Whether the run's next quorum must wait for more claims (see the module docstring)."""
        if self.first is None:
            return run.qid == 0 and now < grace_until
        if self.done:
            return False
        if not self.expect <= self.admitted and now - self.first < patience:
            return True
        self.done = True
        run.qid, run.current = max(run.qid, self.top), ()
        missing = sorted(self.expect - self.admitted)
        log.warning("run %s recovered from its members: %s re-announced%s; publishing quorum %d",
                    run.run_id, sorted(self.admitted), f", {missing} did not (left out)" if missing else "",
                    run.qid + 1)
        return False
