"""The background heal's transport (shoal.membership.stateserve), in one process over loopback."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from shoal.comm.objects import from_bytes
from shoal.membership.stateserve import Download, SnapshotServer, Source, clone_tree

TOKEN, RUN = "test-token-123", "run-x"


def _serve(tree: Any, hid: int = 3, joiners: frozenset[int] = frozenset({9})) -> tuple[SnapshotServer, Source]:
    server = SnapshotServer(TOKEN, RUN, "127.0.0.1")
    got: dict[str, Any] = {}
    ready = threading.Event()

    def published(size: int, sha: str, digests: list[str]) -> None:
        got.update(size=size, sha=sha, digests=tuple(digests))
        ready.set()

    server.offer(hid, tree, set(joiners), published)
    assert ready.wait(30)
    return server, Source(0, server.address, got["size"], got["sha"], got["digests"])


def _tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g)}, "cursor": {"cursor": 48}}


def test_snapshot_is_a_copy_taken_at_the_boundary() -> None:
    w = torch.zeros(3)
    snap = clone_tree({"w": w, "groups": [{"lr": 0.1}]})
    w.add_(1.0)      # the next step changes the live state
    assert torch.equal(snap["w"], torch.zeros(3)) and snap["groups"] == [{"lr": 0.1}]


@pytest.mark.timeout(60)
def test_striped_download_resumes_from_the_other_source_when_one_stops_serving() -> None:
    tree = _tree()
    a, sa = _serve(clone_tree(tree))
    b, sb = _serve(clone_tree(tree))
    sa, sb = Source(1, sa.address, sa.size, sa.sha), Source(2, sb.address, sb.size, sb.sha)
    assert sa.sha == sb.sha   # the same state serialises to the same bytes: it can be striped
    dl = Download(3, [sa, sb], TOKEN, RUN, member=9, chunk=512)
    dropped = threading.Event()

    def before_chunk(source: int, received: int) -> None:
        if source == 1 and received > 0 and not dropped.is_set():
            a.drop(3)      # source 1 goes away mid-transfer (as a killed member's server would)
            dropped.set()
        elif source == 2:  # source 2 waits for that: else it may fetch every chunk left first
            dropped.wait(10)

    dl.before_chunk = before_chunk
    dl.run()
    assert dl.error is None and dl.blob is not None
    assert list(dl.failed) == [1] and dl.by_source[2] > 0
    assert dl.received == sa.size
    got = from_bytes(torch.frombuffer(bytearray(dl.blob), dtype=torch.uint8))
    assert torch.equal(got["model"]["w"], tree["model"]["w"]) and got["cursor"] == {"cursor": 48}
    a.close(), b.close()


def test_a_joiner_without_the_run_token_is_served_nothing() -> None:
    server, src = _serve(_tree())
    dl = Download(3, [src], "not-the-token", RUN, member=9, chunk=512)
    dl.run()
    assert dl.blob is None and dl.error is not None and "every source" in dl.error
    assert server.served == 0
    server.close()


def test_bytes_that_do_not_match_the_published_sha256_are_refused() -> None:
    server, src = _serve(_tree())
    dl = Download(3, [Source(0, src.address, src.size, "0" * 64)], TOKEN, RUN, member=9, chunk=4096)
    dl.run()
    assert dl.blob is None and dl.error is not None and "sha256" in dl.error
    server.close()


def test_a_snapshot_is_dropped_once_every_joiner_said_done() -> None:
    server, src = _serve(_tree(), joiners=frozenset({9}))
    assert server.holding() == [3]
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=4096)
    dl.run()
    assert dl.error is None
    for _ in range(200):   # the server thread handles the joiner's "done" asynchronously
        if not server.holding():
            break
        threading.Event().wait(0.01)
    assert server.holding() == []
    server.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_serialises_on_a_side_stream() -> None:
    tree = {"w": torch.randn(1000, device="cuda")}
    server, src = _serve(clone_tree(tree))
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=1024)
    dl.run()
    assert dl.blob is not None
    got = from_bytes(torch.frombuffer(bytearray(dl.blob), dtype=torch.uint8))
    assert torch.equal(got["w"], tree["w"].cpu())
    server.close()


def test_a_snapshot_nobody_wants_any_more_is_dropped() -> None:
    server, _ = _serve(_tree(), hid=3, joiners=frozenset({9}))
    server.keep({(9, 3), (7, 4)})
    assert server.holding() == [3]
    server.keep({(7, 4)})            # joiner 9 left the quorum (died, or is needy again under a new heal)
    assert server.holding() == []
    server.close()


def test_a_refusal_asked_every_round_is_kept_once() -> None:
    # run_round(group, fn) refuses the background heal at every round: the list must not grow with the run.
    from shoal.membership.catchup import CatchUp

    class _Group:
        def on_commit(self, fn: Any) -> None: ...

    c = CatchUp(_Group())
    for _ in range(100):
        c.refuse("a round of collectives means every member")
    c.refuse("shoal DDP with a codec")
    assert [w for w, _ in c.refusals] == ["a round of collectives means every member", "shoal DDP with a codec"]


@pytest.mark.timeout(60)
def test_a_paced_source_sends_no_faster_than_its_rate_and_the_bytes_arrive_whole() -> None:
    # A lower bound only (a loaded machine can only make it slower): 256 KB at 1 MB/s take >= ~0.2 s,
    # where an unpaced loopback transfer takes milliseconds.
    import time

    from shoal.membership.stateserve import _SLICE

    tree = {"w": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(1))}   # 256 KiB of fp32
    server, src = _serve(clone_tree(tree))
    server.pacer = type(server.pacer)(1e6)
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=32 * 1024)
    t0 = time.monotonic()
    dl.run()
    took = time.monotonic() - t0
    assert dl.error is None and dl.blob is not None
    assert torch.equal(from_bytes(torch.frombuffer(bytearray(dl.blob), dtype=torch.uint8))["w"], tree["w"])
    server.close()
    assert took >= (src.size - _SLICE) / 1e6, f"{src.size} bytes in {took:.3f} s at a 1 MB/s pace"


def test_heal_rate_reads_shoal_heal_rate_and_says_what_is_wrong(monkeypatch: Any) -> None:
    from shoal.errors import ConfigError
    from shoal.membership.catchup import heal_rate

    monkeypatch.delenv("SHOAL_HEAL_RATE", raising=False)
    assert heal_rate() is None
    monkeypatch.setenv("SHOAL_HEAL_RATE", "4mbit")
    assert heal_rate() == 5e5
    monkeypatch.setenv("SHOAL_HEAL_RATE", "fast")
    with pytest.raises(ConfigError, match="SHOAL_HEAL_RATE: bandwidth 'fast' is not a tc rate"):
        heal_rate()


@pytest.mark.timeout(60)
def test_both_ends_of_a_download_send_small_writes_at_once(monkeypatch: Any) -> None:
    # Each chunk is a request, a length and the bytes: with Nagle's algorithm on, the bytes waited for
    # the ACK of the length, which the joiner delays (~40 ms a chunk; 256 KB in chunks of 32 KB took 0.36 s).
    import socket

    import shoal.membership.stateserve as ss

    seen: list[int] = []
    real = ss._no_delay

    def recording(conn: socket.socket) -> None:
        real(conn)
        seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(ss, "_no_delay", recording)
    server, src = _serve(_tree())
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=512)
    dl.run()
    server.close()
    assert dl.error is None and len(seen) == 2 and all(seen), f"TCP_NODELAY on the two ends: {seen}"


def test_a_download_stopped_before_it_started_does_not_connect() -> None:
    # CatchUp gives up on an admission whose download thread may not have started yet: that download must
    # not then connect to its sources (nor allocate the state's size) for nothing.
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    src = Source(0, "127.0.0.1:%d" % listener.getsockname()[1], 1 << 20, "0" * 64)
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=4096)
    dl.stop()
    dl.run()
    assert dl.blob is None and dl.error is not None and "stopped" in dl.error
    with pytest.raises(socket.timeout):
        listener.accept()      # nobody connected
    listener.close()


@pytest.mark.timeout(60)
def test_a_held_download_asks_for_nothing_until_hold_lifts_then_completes() -> None:
    # An averaging strategy's joiner holds its requests while it is in a round (Fetch sets hold).
    server, src = _serve(_tree())
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=512)
    held, asked_while_held, started = threading.Event(), [], []

    def before_chunk(source: int, received: int) -> None:
        if held.is_set():
            asked_while_held.append(received)
        if received > 0 and not started:   # a round begins after the first range
            started.append(received)
            held.set()
            threading.Timer(0.3, held.clear).start()

    dl.before_chunk, dl.hold = before_chunk, held.is_set
    dl.run()
    assert dl.error is None and dl.received == src.size and started
    assert asked_while_held == [] and dl.held_s >= 0.25
    assert from_bytes(torch.frombuffer(bytearray(dl.blob), dtype=torch.uint8))["cursor"] == {"cursor": 48}
    server.close()


@pytest.mark.timeout(60)
def test_a_download_held_forever_ends_when_stopped() -> None:
    server, src = _serve(_tree())
    dl = Download(3, [src], TOKEN, RUN, member=9, chunk=512)
    dl.hold = lambda: True
    threading.Timer(0.2, dl.stop).start()
    dl.run()
    assert dl.blob is None and dl.error is not None and "stopped" in dl.error and dl.received == 0
    server.close()
