"""One ``shoal run`` per machine: the launchers' rendezvous, addresses and shared fate.

A static run across machines starts one launcher on each, with torchrun's
names: ``--nnodes N --node-rank R --master-addr HOST --master-port PORT``.
The launcher of node 0 serves a TCPStore on ``HOST:PORT``; every launcher
(node 0's too) publishes there what it will start, and they check together,
before any worker starts, that:

- they agree on the number of nodes and on the run id (``--run-id``), and no
  two claim the same node rank;
- each machine's advertised address (``--advertise-addr``, else the local
  address of the route towards ``HOST``) is not a loopback address and can
  be reached from every other machine (a TCP probe on that address).

Then ranks are laid out node by node (node ``r``'s workers get ``RANK``
``offset_r .. offset_r + nproc_r - 1``; machines may run different numbers of
workers) and the workers rendezvous on the same store, as under torchrun
(``TORCHELASTIC_USE_AGENT_STORE=True``), so one port is all the run needs
besides gloo's own connections. gloo and NCCL are pointed at the interface
holding the advertised address (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``,
unless already set). A failed worker on any machine stops the run on all of
them: its launcher records the failure in the store and the others stop
their workers and exit with the same code.

Example (two machines, two workers each)::

    # on 10.0.0.1                                  # on 10.0.0.2
    shoal run --nnodes 2 --node-rank 0 -n 2 \\      shoal run --nnodes 2 --node-rank 1 -n 2 \\
        --master-addr 10.0.0.1 train.py                --master-addr 10.0.0.1 train.py
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from shoal.errors import ConfigError, ShoalError

__all__ = ["NodeLayout", "NodeRendezvous", "NodeSpec", "interface_of", "route_address"]

_SIOCGIFADDR = 0x8915
_PROBE_S = 5.0   # a TCP connect to a peer's advertised address
_TRY_S = 5.0     # one try to reach node 0 (and the store's timeout once the run is under way)
_LOST_S = 60.0   # node 0 stops waiting for a launcher whose beat stalled this long
_ACK_S = 10.0    # after a failure, node 0 serves this long for the others to read it
_STARTED = "started"   # the meeting's verdict (in the "refused" key) once a launcher found it complete


def _address_in_use(e: BaseException) -> bool:
    """Whether a failed bind failed because another socket holds the address (torch's DistNetworkError
    carries the errno's name in its text only)."""
    return "EADDRINUSE" in str(e) or "address already in use" in str(e).lower()


def route_address(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return str(s.getsockname()[0])
    except OSError as e:
        raise ShoalError(f"cannot find a route from this machine to the master {host}:{port}: {e}; "
                         "check --master-addr, or pass --advertise-addr") from e


def interface_of(address: str) -> str | None:
    """The name of the local network interface holding IPv4 ``address`` (None if none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on that interface
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


@dataclass(frozen=True)
class NodeSpec:
    """This machine's place in a run launched on several machines.

    Attributes:
        nnodes: machines in the run (each runs one ``shoal run``).
        node_rank: this machine's index in ``[0, nnodes)``; node 0 serves the rendezvous.
        master_addr: node 0's address, reachable from every machine.
        master_port: the rendezvous port on node 0 (open it in the firewall).
        advertise_addr: the address peers reach this machine on; None: the
            local address of the route towards ``master_addr``.
        run_id: every launcher of one run gives the same id (a check that
            machines of two runs do not meet by mistake).
        join_timeout_s: how long a launcher waits for the others.
    """

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = 29500
    advertise_addr: str | None = None
    run_id: str = "shoal"
    join_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name, low in (("nnodes", 1), ("node_rank", 0), ("master_port", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} is outside [0, nnodes={self.nnodes})")
        if self.master_port > 65535:
            raise ConfigError(f"master_port must be <= 65535, got {self.master_port}")
        if not self.master_addr:
            raise ConfigError("master_addr is empty: give node 0's address (--master-addr)")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"join_timeout_s must be > 0, got {self.join_timeout_s}")

    def address(self) -> str:
        """The address this machine advertises; ConfigError if it is loopback while peers are remote."""
        addr = self.advertise_addr or route_address(self.master_addr, self.master_port)
        try:
            addr = socket.gethostbyname(addr)  # a name given to --advertise-addr: peers and gloo need its address
            loop = ipaddress.ip_address(addr).is_loopback
            master_loop = ipaddress.ip_address(socket.gethostbyname(self.master_addr)).is_loopback
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot resolve {addr!r} or the master {self.master_addr!r}: {e}") from e
        if loop and not master_loop and self.nnodes > 1:  # all launchers on one machine may use loopback
            raise ConfigError(
                f"this machine would advertise {addr}, a loopback address, to the other machines of the run "
                f"(the master {self.master_addr} is remote): pass --advertise-addr with an address they can reach")
        return addr


@dataclass
class NodeLayout:
    """What the rendezvous decided: the world, this node's first rank, and every node's record."""

    world_size: int
    rank_offset: int
    address: str
    interface: str | None
    nodes: list[dict[str, object]] = field(default_factory=list)


class NodeRendezvous:
    """The launchers' meeting on node 0's store; see the module docstring."""

    def __init__(self, spec: NodeSpec, nproc: int, interrupted: Callable[[], bool] = lambda: False) -> None:
        self.spec, self.nproc, self.interrupted = spec, nproc, interrupted
        self.store: dist.TCPStore | None = None
        self.joined = False
        self._claimed = False   # this launcher holds its node rank (a second claimant is refused and does not)
        self._probe: socket.socket | None = None

    def _key(self, name: str) -> str:
        return f"shoal_launch/{name}"

    def _connect(self) -> dist.TCPStore:
        """Node 0 serves; the others retry in short tries (a signal is seen between them) until the timeout."""
        s = self.spec
        deadline = time.monotonic() + s.join_timeout_s
        while True:
            try:
                return dist.TCPStore(s.master_addr, s.master_port, is_master=s.node_rank == 0,
                                     wait_for_workers=False, timeout=timedelta(seconds=_TRY_S))
            except Exception as e:  # torch raises RuntimeError/DistNetworkError with its own words
                if s.node_rank != 0 and time.monotonic() < deadline and not self.interrupted():
                    continue
                raise ShoalError(f"node {s.node_rank} could not {self._what_failed(e)}: {e}") from e

    def _what_failed(self, e: BaseException) -> str:
        """What :meth:`_connect` could not do, and the likely fix: a master port that another process holds
        (torch says only EADDRINUSE) is named as such, so its owner gives every launcher another port."""
        s = self.spec
        if s.node_rank == 0 and _address_in_use(e):
            return (f"serve the rendezvous: port {s.master_port} is taken by another process on this machine; "
                    "stop that process, or give every launcher of the run another --master-port")
        if s.node_rank == 0:
            return f"serve the rendezvous on port {s.master_port}"
        return (f"reach node 0's launcher at {s.master_addr}:{s.master_port} within {s.join_timeout_s:g} s "
                "(is `shoal run --node-rank 0` started there, and the port open?)")

    def _start_probe(self, addr: str) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, 0))
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot listen on the advertised address {addr}: {e}; "
                              "--advertise-addr must be an address of this machine") from e
        sock.listen(16)
        self._probe = sock

        def accept() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                conn.close()

        threading.Thread(target=accept, name="shoal-node-probe", daemon=True).start()
        return int(sock.getsockname()[1])

    def join(self) -> NodeLayout:
        """Meet the other launchers; raise ConfigError naming any disagreement or unreachable machine.

        A launcher that finds a disagreement records it, so the others stop waiting and say it too; so
        does one that stops meeting for any other reason (its wait ran out, a signal): a launcher that
        found every verdict written before it left must not start the run without it (:meth:`_start_or_stop`).
        """
        try:
            return self._join()
        except ShoalError as e:   # ConfigError included
            self.fail(f"2:node {self.spec.node_rank}: {e}", key="refused")  # a run under way goes on
            self.acknowledge()   # read why, or done with the meeting: node 0 need not wait for this one
            if self.spec.node_rank == 0:
                self._linger()   # its store holds why: the others read it before it goes
            raise
        except RuntimeError as e:   # torch's store errors (DistNetworkError): node 0's launcher went away
            if self.store is None:
                raise
            raise ShoalError("the run stopped before it started: node 0's launcher went away while the machines "
                             f"met (its store does not answer: {str(e).splitlines()[0] if str(e) else e!r})") from e

    def _linger(self) -> None:
        """Node 0, stopping before the run started: keep serving until every machine that claimed its node rank
        has read why (its ``ack``), at most ``_ACK_S``, so that none of them meets a closed store instead.

        Claimed, not registered: a launcher registers just after its claim, and one that node 0 did not wait
        for would meet a closed store there. Only the claimant acknowledges for its rank (:meth:`acknowledge`):
        a second launcher refused for that rank must not release node 0 before the claimant has read why."""
        if self.store is None:
            return
        deadline = time.monotonic() + _ACK_S
        try:
            while time.monotonic() < deadline:
                others = [r for r in range(1, self.spec.nnodes) if self.store.check([self._key(f"claim/{r}")])]
                if all(self.store.check([self._key(f"ack/{r}")]) for r in others):
                    return
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - its own store: nothing more to wait for
            return

    def _join(self) -> NodeLayout:
        s = self.spec
        addr = s.address()
        probe_port = self._start_probe(addr)
        self.store = store = self._connect()
        if s.node_rank != 0:
            self._check_run(json.loads(self._wait_key(self._key("node/0"), "node 0 to serve")))
        if store.add(self._key(f"claim/{s.node_rank}"), 1) > 1:
            raise ConfigError(f"two launchers claim --node-rank {s.node_rank} in run {s.run_id!r}: "
                              "give each machine its own node rank")
        self._claimed = True
        me = {"node_rank": s.node_rank, "nnodes": s.nnodes, "run_id": s.run_id, "nproc": self.nproc, "address": addr,
              "probe": probe_port, "host": socket.gethostname()}
        store.set(self._key(f"node/{s.node_rank}"), json.dumps(me))
        nodes = self._wait_all("node", "join")
        for n in nodes:
            self._check_run(n)
        loops = [n for n in nodes if ipaddress.ip_address(str(n["address"])).is_loopback]
        if loops and len(loops) < len(nodes):
            n = loops[0]
            raise ConfigError(f"node {n['node_rank']} ({n['host']}) advertises {n['address']}, a loopback address, "
                              "while other machines are remote (its name for the master resolves to loopback, as "
                              "/etc/hosts often maps the own hostname to 127.0.1.1): start it with --advertise-addr "
                              "set to its network address, or give --master-addr as an IP address")
        self._check_reachable(nodes)
        self._start_or_stop(store)
        store.set_timeout(timedelta(seconds=_TRY_S))  # a vanished node 0 must not block the supervisor for long
        self.joined = True
        world = sum(int(str(n["nproc"])) for n in nodes)
        offset = sum(int(str(n["nproc"])) for n in nodes[:s.node_rank])
        return NodeLayout(world, offset, addr, interface_of(addr), nodes)

    def _start_or_stop(self, store: dist.TCPStore) -> None:
        """The meeting is complete here: start, unless a refusal came first. One compare-and-set decides for
        every launcher (the first write wins: ``_STARTED`` here, a refusal's message in :meth:`fail`), so a
        launcher that met the others just before a refusal never starts a run that one of them, which read
        the refusal while it still waited, has left."""
        try:
            verdict = bytes(store.compare_set(self._key("refused"), "", _STARTED)).decode()
        except Exception as e:  # noqa: BLE001 - torch's own error: say which launcher went away
            raise ShoalError(f"node 0's launcher went away as the machines finished meeting: {e}") from e
        if verdict != _STARTED:
            raise ShoalError(f"the run stopped before it started: {verdict.partition(':')[2] or verdict}")

    def _check_run(self, n: dict[str, object]) -> None:
        s = self.spec
        for what, flag in (("nnodes", "--nnodes"), ("run_id", "--run-id")):
            if n[what] != getattr(s, what):
                raise ConfigError(f"node {n['node_rank']} ({n['host']}) was started with {flag} {n[what]}, this "
                                  f"machine (node {s.node_rank}) with {flag} {getattr(s, what)}: give every "
                                  f"launcher of one run the same {flag}")

    def _wait_key(self, key: str, what: str) -> bytes:
        assert self.store is not None  # set by join()
        s = self.spec
        deadline = time.monotonic() + s.join_timeout_s
        while not self.store.check([key]):
            self._still_waiting(deadline, what)
        return bytes(self.store.get(key))

    def _still_waiting(self, deadline: float, what: str) -> None:
        """Sleep a poll; raise if another launcher failed, this one was interrupted, or time is up."""
        s = self.spec
        other = self.failure("refused") or self.failure()
        if other is not None:
            raise ShoalError(f"the run stopped before it started: {other.partition(':')[2] or other}")
        if self.interrupted():
            raise ShoalError("interrupted while waiting for the other machines")
        if time.monotonic() > deadline:
            raise ShoalError(f"waited {s.join_timeout_s:g} s at {s.master_addr}:{s.master_port} for {what}")
        time.sleep(0.05)

    def _wait_all(self, what: str, step: str) -> list[dict[str, object]]:
        assert self.store is not None  # set by join()
        s = self.spec
        keys = [self._key(f"{what}/{r}") for r in range(s.nnodes)]
        deadline = time.monotonic() + s.join_timeout_s
        while not self.store.check(keys):
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            self._still_waiting(deadline, f"node(s) {missing} to {step} run {s.run_id!r} (start `shoal run "
                                          f"--nnodes {s.nnodes} --node-rank R` there with the same --run-id, "
                                          "or check --nnodes)")
        return [json.loads(self.store.get(k)) for k in keys]

    def _check_reachable(self, nodes: list[dict[str, object]]) -> None:
        assert self.store is not None  # set by join()
        s = self.spec
        cut = []
        for n in nodes:
            if n["node_rank"] == s.node_rank:
                continue
            try:
                socket.create_connection((str(n["address"]), int(str(n["probe"]))), timeout=_PROBE_S).close()
            except OSError:
                cut.append(n["node_rank"])
        self.store.set(self._key(f"reach/{s.node_rank}"), json.dumps(cut))
        verdicts = self._wait_all("reach", "check the addresses of")
        for src, unreachable in enumerate(verdicts):
            for dst in unreachable:  # type: ignore[attr-defined]
                n = nodes[int(dst)]
                who = "this machine" if n["node_rank"] == s.node_rank else f"node {dst} ({n['host']})"
                raise ConfigError(
                    f"node {src} cannot reach {who} at its advertised address {n['address']}: start that "
                    "machine's launcher with --advertise-addr set to an address the others can reach, and open "
                    "TCP between the machines (gloo connects on ephemeral ports)")

    def fail(self, message: str, key: str = "failed") -> None:
        """Tell the other launchers that this machine's part of the run failed (first one wins).

        ``key="refused"``: a launcher refused to join; only launchers still meeting stop for it.
        """
        if self.store is not None:
            try:
                self.store.compare_set(self._key(key), "", message)
            except Exception:  # the store went away with node 0: the others learn it from their collectives
                pass

    def failure(self, key: str = "failed") -> str | None:
        """Another machine's failure message, if one was recorded."""
        if self.store is None:
            return None
        try:
            if self.store.check([self._key(key)]):
                said = bytes(self.store.get(self._key(key))).decode()
                return None if said == _STARTED else said   # the meeting decided to start: no refusal counts
        except Exception:
            return "node 0's launcher is gone (its store does not answer)"
        return None

    def beat(self) -> None:
        """Tell node 0 this launcher lives (called from the supervisor's poll)."""
        if self.joined and self.store is not None:
            try:
                self.store.add(self._key(f"beat/{self.spec.node_rank}"), 1)
            except Exception:  # node 0 gone: failure() says so
                pass

    def acknowledge(self) -> None:
        """Say this launcher read the failure (node 0 may stop serving once all did).

        Only the launcher that holds its node rank speaks for it: node 0 waits for that one."""
        if self.store is not None and self._claimed:
            try:
                self.store.set(self._key(f"ack/{self.spec.node_rank}"), "1")
            except Exception:
                pass

    def finish(self, code: int, note: Callable[[str], None]) -> None:
        """This machine is done (its workers' verdict ``code``); node 0 serves until every machine is.

        Node 0 keeps the store (the workers' too) until every node said done, or, after a failure,
        until every node read it (or ``_ACK_S``), or until a launcher's beat stalled ``_LOST_S``
        (that machine is gone), or until a signal.
        """
        if self.joined and self.store is not None:
            try:
                self.store.set(self._key(f"done/{self.spec.node_rank}"), str(code))
                if self.spec.node_rank == 0:
                    self._serve_until_all_done(note)
            except Exception:  # noqa: BLE001 - node 0 gone: nothing left to tell
                pass
        if self._probe is not None:
            self._probe.close()

    def _serve_until_all_done(self, note: Callable[[str], None]) -> None:
        assert self.store is not None  # finish() checked
        n, st = self.spec.nnodes, self.store
        beats: dict[int, tuple[int, float]] = {}
        failed_at: float | None = None
        told = False
        while not self.interrupted():
            now = time.monotonic()
            waiting = [r for r in range(n) if not st.check([self._key(f"done/{r}")])]
            if not waiting:
                return
            if failed_at is None and self.failure() is not None:
                failed_at = now
            if failed_at is not None:
                if all(st.check([self._key(f"ack/{r}")]) for r in waiting) or now - failed_at > _ACK_S:
                    return
            for r in waiting:
                b = st.add(self._key(f"beat/{r}"), 0)
                last = beats.get(r)
                if last is None or last[0] != b:
                    beats[r] = (b, now)
                elif now - last[1] > _LOST_S:
                    note(f"node {r}'s launcher has been silent for {_LOST_S:g} s: not waiting for it any more")
                    return
            if not told:
                note(f"this machine is done; serving the rendezvous until node(s) {waiting} finish")
                told = True
            time.sleep(0.2)
