"""Signed records in a coordinator's store: what a member writes about itself, and checking others'.

The store (a TCPStore) has no access control: any process that can reach
its port can write any key. So, in a run with a token, every record a member
writes about itself (an elastic worker's join record, a collaborative peer's
progress record, matchmaking slot, round member list, last committed group)
is wrapped as ``{"body": JSON, "mac": HMAC(session key, body)}``, where
``body`` names its writer (``"by"``) and the session key is the writer's,
derived from the run token and the writer's join nonce
(:func:`shoal.membership.auth.session_key`). A reader recomputes the writer's key
and drops a record whose MAC fails, whose writer is not the member the key
belongs to, or that is not JSON; each drop is logged once per writer and
kind. Without a token records are plain JSON and trusted (a run without a
token trusts whoever reaches the store).

What this does not stop: a process holding the token can derive any member's
session key (one shared secret cannot tell its holders apart), and anyone who
reaches the store can delete or overwrite keys, which is a denial of service
(see "Threat model" in docs/collaborative.md and docs/elastic.md).

Example::

    book = RecordBook(store, "run1", member_id=3, token="s3cret-token")
    store.set("run1/progress/3", book.seal({"epoch": 4}))
    book.open(store.get("run1/progress/3"), writer=3, kind="progress")   # {"epoch": 4, "by": 3}
"""

from __future__ import annotations

import json
import logging
from typing import Any

from shoal.membership import auth


class RecordBook:
    """Seals this member's records and opens (verifies) anyone's; see the module docstring."""

    def __init__(self, store: Any, run_id: str, member_id: int, token: str | None,
                 log: logging.Logger | None = None) -> None:
        self.store, self.run_id, self.member_id, self.token = store, run_id, member_id, token
        self.log = log if log is not None else logging.getLogger("shoal.comm")
        self._keys: dict[int, bytes] = {}
        self._warned: set[tuple[int | None, str]] = set()
        self.dropped = 0     # records dropped so far (forged, altered, malformed)

    def _key(self, member: int) -> bytes | None:
        """Member ``member``'s session key (None while its join nonce is not in the store)."""
        key = self._keys.get(member)
        if key is None and self.token is not None:
            k = f"{self.run_id}/auth/{member}/nonce"
            if not self.store.check([k]):
                return None
            raw = self.store.get(k)
            nonce = raw.decode() if isinstance(raw, bytes) else str(raw)
            # Cached: the coordinator writes a member's nonce once, at its join, so a later
            # overwrite by someone else cannot change whose records verify.
            key = self._keys[member] = auth.session_key(self.token, f"{self.run_id}/{member}", nonce)
        return key

    def seal(self, record: dict[str, Any]) -> str:
        """``record`` as stored by this member: plain JSON without a token, else signed."""
        body = json.dumps({**record, "by": self.member_id}, sort_keys=True)
        if self.token is None:
            return body
        key = self._key(self.member_id)
        if key is None:
            raise RuntimeError(f"member {self.member_id} has no join nonce in the store: it signs records only "
                               "after joining")
        return json.dumps({"body": body, "mac": auth.mac(key, body)})

    def open(self, raw: Any, writer: int | None = None, kind: str = "record") -> dict[str, Any] | None:
        """The record in ``raw`` if it verifies (and, with ``writer``, was written by that member), else None."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        why, rec, by = None, None, writer
        try:
            outer = json.loads(text)
            if self.token is None:
                rec = outer if isinstance(outer, dict) else None
                why = None if rec is not None else "is not a JSON object"
            else:
                body = outer.get("body") if isinstance(outer, dict) else None
                rec = json.loads(body) if isinstance(body, str) else None
                by = rec.get("by") if isinstance(rec, dict) else None
                key = self._key(by) if isinstance(by, int) and not isinstance(by, bool) else None
                if not isinstance(rec, dict):
                    why = "is not a signed record"
                elif writer is not None and by != writer:
                    why = f"names writer {by!r} where member {writer}'s record belongs"
                elif key is None:
                    why = f"names writer {by!r}, who never joined this run"
                elif not isinstance(body, str) or not auth.check_mac(key, body, outer.get("mac")):
                    why = "has a MAC that does not verify (forged or altered)"
        except (ValueError, TypeError, AttributeError):
            why = "is not JSON"
        if why is None and rec is not None:
            return rec
        self.dropped += 1
        tag = (by if isinstance(by, int) else None, kind)
        if tag not in self._warned:
            self._warned.add(tag)
            self.log.warning("dropping a %s record in the store that %s (writer %r; further ones not logged)",
                        kind, why, by)
        return None
