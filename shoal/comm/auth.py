"""Proving that a worker holds the run token without ever sending it.

The coordinator writes a random nonce for each joiner; the joiner answers
``HMAC-SHA256(token, context || nonce)`` where ``context`` binds the answer to
the run and member id (a proof for one id cannot be replayed for another).
The coordinator checks it with a constant-time comparison; the token itself
never crosses the network. The coordinator also signs every quorum it
publishes, so that members can tell its records from ones a stranger with
store access wrote.

Example:
    >>> n = new_nonce()
    >>> proof = answer("secret", "run1/7", n)
    >>> verify("secret", "run1/7", n, proof)
    True
    >>> verify("wrong", "run1/7", n, proof)
    False
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from shoal.errors import ConfigError

NONCE_BYTES = 32


def check_token(token: str | None) -> str | None:
    """Validate a run token (``None``: no authentication)."""
    if token is None:
        return None
    if not isinstance(token, str) or len(token) < 8:
        raise ConfigError("token must be a string of at least 8 characters (a shared secret that "
                          f"proves membership of the run), got {'a ' + type(token).__name__ if not isinstance(token, str) else repr(len(token)) + ' characters'}")
    return token


def new_nonce() -> str:
    """A fresh random challenge (hex)."""
    return secrets.token_hex(NONCE_BYTES)


def answer(token: str, context: str, nonce: str) -> str:
    """The joiner's proof: HMAC-SHA256 of ``context`` and ``nonce`` keyed by the token (hex)."""
    return hmac.new(token.encode(), f"{context}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def verify(token: str, context: str, nonce: str, proof: str) -> bool:
    """Constant-time check of a proof."""
    return hmac.compare_digest(answer(token, context, nonce), proof)


def sign(token: str, record: str) -> str:
    """The coordinator's signature of a record it publishes."""
    return answer(token, "record", record)
