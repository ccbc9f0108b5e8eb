"""Exceptions raised by shoal.

Every error says what was expected and why, so that the message alone is
enough to fix the call. All derive from :class:`ShoalError`.

Example:
    >>> from shoal.errors import ConfigError
    >>> try:
    ...     raise ConfigError("bucket_cap_mb must be > 0, got 0")
    ... except ValueError as e:  # ConfigError is also a ValueError
    ...     print(e)
    bucket_cap_mb must be > 0, got 0
"""

from __future__ import annotations


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""


class ConfigError(ShoalError, ValueError):
    """An argument or configuration value is invalid (raised at construction)."""


class ModelMismatchError(ShoalError):
    """Ranks hold models that differ in parameter names, shapes or dtypes."""


class PeerLostError(ShoalError):
    """A peer left or died while a collective with it was in flight."""


class CommTimeoutError(ShoalError, TimeoutError):
    """A collective did not complete within its timeout."""


class AuthError(ShoalError):
    """A peer could not prove it holds the run token."""


__all__ = [
    "ShoalError",
    "ConfigError",
    "ModelMismatchError",
    "PeerLostError",
    "CommTimeoutError",
    "AuthError",
]
