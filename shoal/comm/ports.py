"""A TCP port for a server that another process will bind: picked where no outgoing connection can take it.

The usual way (bind port 0, read the port, close) hands out a port from the
kernel's ephemeral range, and until the server binds it, any process that
opens a connection may be given that same port as its local end: on a busy
machine (a test suite, several jobs) rank 0's store then fails with
``EADDRINUSE``. Outgoing connections only ever take ports inside the
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), so
:func:`pick_port` picks below it and below 30000 (Kubernetes gives
30000-32767 to its node ports), at random among up to 12,000 ports, one
that binds now on the given address and on every interface (a store
listens on all of them). Only
another process binding that very port explicitly can still take it.

Example::

    port = pick_port()          # e.g. 27331 where the ephemeral range starts at 32768
    env["MASTER_PORT"] = str(port)
"""

from __future__ import annotations

import random
import socket

__all__ = ["pick_port", "ephemeral_range"]

_DEFAULT_RANGE = (32768, 60999)   # Linux's default, used where the kernel does not say
_SPAN = 12000                     # how far below the ephemeral range to look
_CEILING = 30000                  # Kubernetes' node ports start here
_TRIES = 64


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range of ports for the local end of outgoing connections (Linux's default elsewhere)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return _DEFAULT_RANGE
    return (low, high) if 0 < low <= high < 65536 else _DEFAULT_RANGE


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _binds(host: str, port: int) -> bool:
    """Whether ``port`` binds now on ``host`` and on every interface of its family."""
    for addr in dict.fromkeys((host, "::" if ":" in host else "0.0.0.0")):
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def pick_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port that binds on ``host`` (and every interface) now, below the ephemeral range if there is room
    (see the module docstring); else, or if none of a few random ones binds, one the kernel picks (port 0)."""
    low, _ = ephemeral_range()
    end = min(low, _CEILING)
    first = max(1024, end - _SPAN)
    if end - first >= 256:
        draw = rng or random.SystemRandom()
        for _ in range(_TRIES):
            port = draw.randrange(first, end)
            if _binds(host, port):
                return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
