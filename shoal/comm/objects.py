"""Objects and byte blobs over a group: the one serialisation and the one variable-size exchange.

Every place that sends Python objects (a model check, a host identity, an
optimizer state, a heal blob) goes through here:

- :func:`to_bytes` / :func:`from_bytes`: ``torch.save`` into a ``uint8``
  tensor, ``torch.load(weights_only=True)`` back. A peer's bytes may hold
  tensors, numbers, strings and plain containers, never code (unlike
  ``pickle``, which ``torch.distributed.all_gather_object`` uses).
- :func:`all_gather_bytes`: blobs of different sizes from every rank (the
  sizes first, then one padded all-gather).
- :func:`broadcast_bytes`: one rank's blob on every rank (the size first,
  bounded by ``max_bytes``).
- :func:`all_gather_object`: :func:`all_gather_bytes` of :func:`to_bytes`.

On a :class:`~shoal.comm.Group` a failed collective raises. On an
:class:`~shoal.membership.elastic.ElasticGroup` a failure is recorded and the
step's later collectives return at once with their buffers untouched, so
each function checks the group's ``error`` after every collective and never
reads a buffer the failed collective was to fill (an uninitialised size once
asked for a 94 TB buffer): the gathers return ``None`` (or ``[obj] * size``
for :func:`all_gather_object`, as the step is lost anyway).

Example::

    from shoal.comm.objects import all_gather_object
    names = all_gather_object(group, socket.gethostname(), tag="topology")
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch

from shoal.errors import PeerLostError, ShoalError

__all__ = ["to_bytes", "from_bytes", "failed", "all_gather_bytes", "broadcast_bytes", "all_gather_object"]


def to_bytes(obj: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """``obj`` written by ``torch.save`` as a 1-d ``uint8`` tensor (on ``device``, default the CPU).

    Example::

        blob = to_bytes({"step": 3, "w": torch.ones(2)})
        assert from_bytes(blob)["step"] == 3
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    blob = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    return blob if device is None else blob.to(device)


def from_bytes(blob: torch.Tensor) -> Any:
    """The object in a :func:`to_bytes` blob (any device), read with ``weights_only=True``, tensors on the CPU.

    Raises what ``torch.load`` raises for bytes that are not such a blob, or
    that would need code to load.

    Example::

        from_bytes(to_bytes([1, "a"]))   # [1, 'a']
    """
    # Tensors land on the CPU: the sender's device index may not exist here (fewer GPUs, a CPU peer);
    # load_state_dict and copy_ move them to the receiver's own devices.
    return torch.load(io.BytesIO(blob.detach().cpu().numpy().tobytes()), weights_only=True, map_location="cpu")


def failed(group: Any) -> bool:
    """Whether ``group`` recorded a failure this step (elastic groups; a static group raises instead)."""
    return group.error is not None


def all_gather_bytes(group: Any, payload: torch.Tensor, tag: str) -> list[torch.Tensor] | None:
    """Every rank's 1-d ``uint8`` ``payload`` (sizes may differ), by group rank; ``None`` if the group failed.

    Two all-gathers: the sizes, then the payloads padded to the largest.
    Buffers live on ``payload``'s device; the sizes are read on the host once
    (the padded width sizes the second buffer).

    Example::

        blobs = all_gather_bytes(group, to_bytes(my_state), tag="state")
        states = None if blobs is None else [from_bytes(b) for b in blobs]
    """
    if payload.dim() != 1 or payload.dtype != torch.uint8:
        raise ShoalError(f"all_gather_bytes needs a 1-d uint8 tensor, got {payload.dtype} of shape {list(payload.shape)}")
    dev = payload.device
    sizes = torch.zeros(group.size, dtype=torch.int64, device=dev)
    group.all_gather_into(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=dev), tag=tag).wait()
    if failed(group):
        return None
    counts = sizes.tolist()
    width = max(max(counts), 1)
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    mine[: payload.numel()] = payload
    out = torch.empty(width * group.size, dtype=torch.uint8, device=dev)
    group.all_gather_into(out, mine, tag=tag).wait()
    if failed(group):
        return None
    return [out[r * width: r * width + counts[r]] for r in range(group.size)]


def broadcast_bytes(group: Any, blob: torch.Tensor | None, src: int, tag: str, max_bytes: int | None = None,
                    timeout: float | None = None) -> torch.Tensor | None:
    """Rank ``src``'s 1-d ``uint8`` ``blob`` on every rank (others pass ``None``); ``None`` if the group failed.

    The size travels first. A size outside ``(0, max_bytes]`` (a broken or
    hostile source) fails the exchange on every rank alike: recorded as
    :class:`~shoal.errors.PeerLostError` on an elastic group (the result is
    ``None``), raised on a static one. ``timeout`` bounds the blob's
    broadcast (default: the group's op timeout). Buffers live on
    ``group.device``.

    Example::

        got = broadcast_bytes(group, to_bytes(state) if group.rank == 0 else None, src=0, tag="heal")
    """
    dev = group.device
    mine = group.rank == src
    if mine and blob is None:
        raise ShoalError(f"rank {src} is the source of broadcast_bytes and must pass its blob")
    n = torch.tensor([blob.numel() if mine and blob is not None else 0], dtype=torch.int64, device=dev)
    group.broadcast(n, src=src, tag=tag).wait()
    if failed(group):
        return None
    size = int(n.item())
    if max_bytes is not None and not 0 < size <= max_bytes:
        err = PeerLostError(f"rank {src} announced {size} bytes, outside (0, max_bytes={max_bytes}]")
        group.report_error(err)   # a static group raises it at once
        return None
    buf = blob.to(dev) if mine and blob is not None else torch.empty(size, dtype=torch.uint8, device=dev)
    group.broadcast(buf, src=src, tag=tag).wait(timeout=timeout)
    return None if failed(group) else buf


def all_gather_object(group: Any, obj: Any, tag: str = "control") -> list[Any]:
    """``obj`` of every rank, by group rank (a blocking control exchange, not for hot paths).

    ``obj`` must be what ``torch.load(weights_only=True)`` reads back:
    tensors, numbers, strings, ``None`` and lists, tuples, dicts and sets of
    them. After a failure on an elastic group the result is ``[obj] * size``
    (the step is discarded; nothing received is used).

    Example::

        ids = all_gather_object(group, host_identity(), tag="topology")
    """
    if group.size == 1:
        return [obj]
    blobs = all_gather_bytes(group, to_bytes(obj, group.device), tag)
    if blobs is None:
        return [obj] * group.size
    return [from_bytes(b) for b in blobs]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` (nested dicts, lists, tuples) with each tensor replaced by ``fn(tensor)``, the rest kept.

    >>> map_tensors({"a": torch.ones(2), "b": [torch.zeros(1), 3]}, lambda t: t + 1)["b"]
    [tensor([1.]), 3]
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj
