"""What the emulated-cluster tests share: their skip mark and their check that nothing was left behind.

The cluster itself (namespaces, veth pairs, the bridge, ``tc tbf``) is
built by the library, :class:`shoal.cli.cluster.EmulatedCluster`; these
tests only ask it. Example::

    from emulated import NEEDS_CLUSTER, leftovers
    pytestmark = NEEDS_CLUSTER
    ...
    assert leftovers(os.getpid()) == []
"""

from __future__ import annotations

import subprocess

import pytest

from shoal.cli.cluster import IF_PREFIX, NS_PREFIX, check_can_emulate, list_namespaces
from shoal.errors import ShoalError


def _missing() -> str:
    """What is missing to build an emulated cluster here ('' when nothing is): the library's own check."""
    try:
        check_can_emulate()
    except ShoalError as e:
        return str(e)
    return ""


MISSING = _missing()
NEEDS_CLUSTER = [pytest.mark.e2e, pytest.mark.skipif(bool(MISSING), reason=MISSING)]


def leftovers(pid: int) -> list[str]:
    """Namespaces of runs started by ``pid``, and any of our interfaces in the root namespace."""
    ns = [n for n in list_namespaces() if n.startswith(f"{NS_PREFIX}{pid}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return ns + [line for line in links.splitlines() if f": {IF_PREFIX}" in line]
