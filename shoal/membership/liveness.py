"""A dead worker's process tells the coordinator by closing a socket: no probe window to wait out.

After a failed step the coordinator probes heartbeats (:mod:`shoal.membership.coordinator`): a member
whose heartbeat does not advance within ``probe`` seconds is left out of the next quorum. That window
is a fixed wait on every kill's critical path (2 s on a loaded 4-host cluster), because silence is the
only sign of death a store of keys can give. A process that dies (SIGKILL, an OOM kill, a crash) has
its sockets closed by the kernel, which sends the other end a FIN or a reset at once. So every member
holds one TCP connection open to the coordinator (``LivenessServer`` there, ``LivenessLink`` here), and
a connection that ends tells the coordinator that the member's process is gone, within a round trip.

What the coordinator does with it (``Coordinator._tick_run``): a member of the current quorum whose
link ended starts a probe at once (once per end of a link), in which it counts as silent as soon as
its heartbeat has missed two beats (``2 * heartbeat_interval``): for a dead process ~0.2 s after the
kill instead of ``probe`` seconds. Then it is dropped, the quorum's abort flag is raised and the
others' quorum published. The link only ever counts against a member that is silent too: one whose
link broke but whose heartbeat still advances answers the probe, nothing is published, and its link
reopens. A member that never opened a link (``SHOAL_LIVENESS=off``, a coordinator restarted since)
is judged by its heartbeat alone, as before. A host cut off by a partition closes nothing: the probe
window and ``heartbeat_timeout`` still decide there.

Protocol (one line each, ASCII, on a connection to the port the coordinator publishes under the
store key ``liveness``)::

    member -> coordinator   {"run": "<run_id>", "id": <member id>}
    coordinator -> member   <nonce>
    member -> coordinator   <proof>    HMAC(token, "<run_id>/<id>/live", nonce), "-" without a token
    coordinator -> member   ok | denied

then both ends keep the connection open and silent (TCP keep-alive probes it) until the member leaves
or dies. Only an explicit ``denied`` stops a member from opening its link again.
``SHOAL_LIVENESS=off`` in a worker's environment opens no link (a network that blocks the port:
the worker is then judged by its heartbeat alone, as tests of the heartbeat paths need). The proof's
context differs from the join challenge's, so a proof given here cannot admit anyone. The published
port is signed with the token together with the coordinator's incarnation (``auth.sign``), so a
record of an earlier coordinator cannot be replayed to send members elsewhere.

Example::

    server = LivenessServer("127.0.0.1", token="s3cret-token").start()   # inside the Coordinator
    link = LivenessLink("127.0.0.1", server.port, "run1", 7, "s3cret-token").start()   # in a member
    ...
    link.stop()                      # leave: the coordinator sees ("run1", 7) end
    server.ended("run1")             # {7: 1}: member 7's link ended, the server's first end
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from shoal.errors import ConfigError
from shoal.membership import auth

log = logging.getLogger("shoal.elastic")
STORE_KEY = "liveness"
_LINE_MAX = 4096          # a handshake line longer than this is not a member's
_HANDSHAKE_S = 10.0       # a connection that does not finish its handshake in this long is dropped
_PENDING_MAX = 64         # handshakes in progress at once; more connections are closed at once
_KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))   # a dead peer found in ~1 min


def enabled() -> bool:
    """``$SHOAL_LIVENESS``: ``on`` (the default) or ``off`` (no link: this worker is judged by its heartbeat alone)."""
    value = os.environ.get("SHOAL_LIVENESS", "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"SHOAL_LIVENESS must be 'on' or 'off', got {value!r}")
    return value == "on"


def context(run_id: str, member_id: int) -> str:
    """What a member's liveness proof is bound to (never equal to a join challenge's context)."""
    return f"{run_id}/{member_id}/live"


def port_record(port: int, token: str | None, incarnation: str) -> str:
    """The store value that publishes the server's port: ``"<port>"``, or ``"<port> <signature>"`` (signed
    with the coordinator's ``incarnation``: a record of an earlier coordinator does not verify)."""
    return str(port) if token is None else f"{port} {auth.sign(token, f'liveness {incarnation} {port}')}"


def read_port(value: bytes | str, token: str | None, incarnation: str | None) -> int | None:
    """The port of a ``port_record``; None if it is malformed or not signed with ``token`` for ``incarnation``."""
    text = value.decode() if isinstance(value, bytes) else str(value)
    port, _, tag = text.partition(" ")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if token is not None and not auth.verify(token, "record", f"liveness {incarnation} {port}", tag):
        return None
    return int(port)


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle link (a NAT keeps its state; a peer gone without a FIN is found in about a minute)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _read_line(sock: socket.socket, deadline: float) -> str | None:
    """One ``\\n``-terminated line (without it) before ``deadline``; None at EOF, on a bad line or past it."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) >= _LINE_MAX:
            return None
        try:
            sock.settimeout(left)
            chunk = sock.recv(1)
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    try:
        return buf[:-1].decode("ascii")
    except UnicodeDecodeError:
        return None


class LivenessServer:
    """The coordinator's end: accepts members' links and records which of them ended.

    Args:
        host: address to bind (the coordinator's; IPv4 or IPv6).
        token: the run token (None: links are accepted without a proof, as joins are).
        port: 0 for any free port (read ``.port``).
    """

    def __init__(self, host: str, token: str | None, port: int = 0) -> None:
        self.token = token
        self._sock = socket.create_server((host.strip("[]"), port), family=_family(host.strip("[]")))
        self.port = int(self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], int] = {}     # verified links now open, by member
        self._ended: dict[tuple[str, int], int] = {}    # members whose every link has ended: the end's number
        self._forgotten: set[tuple[str, int]] = set()   # dropped members: a later end of theirs is ignored
        self._ends = 0
        self._conns: set[socket.socket] = set()
        self._pending = threading.BoundedSemaphore(_PENDING_MAX)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LivenessServer":
        self._thread = threading.Thread(target=self._accept, name="shoal-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close every link (the members reopen theirs to the next coordinator)."""
        self._stop.set()
        for sock in [self._sock, *self._connections()]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def _connections(self) -> list[socket.socket]:
        with self._lock:
            return list(self._conns)

    def ended(self, run_id: str) -> dict[int, int]:
        """The run's members that opened a verified link and have none open now, with the number of that end
        (it grows with every end: a member whose link ends again after reopening gets a new one)."""
        with self._lock:
            return {i: n for (r, i), n in self._ended.items() if r == run_id}

    def closed(self, run_id: str) -> set[int]:
        """The members of :meth:`ended`, without the numbers."""
        return set(self.ended(run_id))

    def forget(self, run_id: str, member_id: int) -> None:
        """Drop what is known of a member (the coordinator dropped it: its id is never used again)."""
        with self._lock:
            self._ended.pop((run_id, member_id), None)
            self._forgotten.add((run_id, member_id))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return        # closed by stop()
                time.sleep(0.05)  # e.g. out of file descriptors: the members retry
                continue
            if self._stop.is_set() or not self._pending.acquire(blocking=False):
                conn.close()      # stopped, or too many handshakes at once: the member retries
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="shoal-liveness-link", daemon=True).start()
            except RuntimeError:  # no thread to spare: the member retries
                self._pending.release()
                conn.close()

    def _handshake(self, conn: socket.socket) -> tuple[str, int] | None:
        deadline = time.monotonic() + _HANDSHAKE_S
        line = _read_line(conn, deadline)
        try:
            hello = json.loads(line) if line is not None else None
            if not isinstance(hello, dict):
                return None
            who = (str(hello["run"]), int(hello["id"]))
        except (ValueError, TypeError, KeyError):
            return None
        nonce = auth.new_nonce()
        conn.sendall(nonce.encode() + b"\n")
        proof = _read_line(conn, deadline)
        if proof is None:
            return None
        ok = self.token is None or auth.verify(self.token, context(*who), nonce, proof)
        conn.sendall(b"ok\n" if ok else b"denied\n")
        return who if ok else None

    def _serve(self, conn: socket.socket) -> None:
        who = None
        with self._lock:
            self._conns.add(conn)
        try:
            try:
                who = self._handshake(conn)
            finally:
                self._pending.release()
            if who is None or self._stop.is_set():
                return
            with self._lock:
                self._open[who] = self._open.get(who, 0) + 1
                self._ended.pop(who, None)
            conn.settimeout(None)
            _keepalive(conn)
            while conn.recv(64):      # a member sends nothing after its handshake: wait for the end
                pass
        except OSError:
            pass                      # a reset (or a keep-alive that got no answer) is an end too
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                if who is not None and who in self._open:
                    self._open[who] -= 1
                    if self._open[who] == 0:
                        del self._open[who]
                        if who not in self._forgotten:
                            self._ends += 1
                            self._ended[who] = self._ends


class LivenessLink:
    """A member's end: keeps one verified connection to the coordinator open until :meth:`stop`.

    A connection that breaks while the member lives (or that the coordinator does not answer) is opened
    again after ``retry`` seconds; only a coordinator that refuses the proof (``denied``: a wrong token)
    stops it, logged once: the member is then judged by its heartbeat alone.
    """

    def __init__(self, host: str, port: int, run_id: str, member_id: int, token: str | None,
                 retry: float = 0.5) -> None:
        self.address = (host.strip("[]"), port)
        self.run_id, self.member_id, self.token, self.retry = run_id, member_id, token, retry
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.up = threading.Event()      # set while a verified connection is open
        self.refused = False

    def start(self) -> "LivenessLink":
        self._thread = threading.Thread(target=self._run, name="shoal-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the link now (the coordinator sees this member's end) and stop reopening it; does not wait
        for the link's thread, which ends by itself."""
        self._stop.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _open(self) -> socket.socket | None:
        sock = socket.create_connection(self.address, timeout=_HANDSHAKE_S)
        deadline = time.monotonic() + _HANDSHAKE_S
        try:
            sock.sendall(json.dumps({"run": self.run_id, "id": self.member_id}).encode() + b"\n")
            nonce = _read_line(sock, deadline)
            if nonce is None:
                sock.close()
                return None
            proof = "-" if self.token is None else auth.answer(self.token, context(self.run_id, self.member_id), nonce)
            sock.sendall(proof.encode() + b"\n")
            verdict = _read_line(sock, deadline)
        except OSError:
            sock.close()
            raise
        if verdict != "ok":
            sock.close()
            if verdict == "denied":
                log.warning("the coordinator refused member %d's liveness link (a different token?): a death of "
                            "this worker is found by the heartbeat probe only", self.member_id)
                self.refused = True
                self._stop.set()
            return None
        sock.settimeout(None)
        _keepalive(sock)
        return sock

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sock = self._open()
            except OSError as e:
                log.debug("liveness link of member %d: %s; trying again", self.member_id, e)
                sock = None
            if sock is not None:
                with self._lock:
                    self._sock = sock
                if self._stop.is_set():     # stop() ran before the socket was published
                    sock.close()
                    return
                self.up.set()
                try:
                    while sock.recv(64):
                        pass
                except OSError:
                    pass
                self.up.clear()
                with self._lock:
                    self._sock = None
                sock.close()
            self._stop.wait(self.retry)
