"""Rates written as tc writes them ("20mbit", "2mbps"), for the emulated cluster and for pacing.

>>> parse_rate("20mbit")
2500000.0
"""

from __future__ import annotations

import re

from shoal.errors import ConfigError

# tc rate units (see tc(8)): bits per second, or bytes per second for *bps.
_RATE_UNITS = {
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "kibit": 1024 / 8, "mibit": 1024**2 / 8, "gibit": 1024**3 / 8, "tibit": 1024**4 / 8,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
    "kibps": 1024.0, "mibps": 1024.0**2, "gibps": 1024.0**3, "tibps": 1024.0**4,
}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_rate(rate: str) -> float:
    """Bytes per second of a tc rate string.

    >>> parse_rate("100mbit")
    12500000.0
    >>> parse_rate("2mbps")
    2000000.0
    """
    m = _RATE_RE.match(rate)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ConfigError(
            f"bandwidth {rate!r} is not a tc rate: expected a number and a unit from "
            f"{', '.join(sorted(_RATE_UNITS))} (e.g. '100mbit'; 'mbps' means megabytes/s as in tc)"
        )
    value = float(m.group(1)) * _RATE_UNITS[unit]
    if value < 8000:  # below 64 kbit a 1500-byte packet takes > 0.2 s
        raise ConfigError(f"bandwidth {rate!r} is below 64kbit; too slow to run anything")
    return value
