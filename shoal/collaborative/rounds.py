"""Matchmaking: who averages an epoch, and the gloo group they do it in.

An epoch's averaging is done by the peers that are *ready* within the
matchmaking window, not by a fixed membership: a slow or dead peer must not
hold the others. Under ``<run_id>/mm/<epoch>/<attempt>/`` each ready peer
takes a slot (``n`` counter, ``s/<k>`` = its id and role). The window opens
when the first contributing peer registers and closes when every live peer
(the coordinator's current members, less those whose heartbeat has stopped
for half the heartbeat timeout) is ready, or after ``matchmaking_time``. Whoever
closes it writes the member list with compare-and-set, so every peer reads
the same list. Peers left out were too late: the swarm moved on without them.

Slots, member lists and the last committed group are signed by their writer
(:mod:`shoal.collaborative.records`): a slot counts only if its writer
registers itself, and a member list that does not verify ends the attempt
for this peer as a failed one.

Members are ordered full peers first, then client-mode peers, each by id, so
that the lowest-ranked up-to-date member, which sends state to peers that
need it, is a client only when nobody else can.

The group itself is an :class:`~shoal.membership.elastic.ElasticGroup`
(``RoundGroup.group``, held, not inherited) entered with the round's member
list as its quorum (:meth:`~shoal.membership.elastic.ElasticGroup.enter_quorum`):
it rendezvous under a fresh prefix, records failures instead of raising, and
votes commit/discard through the store
(:meth:`~shoal.membership.elastic.ElasticGroup.vote_quorum`). When a round has the same members as the last committed
one, the closer names that round's prefix and everybody reuses the group
already built (no reconnection on a steady swarm).

Example::

    group = RoundGroup(cfg, info={"role": "peer"})
    q = group.matchmake(epoch=3, attempt=0, contributing=True, excluded=set(), deadline=t)
    if q is not None and group.enter(q, deadline=t):
        group.group.all_reduce(t, op="avg", tag="round").wait(); group.vote()
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from shoal.collaborative.records import RecordBook
from shoal.membership.elastic import ElasticGroup
from shoal.comm.group import Group
from shoal.comm.meter import Meter
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Quorum, Timeouts
from shoal.errors import ConfigError, ShoalError

log = logging.getLogger("shoal.collaborative")

_POLL_S = 0.002
MAX_SKIPPED = 16   # attempts of one epoch closed without a trusted peer before this peer steps alone
_QID = 1 << 60     # above any coordinator quorum id: ElasticGroup gives up a rendezvous when a newer one exists


def _coordinator_address(coordinator: str | None) -> str:
    address = coordinator or os.environ.get("SHOAL_COORDINATOR")
    if not address:
        raise ConfigError("no coordinator: set CollaborativeConfig(coordinator='host:port') or $SHOAL_COORDINATOR")
    return address


def as_group(group: ElasticGroup) -> Group:
    """``group`` where a :class:`~shoal.comm.Group` is expected (e.g. a codec's ``mean``): an elastic group
    is a registered virtual subclass of Group, which the type checker does not follow."""
    return cast(Group, group)


@dataclass
class RoundReport:
    """What one epoch's averaging did (``CollaborativeOptimizer.last_round``)."""

    epoch: int
    outcome: str                 # "averaged" (with other peers), "local" (timed out, or no other peer was
                                 # ready: peers == 1), "loaded" (state received), "behind" (closed without it)
    peers: int = 1
    samples: int = 0
    seconds: float = 0.0
    excluded: tuple[int, ...] = ()   # member ids excluded from the round
    own_samples: int = 0             # this peer's weight in the round (0: auxiliary, behind, NaN)
    source: int | None = None        # member id that sent state in this round, if any did


class RoundGroup:
    """Matchmaking, and the :class:`ElasticGroup` (``.group``) whose quorums it forms (see the module docstring).

    The collectives of a round go to ``.group``; :attr:`rank`, :attr:`size`,
    :attr:`quorum`, :attr:`error`, :attr:`meter` and :attr:`device` are the group's.
    """

    def __init__(self, run_id: str, coordinator: str | None, timeouts: Timeouts, token: str | None,
                 matchmaking_time: float, role: dict[str, Any]) -> None:
        self.client = MemberClient(_coordinator_address(coordinator), run_id, timeouts, 1, role, token=token)
        # Every round ends in its own vote, never in a step of the group: no orderly-leave counting (each
        # member would publish its collective count at begin_step, which a round never calls, and leave()
        # would wait Timeouts.quorum for peers that never publish).
        self.group = ElasticGroup(run_id, coordinator=self.client.address, timeouts=timeouts, min_workers=1,
                                  client=self.client, orderly_leave=False)
        self.mm_store = self.client.store.clone()  # type: ignore[attr-defined]
        self.matchmaking_time = matchmaking_time
        self.role = role
        self.client.join()
        # Slots, member lists and the last group are signed by their writer (records.py).
        self.book = RecordBook(self.mm_store, run_id, self.client.member_id, token)
        self._members_cache: tuple[int, set[int]] = (-1, set())
        self._hb_seen: dict[int, tuple[bytes, float]] = {}
        self.last_wait = 0.0
        # A heartbeat thread can starve for a while on a loaded machine: half the heartbeat
        # timeout tells a dead peer from a busy one without waiting for the coordinator's verdict.
        self.silence = max(timeouts.probe, timeouts.heartbeat_timeout / 2)
        self.gave_up = False
        self.skipped = False     # the last matchmake found a list made only of banned members (see matchmake)
        self.banned: set[int] = set()
        self._admitted_ids: set[int] = set()

    def key(self, k: str) -> str:
        return self.client.key(k)

    # --- the group's, read-only ------------------------------------------------
    @property
    def rank(self) -> int:
        """This peer's rank in the round's group."""
        return self.group.rank

    @property
    def size(self) -> int:
        """The number of peers in the round's group."""
        return self.group.size

    @property
    def quorum(self) -> Quorum | None:
        """The round's member list, as the group's quorum (None between rounds)."""
        return self.group.quorum

    @property
    def error(self) -> BaseException | None:
        """This round's first failure, or None."""
        return self.group.error

    @property
    def meter(self) -> Meter:
        """Where the round's collectives are counted."""
        return self.group.meter

    @property
    def device(self) -> torch.device:
        """Where the round's collectives take tensors."""
        return self.group.device

    def leave(self, finished: bool | None = None) -> None:
        """Leave the run (see :meth:`ElasticGroup.leave`)."""
        self.group.leave(finished)

    # --- who is alive ------------------------------------------------------
    def live_members(self) -> set[int]:
        """The coordinator's current members (authenticated, heartbeating), this peer included."""
        latest = self.client.latest()
        if latest != self._members_cache[0]:
            members = set(self.client.quorum(latest).members) if latest > 0 else set()
            self._members_cache = (latest, members)
        return self._members_cache[1] | {self.client.member_id}

    def _silent(self, ids: set[int], now: float) -> set[int]:
        """Ids whose heartbeat has not advanced for ``probe`` seconds (or that left)."""
        order = sorted(ids)
        if not order:
            return set()
        beats = self.mm_store.multi_get([self.key(f"hb/{i}") for i in order])
        out = set()
        for i, b in zip(order, beats):
            prev = self._hb_seen.get(i)
            if prev is None or prev[0] != b:
                self._hb_seen[i] = (b, now)
            elif now - prev[1] > self.silence:
                out.add(i)
            if b.strip() == b"-1":
                out.add(i)
        return out

    def live_others(self) -> set[int]:
        """The other peers that may still be in the swarm: listed, admitted since the list, or in the
        last committed round, heartbeating (a peer that left says so at once) and not banned."""
        others = (self.live_members() | self._unlisted() | self._last_members()) - {self.client.member_id}
        return others - self.banned - self._silent(others, time.monotonic())

    def ban(self, ids: set[int]) -> None:
        """Leave members out of every later round: they broke the round protocol (validate.py's header
        rules: another model's layout, an impossible weight or epoch, a forged id), which no honest
        peer does, so no later round of theirs is one this peer waits for, averages in, or follows."""
        self.banned |= ids - {self.client.member_id}

    def first_open_epoch(self, start: int) -> int:
        """The first epoch from ``start`` on whose round has no member list yet (rounds close in epoch order)."""
        def closed(e: int) -> bool:
            return bool(self.mm_store.check([self.key(f"mm/{e}/0/members")]))
        if not closed(start):
            return start
        lo, step = start, 1              # lo is closed; find an open one by doubling, then bisect
        while closed(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if closed(mid) else (lo, mid)
        return hi

    def _unlisted(self) -> set[int]:
        """Members admitted after the newest member of the coordinator's latest list: ids are given
        in join order, so those are the joins the list does not show yet. Call after live_members()."""
        listed = self._members_cache[1]
        top = int(self.mm_store.add(self.key("next_id"), 0))
        first = max(listed) + 1 if listed else 1
        return {i for i in range(first, top + 1) if i != self.client.member_id and self._admitted(i)}

    def _admitted(self, i: int) -> bool:
        """Whether member ``i`` was admitted by the coordinator (its quorum record may lag by ``join_grace``)."""
        if i in self._admitted_ids:
            return True
        key = self.key(f"auth/{i}/verdict") if self.client.token is not None else self.key(f"join/{i}")
        ok = self.mm_store.check([key]) and (self.client.token is None or self.mm_store.get(key) == b"ok")
        if ok:
            self._admitted_ids.add(i)
        return ok

    # --- matchmaking ---------------------------------------------------------
    def matchmake(self, epoch: int, attempt: int, contributing: bool, excluded: set[int],
                  deadline: float) -> Quorum | None:
        """Register as ready for the round and wait for its member list; None if left out.

        ``excluded`` and :attr:`banned` members are neither waited for nor listed by this peer. A list
        that another peer closed with banned members only (a banned peer that ran ahead and closed the
        round alone), or with nobody (a peer gave up on a window nobody contributed to), is not the
        swarm moving on without this peer: None, with :attr:`skipped` set, and the caller tries the
        next attempt of the same epoch with the peers it trusts.
        """
        st, base, me = self.mm_store, self.key(f"mm/{epoch}/{attempt}/"), self.client.member_id
        excluded = excluded | self.banned
        t0 = time.monotonic()
        self.gave_up = self.skipped = False
        slot = int(st.add(base + "n", 1))
        rec = {"id": me, "c": int(contributing), "cl": int(bool(self.role.get("client")))}
        st.set(base + f"s/{slot}", self.book.seal(rec))
        opened: float | None = None
        recent = self._last_members()
        while not st.check([base + "members"]):
            now = time.monotonic()
            n = int(st.add(base + "n", 0))
            ready: dict[int, dict[str, int]] = {}
            for raw in st.multi_get([base + f"s/{k}" for k in range(1, n + 1)]):
                r = self.book.open(raw, kind="matchmaking slot")
                try:
                    if r is not None and r["id"] == r["by"]:   # a member registers itself only
                        ready[int(r["id"])] = {"c": int(r["c"]), "cl": int(r["cl"])}
                except (ValueError, KeyError, TypeError):
                    continue   # a malformed slot is ignored, not trusted
            live = self.live_members()
            ready = {i: r for i, r in ready.items() if (i in live or self._admitted(i)) and i not in excluded}
            if opened is None and any(r["c"] for r in ready.values()):
                opened = now
            # The coordinator's list lags a join by its grace period (and a run's first list waits for
            # all of its initial workers): peers of the last round and peers admitted since the list
            # are expected too, else the first peer ready closes a window the others were about to enter.
            known = live | recent | self._unlisted()
            expected = known - excluded - self._silent(known - set(ready) - {me}, now)
            everyone = expected <= set(ready)
            if opened is not None and (everyone or now - opened >= self.matchmaking_time):
                log.debug("closing %s: ready %s, live %s (quorum %d), expected %s", base, sorted(ready), sorted(live), self._members_cache[0],
                          sorted(expected))
                self._close(base, ready, None, reuse=attempt == 0)
                break
            if now > deadline:
                self._close(base, ready, me, reuse=attempt == 0)   # give up: close the round without this peer
                self.gave_up = True
                break
            time.sleep(_POLL_S)
        self.last_wait = time.monotonic() - t0
        record = self._signed(st.get(base + "members"), "member list")
        if not isinstance(record.get("members"), list) or not isinstance(record.get("prefix"), str):
            log.warning("epoch %d: the member list of %s is not one a member wrote; no averaging this attempt",
                        epoch, base)
            self.gave_up = True
            return None
        members = tuple(int(m) for m in record["members"])
        if me not in members:
            if set(members) <= excluded:     # nobody, or nobody this peer trusts, averaged in it
                log.debug("epoch %d: %s closed with %s only: trying the next attempt", epoch, base,
                          f"banned members {list(members)}" if members else "no member")
                self.skipped = True
            return None
        return Quorum(_QID + epoch * 1000 + attempt, members, str(record["prefix"]))

    def skip_backoff(self, skips: int) -> float | None:
        """Seconds to wait before the next attempt of an epoch whose last ``skips`` attempts were closed
        without a peer this one trusts (:attr:`skipped`), or None: stop trying, step with local gradients.

        A banned peer can close any number of an epoch's attempts alone, ahead of the others (one
        compare-and-set each): tried back to back, each costs an honest peer a few store requests and
        nothing else, until ``averaging_timeout``. So the waits double from the poll interval up to half
        the matchmaking window (the honest peers skip the same attempts, so they stay in step), and after
        :data:`MAX_SKIPPED` of them the epoch ends in a local step, as a round that timed out does.

        Example::

            group.skip_backoff(1)              # 0.004: the first skip is tried again at once
            group.skip_backoff(MAX_SKIPPED)    # None: give up on averaging this epoch
        """
        if skips >= MAX_SKIPPED:
            return None
        return min(self.matchmaking_time / 2, _POLL_S * 2.0 ** skips)

    def _last_members(self) -> set[int]:
        last = self.key("mm/last")
        if not self.mm_store.check([last]):
            return set()
        try:
            return {int(m) for m in self._signed(self.mm_store.get(last), "last group").get("members", [])}
        except (ValueError, TypeError, AttributeError):
            return set()

    def _close(self, base: str, ready: dict[int, dict[str, int]], without: int | None, reuse: bool) -> None:
        """Write the attempt's member list (compare-and-set: the first closer's list is everybody's).

        ``reuse``: name the last committed round's group when the members are the same, so nobody
        reconnects. Only a first attempt may: a later one follows an attempt whose group its members
        entered and dropped, so they no longer hold the last committed group, and the record that
        says so (:meth:`drop` clears it) may not be written yet when the list is closed. Naming that
        group again would make them rendezvous twice under one prefix, which hangs.
        """
        members = sorted((i for i in ready if i != without), key=lambda i: (ready[i]["cl"], i))
        prefix = f"{base}g/"
        last = self.key("mm/last")
        if reuse and self.mm_store.check([last]):
            prev = self._signed(self.mm_store.get(last), "last group")
            if prev.get("members") == members and isinstance(prev.get("prefix"), str):
                prefix = str(prev["prefix"])          # same peers as the last good round: reuse its group
        self.mm_store.compare_set(base + "members", "", self.book.seal({"members": members, "prefix": prefix}))

    def _signed(self, raw: bytes, kind: str) -> dict[str, Any]:
        """A signed record of the store, or {} if it does not verify (logged by the book)."""
        return self.book.open(raw, kind=kind) or {}

    # --- the group of a round ------------------------------------------------
    def enter(self, q: Quorum, deadline: float) -> bool:
        """Use the round's group: the current one if the prefix is the same, else build it."""
        return self.group.enter_quorum(q, deadline)

    def vote(self, keep: bool = True) -> bool:
        """Commit (True) or discard, the same on every member; on discard the group is dropped.

        ``keep``: a committed round's group is published for reuse by the next round.
        """
        q = self.group.quorum
        if q is None:
            raise ShoalError("vote() outside a round")
        if self.group.vote_quorum():
            if keep and self.group.rank == 0:
                self.mm_store.set(self.key("mm/last"), self.book.seal({"members": list(q.members), "prefix": q.prefix}))
            return True
        self.drop()
        return False

    def drop(self) -> None:
        """Abandon the current group (never reused again)."""
        if self.group.quorum is not None and self.group.rank == 0:
            self.mm_store.set(self.key("mm/last"), self.book.seal({}))
        self.group.abandon()
