"""NonBlocking's layer layout and argument checks (one process)."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest
import torch
from torch import nn

from shoal.errors import ConfigError
from shoal.strategies import NonBlocking
from shoal.strategies.nonblocking import _fallback_reason, find_layers
from shoal.strategies.nonblocking_exchange import CommStream


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: owned by the module registering it first


def test_a_tied_weight_belongs_to_its_first_module() -> None:
    layers = find_layers(Tied())
    assert [(layer.name, layer.names) for layer in layers] == [
        ("mid", ["mid.weight", "mid.bias"]),
        ("emb", ["emb.weight"]),
    ]
    assert layers[0].buffer.numel() == 20 and layers[0].views[0].shape == (4, 4)


def test_fallback_reasons() -> None:
    m = Tied()
    assert _fallback_reason(m, torch.optim.SGD(m.parameters(), lr=0.1))[1] is not None
    reason, single = _fallback_reason(m, [torch.optim.SGD(m.mid.parameters(), lr=0.1),
                                          torch.optim.SGD(m.emb.parameters(), lr=0.1)])
    assert single is None and "2 optimizers" in reason
    reason, single = _fallback_reason(m, torch.optim.SGD(m.mid.parameters(), lr=0.1))
    assert single is None and "misses 1" in reason
    with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
        _fallback_reason(m, "adam")


def test_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="codec"):
        NonBlocking(codec="bf16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hierarchical"):
        NonBlocking(hierarchical=1)  # type: ignore[arg-type]


class _RecordingStreams:
    """A device module with the CUDA stream API that records who did what, on which thread and stream."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.training = _RecStream(self, "training")
        self._current = threading.local()

    def Stream(self, device: torch.device) -> "_RecStream":  # noqa: N802 - the device-module API
        self.log.append(("new stream", str(device)))
        return _RecStream(self, "comm")

    def current_stream(self, device: torch.device) -> "_RecStream":
        return getattr(self._current, "stream", self.training)

    @contextlib.contextmanager
    def stream(self, s: "_RecStream") -> Iterator[None]:
        self._current.stream = s
        try:
            yield
        finally:
            self._current.stream = self.training


class _RecStream:
    def __init__(self, mod: _RecordingStreams, name: str) -> None:
        self.mod, self.name = mod, name

    def record_event(self) -> str:
        self.mod.log.append(("record", self.name, threading.current_thread().name))
        return f"event@{self.name}"

    def wait_event(self, event: str) -> None:
        self.mod.log.append(("wait", self.name, event, threading.current_thread().name))


def test_comm_stream_orders_the_thread_with_events_both_ways() -> None:
    mod = _RecordingStreams()
    comm = CommStream(torch.device("cuda", 1), module=mod)
    seen: list[str] = []
    with ThreadPoolExecutor(1, thread_name_prefix="comm") as pool:
        ready = comm.mark_ready()
        done = pool.submit(comm.run, ready, lambda: seen.append(mod.current_stream(comm.device).name)).result()
    comm.join(done)
    main = threading.current_thread().name
    assert seen == ["comm"]  # the codec's work ran on the thread's own stream
    assert [entry[:3] for entry in mod.log] == [
        ("new stream", "cuda:1"),
        ("record", "training", main),              # gradients written: event on the training stream
        ("wait", "comm", "event@training"),        # the thread's stream waits for it before the codec
        ("record", "comm", mod.log[3][2]),         # after the codec: event on the comm stream
        ("wait", "training", "event@comm"),        # the training stream waits before reading the means
    ]
    assert mod.log[2][3] != main and mod.log[3][2] != main


def test_comm_stream_is_a_no_op_where_there_are_no_streams() -> None:
    ran: list[int] = []
    for device in (torch.device("cpu"), torch.device("meta")):
        comm = CommStream(device)
        ready = comm.mark_ready()
        assert ready is None
        assert comm.run(ready, lambda: ran.append(1)) is None
        comm.join(None)
    assert ran == [1, 1] and CommStream(torch.device("meta")).module is None
