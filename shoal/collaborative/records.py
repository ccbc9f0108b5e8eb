"""Signed records in the coordinator's store: what a peer writes about itself, and checking others'.

The store (a TCPStore) has no access control: any process that can reach
its port can write any key. So, in a run with a token, every record a peer
writes about itself (its progress record, its matchmaking slot, the member
list of a round it closed, the last committed group) is wrapped as
``{"body": JSON, "mac": HMAC(session key, body)}``, where ``body`` names its
writer (``"by"``) and the session key is the writer's, derived from the run
token and the writer's join nonce (:func:`shoal.membership.auth.session_key`).
A reader recomputes the writer's key and drops a record whose MAC fails, whose
writer is not the member the key belongs to, or that is not JSON; each drop is
logged once per writer and kind. Without a token records are plain JSON and
trusted (a run without a token trusts whoever reaches the store).

What this does not stop: a process holding the token can derive any member's
session key (one shared secret cannot tell its holders apart), and anyone who
reaches the store can delete or overwrite keys, which is a denial of service
(see "Threat model" in docs/collaborative.md).

Example::

    book = RecordBook(store, "run1", member_id=3, token="s3cret-token")
    store.set("run1/progress/3", book.seal({"epoch": 4}))
    book.open(store.get("run1/progress/3"), writer=3, kind="progress")   # {"epoch": 4, "by": 3}
"""

from __future__ import annotations

import logging
from typing import Any

from shoal.membership.records import RecordBook as _RecordBook

log = logging.getLogger("shoal.collaborative")


class RecordBook(_RecordBook):
    """:class:`shoal.membership.records.RecordBook` logging to ``shoal.collaborative``; see the module docstring."""

    def __init__(self, store: Any, run_id: str, member_id: int, token: str | None) -> None:
        super().__init__(store, run_id, member_id, token, log)
