"""Proving that a worker holds the run token without ever sending it.

The coordinator writes a random nonce for each joiner; the joiner answers
``HMAC-SHA256(token, context || nonce)`` where ``context`` binds the answer to
the run and member id (a proof for one id cannot be replayed for another).
The coordinator checks it with a constant-time comparison; the token itself
never crosses the network. The coordinator also signs every quorum it
publishes, so that members can tell its records from ones a stranger with
store access wrote.

Members sign what they write about themselves in the shared store with a
per-member *session key*, ``HMAC-SHA256(token, "session" || run/id || nonce)``,
derived from the same join challenge: whoever verifies a record needs the
token, so a process without it can neither forge nor alter one, and a record
signed for one member id (or one join of it) does not verify for another.
Every holder of the token can derive every session key: the keys bind records
to ids, they do not tell token holders apart (see docs/collaborative.md).

Example:
    >>> n = new_nonce()
    >>> proof = answer("secret", "run1/7", n)
    >>> verify("secret", "run1/7", n, proof)
    True
    >>> verify("wrong", "run1/7", n, proof)
    False
    >>> k = session_key("secret", "run1/7", n)
    >>> check_mac(k, "epoch=3", mac(k, "epoch=3")), check_mac(session_key("wrong", "run1/7", n), "epoch=3", mac(k, "epoch=3"))
    (True, False)
"""

from __future__ import annotations

import hashlib
import hmac
import os
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


def session_key(token: str, context: str, nonce: str) -> bytes:
    """The key a member signs its store records with: bound to the run, its id and its join nonce."""
    return hmac.new(token.encode(), f"session\n{context}\n{nonce}".encode(), hashlib.sha256).digest()


def mac(key: bytes, text: str) -> str:
    """HMAC-SHA256 of ``text`` under a session key (hex)."""
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def check_mac(key: bytes, text: str, tag: object) -> bool:
    """Constant-time check of a record's MAC (False for anything that is not a string)."""
    return isinstance(tag, str) and hmac.compare_digest(mac(key, text), tag)


def env_or(name: str, value: str | None, what: str) -> str:
    """``value`` if given, else the environment variable ``name`` (ConfigError naming ``what`` if unset)."""
    if value is not None:
        return value
    found = os.environ.get(name)
    if not found:
        raise ConfigError(f"{what} not given and {name} is not set; `shoal run --elastic` sets it, "
                          f"or pass it explicitly")
    return found


def run_token(token: str | None) -> str:
    """The elastic run's token: ``token`` if given (it wins over the environment), else ``$SHOAL_TOKEN``."""
    if token is not None:
        return str(check_token(token))
    found = os.environ.get("SHOAL_TOKEN")
    if not found:
        raise ConfigError("an elastic group needs the run token, so that only workers holding it join the "
                          "run: pass ElasticGroup(token=...) or set $SHOAL_TOKEN (`shoal run --elastic` sets "
                          "it for its workers; with `--coordinator` or `shoal coordinator` give them the same "
                          "--token)")
    return str(check_token(found))
