"""The codec interface: how the group mean of named tensors travels.

A :class:`Codec` overwrites a list of named tensors, in place, with (an
estimate of) their mean over a :class:`~shoal.comm.Group`. It owns its
collectives (PowerSGD needs two rounds, top-k an all-gather), keeps its state
keyed by tensor *name* (never by bucket number, so state survives re-bucketing
and nothing forces the first steps to be uncompressed), and tags every
collective so the group's meter counts its bytes per codec and per kind of
traffic.

Lossy codecs also implement :meth:`LossyCodec.mean_with_residual`, which
additionally reports what this rank's contribution lost to compression; that is
what :class:`~shoal.codecs.ErrorFeedback` carries over to the next step.

Example::

    group = shoal.init()
    codec = shoal.codecs.Int8Blockwise(block_size=256)
    grads = [p.grad for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    codec.mean(grads, names, group, tag="ddp/grad")
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import torch

from shoal.comm.finite import finite_flags as comm_finite_flags
from shoal.comm.flat import flat_views
from shoal.comm.group import Group
from shoal.errors import ConfigError


class Codec(abc.ABC):
    """Computes the mean of named tensors over a group, possibly lossily.

    Subclasses set ``lossy`` and implement :meth:`mean`. Every rank must call
    :meth:`mean` with the same names and shapes in the same order; the codec
    issues its collectives in an order that depends only on those, so ranks
    never mismatch. ``mean`` is blocking and spawns no threads: the caller may
    run it on a dedicated communication thread.

    Example::

        codec = Identity()
        codec.mean([t], ["weight"], group, tag="avg/params")
    """

    lossy: bool = False

    def __init__(self) -> None:
        self._steps = 0
        self._numel_in = 0
        self._payload_bytes = 0

    @abc.abstractmethod
    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], group: Group, tag: str) -> None:
        """Overwrite each tensor in place with (an estimate of) its mean over ``group``."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (``torch.save``-able)."""
        return {"type": type(self).__name__, "counters": self._counters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (into a codec of the same config)."""
        if state.get("type") != type(self).__name__:
            raise ConfigError(
                f"state was saved by a {state.get('type')} codec, cannot load it into {type(self).__name__}"
            )
        c = state["counters"]
        self._steps, self._numel_in, self._payload_bytes = int(c["steps"]), int(c["numel_in"]), int(c["payload_bytes"])

    def rollback_state(self) -> dict[str, Any]:
        """A snapshot to undo the next step with :meth:`load_state_dict` (elastic groups take one per step).

        It must stay valid while the codec runs one more step. The default
        is :meth:`state_dict` (a full copy); codecs with large state return
        references instead and never write into a tensor that the latest
        snapshot holds (see :class:`RollbackSlots`), so a step costs no copy.
        """
        return self.state_dict()

    def newcomer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """What a worker joining a run loads from a peer's :meth:`state_dict` (elastic healing).

        Shared state (PowerSGD's warm-start Qs, counters) is kept; state that
        is the peer's own (an error-feedback residual: what *that* worker
        still owes the mean) is zeroed, so that one residual does not count
        twice. The default keeps everything.

        >>> from shoal.codecs import Identity
        >>> Identity().newcomer_state(Identity().state_dict())["type"]
        'Identity'
        """
        return state

    def stats(self) -> dict[str, float]:
        """Counters since construction: calls, elements in, bytes this rank handed to collectives.

        ``payload_bytes`` is what this rank contributed to collectives (the
        group's meter turns that into bytes sent/received per algorithm).
        """
        return {
            "steps": self._steps,
            "numel_in": self._numel_in,
            "payload_bytes": self._payload_bytes,
            "bytes_per_element": self._payload_bytes / self._numel_in if self._numel_in else 0.0,
        }

    # --- helpers for subclasses ----------------------------------------------
    def _counters(self) -> dict[str, int]:
        return {"steps": self._steps, "numel_in": self._numel_in, "payload_bytes": self._payload_bytes}

    def _count(self, tensors: Sequence[torch.Tensor], payload: int) -> None:
        self._steps += 1
        self._numel_in += sum(t.numel() for t in tensors)
        self._payload_bytes += payload


class LossyCodec(Codec):
    """A codec whose mean is an estimate; it can report each rank's compression error.

    Subclasses implement :meth:`mean_with_residual`; :meth:`mean` calls it
    without residuals.
    """

    lossy = True

    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], group: Group, tag: str) -> None:
        self.mean_with_residual(tensors, names, group, tag, None)

    @abc.abstractmethod
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        """Like :meth:`mean`; if ``residuals`` is given (fp32, one per tensor, same
        shapes), write into each ``input - what this rank's contribution decodes to``.
        """


def check_inputs(tensors: Sequence[torch.Tensor], names: Sequence[str], who: str) -> None:
    """Raise a clear error for input no codec can handle (cheap: no data is read)."""
    if len(tensors) != len(names):
        raise ConfigError(f"{who}: got {len(tensors)} tensors but {len(names)} names")
    if len(set(names)) != len(names):
        raise ConfigError(f"{who}: tensor names must be unique (codec state is keyed by name), got {list(names)}")
    device = tensors[0].device if tensors else None
    for t, n in zip(tensors, names):
        if not t.is_floating_point():
            raise TypeError(
                f"{who}: tensor {n!r} has dtype {t.dtype}; codecs average real floating-point tensors "
                "(fp64, fp32, bf16, fp16): an integer mean is not representable, and a complex tensor must "
                "travel as its real pairs (torch.view_as_real); plain DDP and Sync average complex gradients"
            )
        if t.device != device:
            raise ConfigError(f"{who}: tensor {n!r} is on {t.device} but the first tensor is on {device}")


def common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The inputs' dtype if they all share one, else fp32 (exact for bf16/fp16 too)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return next(iter(dtypes))
    return torch.float32


class BufferPool:
    """Flat buffers reused between steps, keyed by (purpose, dtype, device, numel).

    A steady training loop calls each codec with the same layouts every step,
    so after the first step no codec allocates on the hot path.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device, int], torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        k = (key, dtype, device, numel)
        buf = self._bufs.get(k)
        if buf is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[k] = buf
        return buf

    def clear(self) -> None:
        self._bufs.clear()


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy (casting) ``tensors`` one after another into the 1-D ``flat``."""
    if not tensors:
        return
    # torch.cat of flattened views is one kernel; it handles non-contiguous views.
    torch.cat([t.reshape(-1).to(flat.dtype) for t in tensors], out=flat)


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy (casting) consecutive slices of ``flat`` back into ``tensors`` in place (one batched copy)."""
    if tensors:
        torch._foreach_copy_(list(tensors), flat_views(flat, tensors))


def finite_flags(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor, on the tensors' device: is every element finite? (a bool vector, no host sync).

    One fused L2 norm per dtype (:func:`shoal.comm.finite.finite_flags`; see
    :func:`shoal.comm.finite.nonfinite_flag` for the accumulation dtypes and
    the one overflow case). Codecs use it to keep their state where a mean
    went non-finite with ``torch.where``, never reading the result on the
    host between collectives.

    >>> finite_flags([torch.ones(2), torch.tensor([float("inf")]), torch.ones(0)]).tolist()
    [True, False, True]
    """
    return comm_finite_flags(tensors)


class NonfiniteCounter:
    """How many calls had a non-finite mean: a device tensor, read on the host only by :meth:`value`.

    >>> c = NonfiniteCounter(); c.add(torch.tensor([True, False])); c.value()
    1
    """

    def __init__(self) -> None:
        self._count: torch.Tensor | int = 0

    def add(self, ok: torch.Tensor) -> None:
        """Count one call whose per-tensor flags ``ok`` (from :func:`finite_flags`) are not all True."""
        bad = ok.logical_not().any().to(torch.int64)
        self._count = bad + self._count if isinstance(self._count, torch.Tensor) else bad + int(self._count)

    def value(self) -> int:
        """The count (a host sync: for stats and checkpoints, not the step's path)."""
        return int(self._count)

    def snapshot(self) -> torch.Tensor | int:
        """The count as it is now, without a host sync (for per-step rollback snapshots)."""
        return self._count.clone() if isinstance(self._count, torch.Tensor) else self._count

    def load(self, value: torch.Tensor | int) -> None:
        self._count = value.clone() if isinstance(value, torch.Tensor) else int(value)


def keep_where(ok: torch.Tensor, new: Sequence[torch.Tensor], old: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``new[i]`` where ``ok[i]`` else ``old[i]``, per tensor, on the device (no host sync).

    >>> keep_where(torch.tensor([True, False]), [torch.ones(1), torch.ones(1)],
    ...            [torch.zeros(1), torch.zeros(1)])
    [tensor([1.]), tensor([0.])]
    """
    return [torch.where(ok[i], n, o) for i, (n, o) in enumerate(zip(new, old))]


def sub_tag(tag: str, suffix: str) -> str:
    """``tag/suffix`` so the meter can split a codec's traffic by kind."""
    return f"{tag}/{suffix}" if tag else suffix


class RollbackSlots:
    """Named tensors that a codec keeps across steps, cheap to snapshot for rollback.

    :meth:`keep` stores a copy of a new value, normally in place. Once
    :meth:`snapshot` has handed out references to the current tensors, those
    are *pinned*: the next :meth:`keep` of a pinned name writes into a spare
    tensor instead (allocated once, then the two alternate), so the snapshot
    stays intact for a rollback without any per-step copy. Without snapshots
    (a static group) it never allocates a spare.

    >>> import torch
    >>> slots = RollbackSlots()
    >>> slots.keep("e", torch.ones(2))
    >>> snap = slots.snapshot()
    >>> slots.keep("e", torch.zeros(2))
    >>> snap["e"].tolist(), slots["e"].tolist()
    ([1.0, 1.0], [0.0, 0.0])
    """

    def __init__(self) -> None:
        self.current: dict[str, torch.Tensor] = {}
        self._spares: dict[str, torch.Tensor] = {}
        self._pinned: set[int] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.current[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.current.get(name)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        """Make ``value`` itself the current tensor (no copy)."""
        self.current[name] = value

    def keep(self, name: str, new: torch.Tensor) -> None:
        """Store a copy of ``new`` under ``name``, never writing into a pinned tensor."""
        cur = self.current.get(name)
        if cur is not None and id(cur) not in self._pinned and _same(cur, new):
            cur.copy_(new)
            return
        spare = self._spares.pop(name, None)
        if spare is not None and id(spare) not in self._pinned and _same(spare, new):
            spare.copy_(new)
        else:
            spare = new.detach().clone()
        if cur is not None:
            self._spares[name] = cur
        self.current[name] = spare

    def snapshot(self) -> dict[str, torch.Tensor]:
        """References to the current tensors, which no :meth:`keep` overwrites until the next snapshot."""
        self._pinned = {id(t) for t in self.current.values()}
        return dict(self.current)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the contents with copies of ``tensors`` (a state dict or a snapshot)."""
        self.current = {k: v.detach().clone() for k, v in tensors.items()}

    def items(self) -> Any:
        return self.current.items()

    def values(self) -> Any:
        return self.current.values()

    def __len__(self) -> int:
        return len(self.current)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
