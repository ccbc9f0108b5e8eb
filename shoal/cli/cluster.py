"""An emulated cluster on one machine: network namespaces, veth links, tc tbf.

Each emulated *host* is a network namespace with its own loopback and one
veth link to a *switch*: a Linux bridge living in a namespace of its own, so
nothing is configured in the machine's root namespace (no address, no route,
no NAT; traffic cannot leave the machine). Each host's link is shaped by a
token bucket (``tc qdisc ... tbf``) in both directions:

* host-side egress = the host's upload,
* switch-side egress = the host's download.

Ranks on the same host talk over the namespace's loopback (unshaped), ranks
on different hosts over the shaped links. Addresses come from a private
subnet (``10.213.0.0/24``) that exists only inside the run's namespaces, so
concurrent runs do not see each other.

Names carry a fixed prefix, the launcher's pid and a random run id
(namespaces ``shoal-<pid>-<id>-h<i>`` and ``shoal-<pid>-<id>-sw``; interfaces
``shl<id>h<i>``, ``shl<id>s<i>``, ``shl<id>br``, at most 15 characters), so
:func:`cleanup_stale` can recognise what a crashed run left behind and leave
live runs alone. Deleting a namespace destroys the veth ends and the bridge
inside it, so removing the namespaces removes everything.

Needs root and the ``ip`` and ``tc`` tools (iproute2). This kernel may lack
``netem``: links have bandwidth, not added latency.

Example::

    spec = ClusterSpec(hosts=2, procs_per_host=1, bandwidth=("100mbit",))
    with EmulatedCluster(spec) as cluster:
        subprocess.run(cluster.exec_prefix(0) + ["ping", "-c1", cluster.address(1)])
        print(cluster.host_bytes())
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from types import TracebackType

from shoal.errors import ConfigError, ShoalError
from shoal.rates import parse_rate  # noqa: F401 - re-exported: the CLI, the bench and tests name it here

NS_PREFIX = "shoal-"
IF_PREFIX = "shl"
SUBNET = "10.213.0"
MAX_HOSTS = 250  # one /24, .1 .. .250
_NS_RE = re.compile(r"^shoal-(\d+)-([0-9a-f]+)-(sw|h\d+)$")



@dataclass(frozen=True)
class ClusterSpec:
    """Shape of an emulated cluster.

    Args:
        hosts: number of emulated hosts (network namespaces), 1 to 250.
        procs_per_host: worker processes on each host.
        bandwidth: per-host link rate as tc rate strings (``"100mbit"``,
            ``"1gbit"``, ``"5mbps"`` = 5 megabytes/s), applied both up and
            down. One value is broadcast to every host; otherwise one per
            host. A plain string is accepted for one value. Empty: links are
            not shaped.

    Example:
        >>> ClusterSpec(hosts=2, procs_per_host=2, bandwidth=("100mbit",)).bandwidth
        ('100mbit', '100mbit')
        >>> ClusterSpec(2, 1, "10mbit").world_size
        2
    """

    hosts: int
    procs_per_host: int
    bandwidth: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("hosts", "procs_per_host"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.hosts > MAX_HOSTS:
            raise ConfigError(f"hosts must be <= {MAX_HOSTS} (one /24 subnet), got {self.hosts}")
        bw = (self.bandwidth,) if isinstance(self.bandwidth, str) else tuple(self.bandwidth)
        if len(bw) == 1:
            bw = bw * self.hosts
        if bw and len(bw) != self.hosts:
            raise ConfigError(
                f"bandwidth needs one value for all hosts or one per host ({self.hosts}), got {len(bw)}: {bw}"
            )
        for rate in bw:
            if not isinstance(rate, str):
                raise ConfigError(f"bandwidth values must be tc rate strings like '100mbit', got {rate!r}")
            parse_rate(rate)
        object.__setattr__(self, "bandwidth", bw)

    @property
    def world_size(self) -> int:
        return self.hosts * self.procs_per_host

    def rate_bytes(self, host: int) -> float | None:
        """Bytes/s of ``host``'s link, ``None`` when unshaped."""
        return parse_rate(self.bandwidth[host]) if self.bandwidth else None


def tbf_params(rate_bytes: float) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a tbf shaping TCP accurately at ``rate_bytes``.

    The burst must hold at least one timer tick of tokens (the qdisc sleeps
    between dequeues) and a full-size GSO segment, or the link idles between
    ticks and under-delivers. The queue limit must exceed what TCP small
    queues let all of a host's sockets keep in the qdisc, or tbf drops and
    TCP backs off; a few tens of ms of queue is enough and keeps the added
    delay modest.
    """
    burst = max(int(rate_bytes * 0.004), 64 * 1024)
    limit = burst + max(int(rate_bytes * 0.1), 2 * 1024 * 1024)
    return burst, limit


def check_can_emulate() -> None:
    """Raise :class:`ShoalError` saying what is missing to build an emulated cluster."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces and tc need CAP_NET_ADMIN/CAP_SYS_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (package iproute2)")
    if missing:
        raise ShoalError(
            "cannot build an emulated cluster: missing " + "; ".join(missing)
            + ". Run unemulated instead: drop --hosts/--procs-per-host/--bandwidth and use -n N."
        )


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ShoalError(f"`{' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of every network namespace (``ip netns list``)."""
    out = _sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_in(ns: str) -> None:
    """SIGKILL every process that runs in namespace ``ns``."""
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for p in pids:
        try:
            os.kill(int(p), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_namespace(ns: str) -> None:
    """Kill what still runs in ``ns``, then delete it (its interfaces go with it)."""
    _kill_in(ns)
    _sh("ip", "netns", "delete", ns, check=False)


def cleanup_stale(force: bool = False) -> list[str]:
    """Remove namespaces (and with them links and bridges) left by dead runs.

    A run is dead when the launcher pid in its names no longer exists.
    ``force=True`` also removes live runs' namespaces. Processes still
    running inside a removed namespace are killed. Returns the names removed.

    Example::

        removed = cleanup_stale()   # what `shoal run --cleanup` does
    """
    check_can_emulate()
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and (force or not _pid_alive(int(m.group(1)))):
            _remove_namespace(ns)
            removed.append(ns)
    return removed


class EmulatedCluster:
    """Builds the namespaces, bridge and shaped links of a :class:`ClusterSpec`.

    Use as a context manager: everything is created in ``__enter__`` and
    removed in ``__exit__``, whatever the exit path (also if creation fails
    half-way). :meth:`close` is idempotent.

    Example::

        with EmulatedCluster(ClusterSpec(2, 1, ("100mbit",))) as c:
            print(c.namespace(0), c.address(0), c.interface(0))
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.run_id = secrets.token_hex(3)
        self.pid = os.getpid()
        self._created: list[str] = []
        self._closed = False

    # --- names ---------------------------------------------------------------
    def namespace(self, host: int) -> str:
        return f"{NS_PREFIX}{self.pid}-{self.run_id}-h{host}"

    @property
    def switch_namespace(self) -> str:
        return f"{NS_PREFIX}{self.pid}-{self.run_id}-sw"

    def interface(self, host: int) -> str:
        """The host-side interface name (for GLOO_SOCKET_IFNAME)."""
        return f"{IF_PREFIX}{self.run_id}h{host}"

    def _switch_port(self, host: int) -> str:
        return f"{IF_PREFIX}{self.run_id}s{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def exec_prefix(self, host: int) -> list[str]:
        """argv prefix that runs a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host)]

    # --- faults ----------------------------------------------------------------
    def kill_host(self, host: int) -> None:
        """The machine dies: every process in ``host``'s namespace is SIGKILLed (its network stays).

        Example::

            emu.kill_host(1)     # then start a new launcher on host 1: the machine is back
        """
        _kill_in(self.namespace(host))

    def set_link(self, host: int, up: bool) -> None:
        """Cut ``host`` off the switch (``up=False``: a partition) or bring its link back.

        Example::

            emu.set_link(2, False); time.sleep(20); emu.set_link(2, True)
        """
        _sh("ip", "-n", self.namespace(host), "link", "set", "dev", self.interface(host), "up" if up else "down")

    # --- lifecycle -------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        check_can_emulate()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        self._created.append(ns)  # before creating: a half-made one is still removed
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw, br = self.switch_namespace, f"{IF_PREFIX}{self.run_id}br"
        self._add_ns(sw)
        _sh("ip", "-n", sw, "link", "add", br, "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", br, "up")
        for h in range(self.spec.hosts):
            ns, dev, port = self.namespace(h), self.interface(h), self._switch_port(h)
            self._add_ns(ns)
            # Both ends are created directly inside their namespaces: nothing
            # ever appears in the root namespace.
            _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", sw, "link", "set", port, "master", br)
            _sh("ip", "-n", sw, "link", "set", port, "up")
            rate = self.spec.rate_bytes(h)
            if rate is not None:
                self._shape(ns, dev, rate)  # upload
                self._shape(sw, port, rate)  # download

    def _shape(self, ns: str, dev: str, rate_bytes: float) -> None:
        burst, limit = tbf_params(rate_bytes)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(rate_bytes)}bps", "burst", str(burst), "limit", str(limit))

    def host_bytes(self) -> list[dict[str, int]]:
        """Per host ``{"sent": tx_bytes, "received": rx_bytes}`` of its link.

        Counted on the host-side interface, so they include IP/TCP headers,
        ARP and the rendezvous store's traffic, and exclude traffic between
        ranks of the same host (loopback).
        """
        result = []
        for h in range(self.spec.hosts):
            out = _sh("ip", "-n", self.namespace(h), "-s", "-j", "link", "show", "dev", self.interface(h)).stdout
            stats = json.loads(out)[0]["stats64"]
            result.append({"sent": int(stats["tx"]["bytes"]), "received": int(stats["rx"]["bytes"])})
        return result

    def close(self) -> None:
        """Remove every namespace this cluster created (links and bridge go with them)."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._created):
            _remove_namespace(ns)
        self._created.clear()
