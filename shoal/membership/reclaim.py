"""A worker re-announces itself to a restarted coordinator (the worker's side of a recovery).

A coordinator that was restarted at the same address has an empty store. Each
worker's heartbeat thread (:class:`~shoal.membership.client.MemberClient`)
notices the outage, waits until the address answers again, and then calls
:func:`reclaim` with its member id:

1. it registers the run again and raises ``next_id`` to at least its id, so
   that a newcomer never takes an id a live member holds;
2. it claims its id (``claims/n``, ``claims/<k>``) and answers the
   coordinator's fresh challenge under ``claim/<id>/`` with
   ``HMAC(token, run/id/claim, nonce)``: only a holder of the run token can
   claim an id, and a proof cannot be replayed (a new nonce each time);
3. it writes again its join record and a claim record (``claimrec/<id>``)
   holding the last quorum record it was in, with the coordinator's signature
   of it; both are sealed with the session key of the new challenge.

The coordinator (:mod:`shoal.membership.recovery`) admits the claim only if
every check passes: a stranger can neither claim an id nor invent a quorum.

Example (what the heartbeat thread does once the address answers)::

    verdict = reclaim(client, client.member_id, stop)   # "ok", LEFT, or why the id was not taken back
"""

from __future__ import annotations

import threading
import time
from typing import Any

from shoal.errors import ShoalError
from shoal.membership import auth
from shoal.membership.coordinator import _TICK_S, _s, connect, log
from shoal.membership.records import RecordBook

LEFT = "left"   # reclaim's verdict when the member left while it re-announced it: the client is unchanged


def reclaim(client: Any, member_id: int, stop: threading.Event) -> str:
    """Re-announce ``member_id`` of ``client`` (a MemberClient) to a restarted coordinator.

    Returns ``"ok"`` (the client's store and record book now point at the new
    store) or the coordinator's reason for not taking the id back (``"taken"``,
    ``"denied"``, ``"no quorum"``): the caller then joins anew. ``stop`` is the
    calling heartbeat thread's: set (by ``client.leave()``, which does not wait
    for a re-announcement to end) before the client could be changed, it
    returns :data:`LEFT` and leaves the client as it is, since the member may
    have joined anew under another id meanwhile; the id it re-announced is
    ended at the new coordinator, as leave() would have, and its connection
    dropped.
    """
    if client._last_q is None:
        return "no quorum"          # never in a quorum: nothing to reclaim, a plain join does
    st = connect(client.address, client.timeouts.quorum)
    run = client.run_id
    if st.add(f"runs/known/{run}", 1) == 1:
        st.set(f"runs/{st.add('runs/n', 1)}", run)
    cur = int(st.add(client.key("next_id"), 0))
    if cur < member_id:
        st.add(client.key("next_id"), member_id - cur)
    k = int(st.add(client.key("claims/n"), 1))
    st.set(client.key(f"claims/{k}"), str(member_id))
    base = client.key(f"claim/{member_id}/")
    verdict = _challenge(client, st, base, member_id)
    if verdict != "ok":
        return verdict
    book = RecordBook(st, run, member_id, client.token, log)
    st.set(client.key(f"join/{member_id}"), book.seal(client._record))
    st.set(client.key(f"claimrec/{member_id}"), book.seal({"quorum": client._last_q}))
    st.add(client.key(f"hb/{member_id}"), 1)
    with client._link_lock:   # leave() sets stop under it: the swap below comes before leave() or never
        if not stop.is_set():
            client.book, client.store = book, st
            return "ok"
    try:
        st.set(client.key(f"hb/{member_id}"), "-1")
    except Exception:  # noqa: BLE001 - gone again: the coordinator drops the silent id after heartbeat_timeout
        pass
    return LEFT


def _challenge(client: Any, st: Any, base: str, member_id: int) -> str:
    deadline = time.monotonic() + client.timeouts.quorum
    while True:
        if st.check([base + "verdict"]):
            return _s(st.get(base + "verdict"))
        if client.token is not None and st.check([base + "nonce"]) and not st.check([base + "proof"]):
            nonce = _s(st.get(base + "nonce"))
            st.set(base + "proof", auth.answer(client.token, f"{client.run_id}/{member_id}/claim", nonce))
        if time.monotonic() > deadline:
            raise ShoalError(f"the coordinator at {client.address} did not answer the re-announcement of "
                             f"member {member_id} within {client.timeouts.quorum} s")
        time.sleep(_TICK_S / 2)
