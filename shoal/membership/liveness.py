"""A dead worker's process tells the coordinator by closing a socket: no probe window to wait out.

After a failed step the coordinator probes heartbeats (:mod:`shoal.membership.coordinator`): a member
whose heartbeat does not advance within ``probe`` seconds is left out of the next quorum. That window
is a fixed wait on every kill's critical path (2 s on a loaded 4-host cluster), because silence is the
only sign of death a store of keys can give. A process that dies (SIGKILL, an OOM kill, a crash) has
its sockets closed by the kernel, which sends the other end a FIN or a reset at once. So every member
holds one TCP connection open to the coordinator (``LivenessServer`` there, ``LivenessLink`` here), and
a connection that ends tells the coordinator that the member's process is gone, within a round trip.

What the coordinator does with it (``Coordinator._tick_run``): a member of the current quorum whose
link ended starts a probe at once (as a failed step's request would), and counts as silent in it. The
other members answer the probe with their next heartbeat (``heartbeat_interval``), and the new quorum
is published then: ~0.1 s after the kill instead of ``probe`` seconds. The link only ever shortens the
wait for a member that is silent too: one whose link broke but whose heartbeat still advances answers
the probe and stays (its link reconnects). A member that never opened a link (an older worker, a
coordinator restarted since) is judged by its heartbeat alone, as before. A host cut off by a
partition closes nothing: the probe window and ``heartbeat_timeout`` still decide there.

Protocol (one line each, ASCII, on a connection to the port the coordinator publishes under the
store key ``liveness``)::

    member -> coordinator   {"run": "<run_id>", "id": <member id>}
    coordinator -> member   <nonce>
    member -> coordinator   <proof>    HMAC(token, "<run_id>/<id>/live", nonce), "-" without a token
    coordinator -> member   ok | denied

then both ends keep the connection open and silent until the member leaves or dies.
``SHOAL_LIVENESS=off`` in a worker's environment opens no link (a network that blocks the port:
the worker is then judged by its heartbeat alone, as tests of the heartbeat paths need). The proof's
context differs from the join challenge's, so a proof given here cannot admit anyone. The published
port is signed with the token (``auth.sign``): a member does not answer challenges from a stranger.

Example::

    server = LivenessServer("127.0.0.1", token="s3cret-token").start()   # inside the Coordinator
    link = LivenessLink("127.0.0.1", server.port, "run1", 7, "s3cret-token").start()   # in a member
    ...
    link.stop()                      # leave: the coordinator sees ("run1", 7) closed
    server.closed("run1")            # {7}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading

from shoal.errors import ConfigError
from shoal.membership import auth

log = logging.getLogger("shoal.elastic")
STORE_KEY = "liveness"
_LINE_MAX = 4096          # a handshake line longer than this is not a member's
_HANDSHAKE_S = 10.0       # a connection that does not finish its handshake in this long is dropped


def enabled() -> bool:
    """``$SHOAL_LIVENESS``: ``on`` (the default) or ``off`` (no link: this worker is judged by its heartbeat alone)."""
    value = os.environ.get("SHOAL_LIVENESS", "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"SHOAL_LIVENESS must be 'on' or 'off', got {value!r}")
    return value == "on"


def context(run_id: str, member_id: int) -> str:
    """What a member's liveness proof is bound to (never equal to a join challenge's context)."""
    return f"{run_id}/{member_id}/live"


def port_record(port: int, token: str | None) -> str:
    """The store value that publishes the server's port: ``"<port>"``, or ``"<port> <signature>"``."""
    return str(port) if token is None else f"{port} {auth.sign(token, f'liveness {port}')}"


def read_port(value: bytes | str, token: str | None) -> int | None:
    """The port of a ``port_record``; None if it is malformed or not signed with ``token``."""
    text = value.decode() if isinstance(value, bytes) else str(value)
    port, _, tag = text.partition(" ")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if token is not None and not auth.verify(token, "record", f"liveness {port}", tag):
        return None
    return int(port)


def _read_line(sock: socket.socket) -> str | None:
    """One ``\\n``-terminated line (without it), or None at EOF, on a bad line or after the socket's timeout."""
    buf = b""
    while not buf.endswith(b"\n"):
        try:
            chunk = sock.recv(1)
        except OSError:
            return None
        if not chunk or len(buf) >= _LINE_MAX:
            return None
        buf += chunk
    try:
        return buf[:-1].decode("ascii")
    except UnicodeDecodeError:
        return None


class LivenessServer:
    """The coordinator's end: accepts members' links and records which of them ended.

    Args:
        host: address to bind (the coordinator's).
        token: the run token (None: links are accepted without a proof, as joins are).
        port: 0 for any free port (read ``.port``).
    """

    def __init__(self, host: str, token: str | None, port: int = 0) -> None:
        self.token = token
        self._sock = socket.create_server((host, port))
        self.port = int(self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], int] = {}     # verified links now open, by member
        self._ended: set[tuple[str, int]] = set()       # members whose every link has ended
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LivenessServer":
        self._thread = threading.Thread(target=self._accept, name="shoal-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass

    def closed(self, run_id: str) -> set[int]:
        """The run's members that opened a verified link and have none open now."""
        with self._lock:
            return {i for r, i in self._ended if r == run_id}

    def forget(self, run_id: str, member_id: int) -> None:
        """Drop what is known of a member (the coordinator dropped it: its id is never used again)."""
        with self._lock:
            self._ended.discard((run_id, member_id))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return        # closed by stop()
            threading.Thread(target=self._serve, args=(conn,), name="shoal-liveness-link", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> tuple[str, int] | None:
        conn.settimeout(_HANDSHAKE_S)
        line = _read_line(conn)
        try:
            hello = json.loads(line) if line is not None else None
            if not isinstance(hello, dict):
                return None
            who = (str(hello["run"]), int(hello["id"]))
        except (ValueError, TypeError, KeyError):
            return None
        nonce = auth.new_nonce()
        conn.sendall(nonce.encode() + b"\n")
        proof = _read_line(conn)
        ok = proof is not None and (self.token is None or auth.verify(self.token, context(*who), nonce, proof))
        conn.sendall(b"ok\n" if ok else b"denied\n")
        return who if ok else None

    def _serve(self, conn: socket.socket) -> None:
        who = None
        try:
            who = self._handshake(conn)
            if who is None:
                return
            with self._lock:
                self._open[who] = self._open.get(who, 0) + 1
                self._ended.discard(who)
            conn.settimeout(None)
            while conn.recv(64):      # a member sends nothing after its handshake: wait for the end
                pass
        except OSError:
            pass                      # a reset is an end too
        finally:
            conn.close()
            if who is not None:
                with self._lock:
                    self._open[who] -= 1
                    if self._open[who] == 0:
                        del self._open[who]
                        self._ended.add(who)


class LivenessLink:
    """A member's end: keeps one verified connection to the coordinator open until :meth:`stop`.

    A connection that breaks while the member lives is opened again (after ``retry`` seconds); one the
    coordinator refuses (a wrong token) is not, and is logged once: the member is then judged by its
    heartbeat alone.
    """

    def __init__(self, host: str, port: int, run_id: str, member_id: int, token: str | None,
                 retry: float = 0.5) -> None:
        self.address = (host, port)
        self.run_id, self.member_id, self.token, self.retry = run_id, member_id, token, retry
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.up = threading.Event()      # set while a verified connection is open

    def start(self) -> "LivenessLink":
        self._thread = threading.Thread(target=self._run, name="shoal-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the link (the coordinator sees this member's end) and stop reopening it."""
        self._stop.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _open(self) -> socket.socket | None:
        sock = socket.create_connection(self.address, timeout=_HANDSHAKE_S)
        hello = json.dumps({"run": self.run_id, "id": self.member_id})
        sock.sendall(hello.encode() + b"\n")
        nonce = _read_line(sock)
        if nonce is None:
            sock.close()
            return None
        proof = "-" if self.token is None else auth.answer(self.token, context(self.run_id, self.member_id), nonce)
        sock.sendall(proof.encode() + b"\n")
        if _read_line(sock) != "ok":
            sock.close()
            log.warning("the coordinator refused member %d's liveness link (a different token?): a death of "
                        "this worker is found by the heartbeat probe only", self.member_id)
            self._stop.set()
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)   # a NAT keeps an idle link's state
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
