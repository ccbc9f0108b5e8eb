"""Serving the run's state to joiners from a side thread, and fetching it striped over several members.

The transport of the background heal (:mod:`shoal.membership.catchup`):
survivors never block on sending state. Each member that holds the run's
state takes a *consistent snapshot* at a step boundary (:func:`clone_tree`:
a copy of every registered state on the tensors' own devices, issued on the
training thread's stream, so no host sync), and a background thread turns it
into bytes (on CUDA: on its own stream, after an event recorded behind the
copy) and serves them over plain TCP (:class:`SnapshotServer`), on the
address the member reaches the coordinator from. The joiner
(:class:`Download`) asks every source for byte ranges of the same snapshot,
one thread per source pulling chunks from a shared queue, so the transfer is
striped; a source that dies mid-transfer loses its chunk back to the queue,
and the others finish.

Pacing: on a slow link a source's upload is also where its gradients go,
so an unpaced download stalls the survivors' steps for as long as it takes
(4 hosts x 20 mbit, DDP: ~12 s per join, docs/BENCHMARKS.md). With a
``rate`` (``SHOAL_HEAL_RATE``, e.g. ``4mbit``) a source sends at most that
many bytes a second, all joiners together (:class:`Pacer`): the download
takes longer and the joiner replays more steps, but the survivors' steps
lose only that share of the link. ``SHOAL_HEAL_PACE`` paces from the
joiner's side instead, by the run's committed steps (``Download.pace``,
:mod:`shoal.membership.pace`). A download the joiner gives up on is
stopped (``Download.stop``), never released to full speed.

Security: a joiner proves it holds the run token before anything is served
(``HMAC-SHA256(token, "<run>/heal/<member>", nonce)`` for a fresh nonce of
the server's, as at the join; the token never travels). What it receives is
checked against the sha256 each source published in the coordinator's store,
in a record signed with that source's session key
(:mod:`shoal.membership.records`), before anything is loaded; then
:mod:`shoal.membership.received` checks shapes, dtypes and NaN/Inf as for a
blocking heal.

Example (what :class:`~shoal.membership.catchup.CatchUp` does)::

    server = SnapshotServer(token, run_id, host="127.0.0.1")
    server.offer(hid=7, tree=clone_tree(states), joiners={5}, published=lambda size, sha, digests: ...)
    dl = Download(hid=7, sources={0: ("127.0.0.1:4123", size, sha)}, token=token, run_id=run_id, member=5)
    dl.start(); dl.join(); blob = dl.blob
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shoal.comm.objects import map_tensors, to_bytes
from shoal.comm.streams import SideStream
from shoal.membership import auth

log = logging.getLogger("shoal.elastic")
_REQ = struct.Struct("!cqqq")     # kind (G: get a range, D: done), heal id, offset or member, length
_LEN = struct.Struct("!q")        # reply: bytes that follow, -1 if the snapshot is not (or no longer) here
_HELLO = struct.Struct("!q")      # the joiner's member id, then its 64-hex-digit proof
_SLICE = 1 << 16                  # bytes sent between two pacing decisions
_SPAN = 1 << 12                   # bytes per published range digest: a multiple of this (see digest_span)
_MAX_DIGESTS = 256                # ... and at most this many digests per snapshot (its record stays small)


def digest_span(size: int) -> int:
    """The bytes each range digest of a ``size``-byte snapshot covers: the smallest multiple of 4 KiB that
    gives at most 256 digests (100 KiB for DiLoCo's 26 MB on the bench's ``lm``; a record of ~9 KB)."""
    return _SPAN * max(1, -(-size // (_SPAN * _MAX_DIGESTS)))


def range_digest(data: Any) -> str:
    """The digest a source publishes for one range of its snapshot (BLAKE2b, 128 bits, hex)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def range_digests(data: bytes) -> list[str]:
    """One :func:`range_digest` per :func:`digest_span` bytes of ``data``: what lets a joiner take the ranges it
    already holds (a seed: :mod:`shoal.membership.seed`) from its own copy instead of the network."""
    span, view = digest_span(len(data)), memoryview(data)
    return [range_digest(view[a:a + span]) for a in range(0, len(data), span)]


class Pacer:
    """At most ``rate`` bytes a second through :meth:`take`, every caller together; ``None``: no limit.

    Each caller reserves its bytes' time slot in turn (a virtual clock that may
    lag the real one by one slice at most, so an idle pacer gives no burst
    larger than a slice) and sleeps until the slot, outside the lock.

    Example (1 MB/s: the first slice goes at once, the next 200 KB no sooner than ~0.2 s later)::

        pacer = Pacer(1e6)
        for piece in pieces:
            pacer.take(len(piece))
            conn.sendall(piece)
    """

    def __init__(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"a pacing rate must be > 0 bytes/s, got {rate!r}")
        self.rate = rate
        self._due = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._due = max(self._due, now - _SLICE / self.rate) + n / self.rate
            wait = self._due - now
        if wait > 0:
            time.sleep(wait)


def local_address(coordinator: str) -> str:
    """The address this host reaches ``coordinator`` ("host:port") from: where peers can reach it too."""
    host, port = coordinator.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))   # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


def clone_tree(obj: Any) -> Any:
    """A copy of ``obj`` (nested dicts, lists, tuples) whose tensors are cloned on their own devices.

    Issued on the current stream: the copy is ordered after the step that
    produced the values and before the next one changes them, with no host sync.
    """
    return map_tensors(obj, lambda t: t.detach().clone())


def host_copy(obj: Any) -> tuple[Any, Any]:
    """A host copy of ``obj`` (nested dicts, lists, tuples) taken without a host sync, and when it is complete.

    CUDA tensors are copied to the host with ``non_blocking=True`` on the current stream (no GPU memory is
    taken for it), CPU tensors cloned. Returns ``(copy, ready)``: ``ready`` holds an event per CUDA device,
    recorded right behind that device's copies (None where no tensor was on CUDA); the copy may be read once
    they have completed (``ready.synchronize()``, on a background thread).
    """
    devices: list[torch.device] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            devices.append(t.device)
            return t.detach().to("cpu", non_blocking=True)
        return t.detach().clone()

    out = map_tensors(obj, copy)
    return out, (_Events(sorted(set(devices), key=str)) if devices else None)


class _Events:
    """One event per CUDA device that :func:`host_copy` copied from, each recorded on that device's current
    stream right behind its copies; :meth:`synchronize` waits for all of them."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.events: list[Any] = []
        for d in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(d))
            self.events.append(event)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` (nested dicts, lists, tuples), in the order :func:`clone_tree` walks them.

    Example::

        tree_tensors({"a": torch.ones(2), "b": [torch.zeros(1), 3]})   # [ones(2), zeros(1)]
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tree_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tree_tensors(v)]
    return []


def side_after(tree: Any) -> tuple[SideStream, Any]:
    """The side stream that serialises ``tree`` (on its first CUDA tensor's device; a no-op on the CPU) and an
    event recorded now on the training thread's stream, right behind the clones (None on the CPU)."""
    cuda = [t.device for t in tree_tensors(tree) if t.is_cuda]
    side = SideStream(cuda[0] if cuda else torch.device("cpu"))
    return side, side.ready()


def serialise_snapshot(tree: Any, side: SideStream, ready: Any) -> bytes:
    """``tree`` (from :func:`clone_tree`) as bytes, on a background thread.

    On CUDA the host copy runs on ``side``'s stream after ``ready`` (an event
    the training thread recorded right behind the clone); the clones are
    marked as used by that stream so the allocator keeps them, and only this
    background thread waits for the copy.
    """
    def to_host() -> Any:
        if side.stream is not None:
            for t in tree_tensors(tree):
                if t.is_cuda:
                    t.record_stream(side.stream)
        return _to_cpu(tree)

    host, done = side.run(ready, to_host)
    if done is not None:
        done.synchronize()
    return bytes(to_bytes(host).numpy().tobytes())


def _to_cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.to("cpu", non_blocking=True))


@dataclass
class _Snap:
    data: bytes | None = None
    joiners: set[int] = field(default_factory=set)
    used: float = field(default_factory=time.monotonic)
    step: int = -1   # the step whose begin state it is (-1: not said); a re-offer under its heal id replaces it


class SnapshotServer:
    """Serves snapshots of this member's state to authenticated joiners, from daemon threads.

    Args:
        token: the run token (joiners prove they hold it).
        run_id: the run (binds the proofs to it).
        host: the address to listen on (:func:`local_address`).
        idle: a snapshot nobody asked for in this many seconds is dropped.
        rate: at most this many bytes a second to all joiners together (``None``: no limit).
    """

    def __init__(self, token: str, run_id: str, host: str, idle: float = 300.0, rate: float | None = None) -> None:
        self.token, self.run_id, self.idle = token, run_id, idle
        self.pacer = Pacer(rate)
        self._snaps: dict[int, _Snap] = {}
        self.finished: set[tuple[int, int, int]] = set()   # (heal id, step, joiner) of the snapshots it fetched
        self._lock = threading.Lock()
        self._publish = threading.Lock()   # one snapshot's record at a time (see offer)
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.served = 0          # bytes sent, all joiners together
        threading.Thread(target=self._accept, name="shoal-heal-serve", daemon=True).start()

    def offer(self, hid: int, tree: Any, joiners: set[int], published: Callable[[int, str, list[str]], None],
              step: int = -1) -> None:
        """Serve ``tree`` (the state at step ``step``'s begin) as heal ``hid`` to ``joiners`` once serialised in a
        thread, then ``published(size, sha, digests)`` (:func:`range_digests`); it replaces an earlier offer of
        that heal (of another step)."""
        mine = _Snap(joiners=set(joiners), step=step)
        with self._lock:
            self._snaps[hid] = mine
            self.finished = {f for f in self.finished if f[0] != hid}
        side, ready = side_after(tree)

        def work() -> None:
            try:
                data = serialise_snapshot(tree, side, ready)
            except Exception:  # noqa: BLE001 - nothing to serve: the joiner times out and asks again
                log.exception("could not serialise the snapshot of heal %d", hid)
                with self._lock:
                    if self._snaps.get(hid) is mine:   # not a re-offer made meanwhile
                        del self._snaps[hid]
                return
            # Replaced meanwhile by a re-offer (or dropped): this one is never published. Its record is written
            # under _publish, so an earlier offer's record never lands after a later one's.
            with self._publish:
                with self._lock:
                    if self._snaps.get(hid) is not mine:
                        return
                    mine.data = data
                published(len(data), hashlib.sha256(data).hexdigest(), range_digests(data))

        threading.Thread(target=work, name="shoal-heal-snapshot", daemon=True).start()

    def admit(self, hid: int, joiners: set[int], step: int) -> set[int]:
        """Let ``joiners`` too fetch heal ``hid`` of step ``step`` if it was offered here (before the admission);
        the joiners it must still be offered to: none if it is served, else those that have not fetched it."""
        with self._lock:
            left = {m for m in joiners if (hid, step, m) not in self.finished}
            snap = self._snaps.get(hid)
            if snap is not None and snap.step == step:
                snap.joiners |= left
                return set()
            return left

    def drop(self, hid: int) -> None:
        with self._lock:
            self._snaps.pop(hid, None)

    def keep(self, wanted: set[tuple[int, int]]) -> None:
        """Drop every snapshot none of whose joiners still wants it (``wanted``: (joiner, heal id) pairs)."""
        with self._lock:
            for hid in [h for h, s in self._snaps.items() if not any((m, h) in wanted for m in s.joiners)]:
                del self._snaps[hid]
            self.finished = {f for f in self.finished if (f[2], f[0]) in wanted}

    def owed(self) -> list[tuple[int, int]]:
        """(heal id, joiner) for every joiner that has not said it is done with a snapshot held here."""
        with self._lock:
            return [(hid, m) for hid, snap in self._snaps.items() for m in snap.joiners]

    def holding(self) -> list[int]:
        """The heal ids served now (snapshots idle for longer than ``idle`` are dropped first)."""
        now = time.monotonic()
        with self._lock:
            for hid in [h for h, s in self._snaps.items() if now - s.used > self.idle]:
                del self._snaps[hid]
            return sorted(self._snaps)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="shoal-heal-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                _no_delay(conn)
                nonce = auth.new_nonce()
                conn.sendall(nonce.encode())
                member = _HELLO.unpack(_recv(conn, _HELLO.size))[0]
                proof = _recv(conn, 64).decode(errors="replace")
                if not auth.verify(self.token, f"{self.run_id}/heal/{member}", nonce, proof):
                    log.warning("refused a state download by a peer claiming member %d: wrong proof", member)
                    return
                conn.sendall(b"K")
                while True:
                    kind, hid, a, n = _REQ.unpack(_recv(conn, _REQ.size))
                    if kind == b"D":   # a: the joiner, n: the step of the snapshot it fetched
                        self._done(hid, member, n)
                        continue
                    self._send_range(conn, hid, a, n)
            except (OSError, ConnectionError, struct.error):
                return    # the joiner went away (or finished): nothing to clean up

    def _send_range(self, conn: socket.socket, hid: int, start: int, n: int) -> None:
        with self._lock:
            snap = self._snaps.get(hid)
            data = snap.data if snap is not None else None
            if snap is not None:
                snap.used = time.monotonic()
        if data is None or start < 0 or n < 0 or start + n > len(data):
            conn.sendall(_LEN.pack(-1))
            return
        conn.sendall(_LEN.pack(n))
        view = memoryview(data)[start:start + n]
        for at in range(0, n, _SLICE):
            piece = view[at:at + _SLICE]
            self.pacer.take(len(piece))
            conn.sendall(piece)
        self.served += n

    def _done(self, hid: int, member: int, step: int) -> None:
        """``member`` fetched heal ``hid`` of step ``step``: a late word about a snapshot replaced since (of
        another step) leaves the new one alone."""
        with self._lock:
            snap = self._snaps.get(hid)
            if snap is not None and snap.step == step:
                self.finished.add((hid, step, member))
                snap.joiners.discard(member)
                if not snap.joiners:
                    del self._snaps[hid]

    def close(self) -> None:
        self._sock.close()


def _no_delay(conn: socket.socket) -> None:
    """Send small writes at once. Each chunk is a request, a length and the bytes: with Nagle's
    algorithm the bytes wait for the ACK of the length, which the peer delays (~40 ms a chunk:
    256 KB took 0.36 s over loopback in chunks of 32 KB)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise ConnectionError("peer closed the connection")
        buf += got
    return bytes(buf)


@dataclass(frozen=True)
class Source:
    """One member serving a heal: its member id, address and the size and sha256 it published, and its range
    digests (:func:`range_digests`; empty: none published)."""

    member: int
    address: str
    size: int
    sha: str
    digests: tuple[str, ...] = ()


class Download(threading.Thread):
    """Fetch heal ``hid`` from ``sources`` (all with the same size and sha256), striped, in the background.

    One thread per source pulls ``chunk``-byte ranges from a shared queue; a
    source that fails gives its range back and stops, the others go on. When
    every range arrived and the sha256 matches, :attr:`blob` holds the bytes;
    if every source failed (or the bytes do not match), :attr:`error` says why.
    ``before_chunk(source, received_so_far)``, if set, runs before every request
    (tests park a download there). ``pace`` (a :class:`~shoal.membership.pace.StepPace`), if set,
    holds every request until one of its slots is open; ``hold()``, if set, holds every request for
    as long as it returns True (an averaging strategy's joiner while it is in a round). :meth:`stop`
    abandons the download: no request goes out after it, the connections are closed, and it ends
    without a :attr:`blob`. ``seed`` (bytes), if set, is a copy this joiner already holds
    (:mod:`shoal.membership.seed`): the ranges whose digest matches the sources' are taken from it
    (:attr:`seeded` bytes), and if the whole then does not match the sha256, everything is fetched.
    """

    def __init__(self, hid: int, sources: list[Source], token: str, run_id: str, member: int,
                 chunk: int = 1 << 20, timeout: float = 60.0, step: int = -1) -> None:
        super().__init__(name="shoal-heal-download", daemon=True)
        self.hid, self.sources, self.token, self.run_id, self.member = hid, sources, token, run_id, member
        self.step = step   # the step whose begin state the sources offer (their records say), -1: not said
        self.chunk, self.timeout = chunk, timeout
        self.blob: bytes | None = None
        self.error: str | None = None
        self.received = 0
        self.by_source: dict[int, int] = {s.member: 0 for s in sources}
        self.failed: dict[int, str] = {}
        self.before_chunk: Callable[[int, int], None] | None = None
        self.seed: bytes | None = None
        self.seeded = 0     # bytes taken from the seed, not the network
        self.to_fetch: int | None = None   # bytes it asks the network for, once it compared the seed (None before)
        self.pace: Any = None
        self.hold: Callable[[], bool] | None = None
        self.held_s = 0.0   # seconds the requests waited for hold() (summed over the sources' threads)
        self.t0 = time.monotonic()
        self.seconds = 0.0
        self.stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def stop(self) -> None:
        """Abandon the download (a joiner that gave it up): whatever arrives from now on is dropped.

        A request waiting for a pace slot stops waiting, and a range in flight is cut off (its
        connection is shut down), so the threads end within a poll (50 ms), not when the transfer
        would have. Never released to full speed: nobody uses what it would fetch.
        """
        self.stopped.set()
        with self._conns_lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass   # already closed by its thread

    def run(self) -> None:
        if self.stopped.is_set():   # given up before it started: no buffer, no connection, no request
            self.error = f"the download of heal {self.hid} was stopped (given up on); nothing of it is used"
            return
        size, sha = self.sources[0].size, self.sources[0].sha
        buf = bytearray(size)
        spans = self._from_seed(buf)
        self.to_fetch = sum(n for _, n in spans)
        left = self._fetch(buf, spans)
        matches = left == 0 and not self.stopped.is_set() and hashlib.sha256(buf).hexdigest() == sha
        if left == 0 and self.seeded and not self.stopped.is_set() and not matches:
            log.warning("heal %d: the state assembled with %d bytes of this host's copy does not match the "
                        "sources' sha256; fetching all of it", self.hid, self.seeded)
            self.seeded = 0
            left = self._fetch(buf, [(0, size)])
            matches = left == 0 and not self.stopped.is_set() and hashlib.sha256(buf).hexdigest() == sha
        self.seconds = time.monotonic() - self.t0
        if self.stopped.is_set():
            self.error = f"the download of heal {self.hid} was stopped (given up on); nothing of it is used"
        elif left > 0:
            self.error = (f"every source of heal {self.hid} failed "
                          f"({'; '.join(f'member {m}: {why}' for m, why in sorted(self.failed.items()))})")
        elif not matches:
            self.error = f"the state downloaded for heal {self.hid} does not match the sha256 its sources published"
        else:
            self.blob = bytes(buf)
            if self.seeded:
                self._say_done()

    def _from_seed(self, buf: bytearray) -> list[tuple[int, int]]:
        """Copy into ``buf`` the seed's ranges whose digest the sources published; the (start, length) spans
        still to fetch (all of it without a seed or digests)."""
        size, digests, seed = len(buf), self.sources[0].digests, self.seed
        span = digest_span(size)
        if not seed or len(digests) != -(-size // span):
            return [(0, size)] if size else []
        view = memoryview(seed)
        missing: list[tuple[int, int]] = []
        for i, want in enumerate(digests):
            a, b = i * span, min(size, (i + 1) * span)
            if b <= len(seed) and range_digest(view[a:b]) == want:
                buf[a:b] = view[a:b]
                self.seeded += b - a
            elif missing and missing[-1][0] + missing[-1][1] == a:
                missing[-1] = (missing[-1][0], missing[-1][1] + b - a)
            else:
                missing.append((a, b - a))
        return missing

    def _fetch(self, buf: bytearray, spans: list[tuple[int, int]]) -> int:
        """Fetch ``spans`` of the snapshot into ``buf``, in chunks striped over the sources; the chunks not
        fetched (every source failed, or the download was stopped)."""
        todo: queue.Queue[tuple[int, int]] = queue.Queue()
        for a, n in spans:
            for start in range(a, a + n, self.chunk):
                todo.put((start, min(self.chunk, a + n - start)))
        left = [todo.qsize()]
        if left[0] == 0:
            return 0
        lock = threading.Lock()
        threads = [threading.Thread(target=self._pull, args=(s, buf, todo, left, lock), daemon=True)
                   for s in self.sources if s.member not in self.failed]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return left[0]

    def _paced(self, left: list[int], lock: threading.Lock) -> bool:
        """Wait for a slot of the run's step (``pace``); False once the other sources fetched every range,
        or the download was stopped."""
        while not self.pace.wait(timeout=0.05):
            with lock:
                if left[0] == 0 or self.stopped.is_set():
                    return False
        return not self.stopped.is_set()

    def _unheld(self) -> bool:
        """Wait while ``hold()`` is True; False if the download was stopped meanwhile."""
        t0 = time.monotonic()
        while self.hold is not None and self.hold():
            if self.stopped.wait(0.01):
                return False
        with self._conns_lock:
            self.held_s += time.monotonic() - t0
        return not self.stopped.is_set()

    def _open(self, src: Source, timeout: float | None = None) -> socket.socket:
        """A connection to ``src`` on which this joiner proved the run token (tracked: :meth:`stop` cuts it)."""
        host, port = src.address.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=self.timeout if timeout is None else timeout)
        try:
            with self._conns_lock:
                self._conns.add(conn)
            _no_delay(conn)
            nonce = _recv(conn, 2 * auth.NONCE_BYTES).decode()
            proof = auth.answer(self.token, f"{self.run_id}/heal/{self.member}", nonce)
            conn.sendall(_HELLO.pack(self.member) + proof.encode())
            if _recv(conn, 1) != b"K":
                raise ConnectionError("refused our proof of the run token")
        except BaseException:
            conn.close()
            raise
        return conn

    def _say_done(self) -> None:
        """A download that took ranges from its seed tells every source it is done once the sha256 matched (the
        word its ranges' connections did not send), so that each drops its snapshot; a source that does not
        answer within 2 s has its snapshot dropped at the next quorum instead (the state waits for this)."""
        for src in self.sources:
            if src.member in self.failed:
                continue
            try:
                with self._open(src, timeout=min(self.timeout, 2.0)) as conn:
                    conn.sendall(_REQ.pack(b"D", self.hid, self.member, self.step))
            except (OSError, ConnectionError, struct.error, UnicodeDecodeError) as e:
                log.debug("heal %d: could not tell member %d the download is done (%s)", self.hid, src.member, e)

    def _pull(self, src: Source, buf: bytearray, todo: queue.Queue[tuple[int, int]], left: list[int],
              lock: threading.Lock) -> None:
        job: tuple[int, int] | None = None
        try:
            with self._open(src) as conn:
                if self.stopped.is_set():   # stopped while connecting: stop() did not see this connection
                    return
                while not self.stopped.is_set():
                    with lock:
                        if left[0] == 0:
                            break
                    if self.pace is not None and not self._paced(left, lock):
                        break
                    if self.hold is not None and not self._unheld():
                        break
                    try:
                        job = todo.get(timeout=0.05)
                    except queue.Empty:
                        continue   # another source holds the last ranges; it may still fail and give them back
                    if self.before_chunk is not None:
                        self.before_chunk(src.member, self.received)
                    if self.stopped.is_set():
                        break
                    start, n = job
                    conn.sendall(_REQ.pack(b"G", self.hid, start, n))
                    if _LEN.unpack(_recv(conn, _LEN.size))[0] != n:
                        raise ConnectionError(f"does not serve heal {self.hid} (any more)")
                    buf[start:start + n] = _recv(conn, n)
                    job = None
                    with lock:
                        left[0] -= 1
                        self.received += n
                        self.by_source[src.member] += n
                if not self.seeded:   # with a seed, only once the sha256 matched (_say_done): it may yet
                    try:              # send the download back for everything
                        conn.sendall(_REQ.pack(b"D", self.hid, self.member, self.step))
                    except OSError:
                        pass
        except (OSError, ConnectionError, struct.error, UnicodeDecodeError) as e:
            if self.stopped.is_set():
                return    # cut off by stop(): not the source's failure
            self.failed[src.member] = f"{type(e).__name__}: {e}"
            log.warning("heal %d: source member %d failed (%s); its ranges go to the others", self.hid,
                        src.member, e)
        finally:
            if job is not None:
                todo.put(job)
