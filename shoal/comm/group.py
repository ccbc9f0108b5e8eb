"""A set of workers and the collectives among them.

:class:`Group` wraps a ``torch.distributed`` ProcessGroup (gloo on CPU, NCCL
on CUDA). Every collective is asynchronous and returns a :class:`Handle`; every
collective is counted by the group's :class:`~shoal.comm.meter.Meter` under a
tag. Nothing here knows about gradients or models: algorithms live above.

Example (inside a process started by ``shoal run`` or ``torchrun``)::

    import shoal, torch
    group = shoal.init()                       # the world, metered
    t = torch.ones(4)
    group.all_reduce(t, op="avg", tag="demo").wait()
    print(group.meter.counters("demo").bytes_sent)
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shoal.comm.flat import flat_views
from shoal.comm.meter import Meter
from shoal.comm.objects import all_gather_object
from shoal.comm.stepping import Stepping
from shoal.comm.streams import connect
from shoal.errors import CommTimeoutError, ConfigError, ShoalError

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def check_reduce_op(op: str) -> None:
    """Raise :class:`ConfigError` unless ``op`` names an all-reduce: avg, sum, max, min or product.

    Every collective validates its arguments before any shortcut (a group
    of one returns at once), so a typo fails at world size 1 as it would
    at 64.
    """
    if op != "avg" and op not in _REDUCE_OPS:
        raise ConfigError(f"unknown reduce op {op!r}; expected avg or one of {sorted(_REDUCE_OPS)}")


def check_all_to_all(output: torch.Tensor, tensor: torch.Tensor, size: int) -> None:
    """Raise ``ValueError`` unless ``output``/``tensor`` fit an equal-split all-to-all over ``size`` ranks."""
    if tensor.numel() % size != 0:
        raise ValueError(f"all_to_all input has {tensor.numel()} elements, not a multiple of the {size} ranks "
                         "(it is split into one equal chunk per rank)")
    if output.numel() != tensor.numel() or output.dtype != tensor.dtype:
        raise ValueError(f"all_to_all output is {output.numel()} x {output.dtype}, expected the input's "
                         f"{tensor.numel()} x {tensor.dtype}")
    if not output.is_contiguous():
        raise ValueError("all_to_all output must be contiguous (the backend writes it as one flat buffer)")


def start_gather_into(output: torch.Tensor, tensor: torch.Tensor, size: int) -> bool:
    """Check a flat all-gather's ``output`` (``ValueError``) and fill it alone when ``size`` is 1.

    Returns whether the collective is still needed (``size > 1``).
    """
    if output.numel() != size * tensor.numel():
        raise ValueError(f"output has {output.numel()} elements, expected {size} x {tensor.numel()}")
    if size == 1:
        output.view(-1).copy_(tensor.view(-1))
    return size > 1


class Handle:
    """An in-flight collective; :meth:`wait` returns its result.

    ``result`` is what the collective produces (the reduced tensor, the list
    of gathered tensors, ...). ``post`` runs once on completion before the
    result is returned (e.g. division for an average on gloo).
    """

    def __init__(
        self,
        work: Any,
        result: Any,
        meter: Meter,
        tag: str,
        timeout: float | None,
        post: Callable[[Any], Any] | None = None,
    ) -> None:
        self._work = work
        self._result = result
        self._meter = meter
        self._tag = tag
        self._timeout = timeout
        self._post = post
        self._done = work is None
        if self._done and post is not None:
            self._result = post(result)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` seconds, else the group's op timeout).

        Raises :class:`~shoal.errors.CommTimeoutError` when the deadline passes.
        """
        return self._wait(self._timeout if timeout is None else timeout, None)

    def _wait(self, limit: float | None, shown: float | None) -> Any:
        """:meth:`wait` for at most ``limit`` s; ``shown``: the timeout an error names (default ``limit``)."""
        if not self._done:
            t0 = time.perf_counter()
            try:
                if limit is None:
                    self._work.wait()
                else:
                    self._work.wait(datetime.timedelta(seconds=limit))
            except RuntimeError as e:
                if _is_timeout(e):
                    raise CommTimeoutError(
                        f"collective tagged {self._tag!r} did not finish within {shown or limit} s; "
                        "a peer is slow, hung or gone (raise the op timeout if the network is just slow)"
                    ) from e
                raise
            finally:
                self._meter.add_wait(self._tag, time.perf_counter() - t0)
            self._done = True
            if self._post is not None:
                self._result = self._post(self._result)
        return self._result

    def future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future[Any]`` of the result, for comm hooks; it fails as :meth:`wait` would.

        The future completes with the result, or with the collective's error
        (the backend's ``RuntimeError`` when a peer failed it), or
        with :class:`~shoal.errors.CommTimeoutError` once the op timeout,
        counted from this call, passes: never with the unreduced local data.
        A torch future of a ``Work`` neither times out nor may safely run
        Python callbacks that raise (gloo runs them on its own threads), so
        the waiting is done by :meth:`wait` on this process's comm watcher
        thread (:func:`_watcher`), which completes the returned future. Use
        either ``future()`` or ``wait()`` on one handle, not both.

        Example::

            fut = group.all_reduce(bucket.buffer(), op="avg", tag="grad").future()
            fut.wait()   # raises CommTimeoutError if a peer never joins the all-reduce
        """
        if self._work is None:
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_result(self._result)
            return fut
        devices: list[int | str | torch.device] = [d for d in _result_devices(self._result) if d.type != "cpu"]
        out: torch.futures.Future[Any] = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        _watcher().submit(self, deadline, out)
        return out

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


def _result_devices(result: Any) -> list[torch.device]:
    """The distinct devices of the tensors in ``result`` (a tensor or a list of them)."""
    items = result if isinstance(result, (list, tuple)) else [result]
    return list(dict.fromkeys(t.device for t in items if isinstance(t, torch.Tensor)))


class _Watcher:
    """A daemon thread that completes the futures of :meth:`Handle.future`.

    It waits for each handle in turn with :meth:`Handle.wait` (what raises
    :class:`~shoal.errors.CommTimeoutError` past the op timeout and the
    backend's error when a peer failed the collective) and sets the result or
    the exception on the future. Deadlines are fixed when the future is made,
    so waiting in turn delays no failure past its own deadline. Waiting in
    this thread, rather than in a callback on the work's own future, keeps
    shoal code off gloo's threads (see :meth:`ElasticGroup._await`), and on
    CUDA the result is published with the stream this thread waited on,
    which the future's consumer then synchronises with.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Handle, float | None, torch.futures.Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="shoal-comm-watcher", daemon=True).start()

    def submit(self, handle: Handle, deadline: float | None, out: torch.futures.Future[Any]) -> None:
        self._queue.put((handle, deadline, out))

    def _run(self) -> None:
        while True:
            handle, deadline, out = self._queue.get()
            try:
                limit = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
                value = handle._wait(limit, handle._timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the future's consumer
                out.set_exception(e)
            else:
                out.set_result(value)


_WATCHER: tuple[int, _Watcher] | None = None
_WATCHER_LOCK = threading.Lock()


def _watcher() -> _Watcher:
    """This process's watcher, started on first use (again in a forked child: threads do not survive a fork)."""
    global _WATCHER
    with _WATCHER_LOCK:
        if _WATCHER is None or _WATCHER[0] != os.getpid():
            _WATCHER = (os.getpid(), _Watcher())
        return _WATCHER[1]


class Group(Stepping):
    """Workers over one ProcessGroup, with metered asynchronous collectives.

    Args:
        process_group: a ``torch.distributed`` ProcessGroup; ``None`` means the
            default (world) group, which must be initialised
            (:func:`shoal.init`).
        timeout: per-operation timeout in seconds used by :meth:`Handle.wait`
            (``None``: the process group's own timeout).
        meter: where bytes are counted; a fresh one by default.

    Example::

        group = Group()                            # default group
        h = group.all_reduce(torch.ones(3), op="avg", tag="x")
        out = h.wait()
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        meter: Meter | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ShoalError(
                "torch.distributed is not initialised: call shoal.init() (or "
                "torch.distributed.init_process_group) in every worker first, "
                "e.g. under `shoal run -n 2 script.py` or `torchrun --nproc-per-node 2 script.py`"
            )
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds or None, got {timeout}")
        world = dist.group.WORLD
        if process_group is None and world is None:  # pragma: no cover - is_initialized() said otherwise
            raise ShoalError("torch.distributed reports no default group")
        self.pg: dist.ProcessGroup = process_group if process_group is not None else world  # type: ignore[assignment]
        self.timeout = timeout
        self.meter = meter if meter is not None else Meter()
        self.rank = dist.get_rank(self.pg)
        self.size = dist.get_world_size(self.pg)
        self.backend = str(dist.get_backend(self.pg)).lower()
        self._global_ranks = [dist.get_global_rank(self.pg, r) for r in range(self.size)] if self.pg is not dist.group.WORLD else list(range(self.size))

    @property
    def device(self) -> torch.device:
        """Where tensors handed to this group's collectives must live."""
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        return self._global_ranks[group_rank]

    # --- collectives -----------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle:
        """Reduce ``tensor`` in place over the group; ``op`` in sum/avg/max/min/product."""
        check_reduce_op(op)
        self.meter.record(tag, "all_reduce", _nbytes(tensor), self.size, self.rank)
        if self.size == 1:
            return Handle(None, tensor, self.meter, tag, self.timeout)
        post: Callable[[Any], Any] | None = None
        if op == "avg":
            if "nccl" in self.backend:
                reduce_op = dist.ReduceOp.AVG
            else:  # gloo has no AVG: sum, then divide once done
                reduce_op = dist.ReduceOp.SUM
                size = self.size
                post = lambda t: t.div_(size)  # noqa: E731
        else:
            reduce_op = _REDUCE_OPS[op]
        work = dist.all_reduce(tensor, op=reduce_op, group=self.pg, async_op=True)
        return Handle(work, tensor, self.meter, tag, self.timeout, post)

    def all_gather(self, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        """Gather equally shaped ``tensor`` from every rank; result: list by group rank."""
        self.meter.record(tag, "all_gather", _nbytes(tensor), self.size, self.rank)
        if self.size == 1:
            return Handle(None, [tensor], self.meter, tag, self.timeout)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        work = dist.all_gather(out, tensor.contiguous(), group=self.pg, async_op=True)
        return Handle(work, out, self.meter, tag, self.timeout)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        """Gather into one flat ``output`` of ``size * tensor.numel()`` elements."""
        needed = start_gather_into(output, tensor, self.size)
        self.meter.record(tag, "all_gather", _nbytes(tensor), self.size, self.rank)
        if not needed:
            return Handle(None, output, self.meter, tag, self.timeout)
        work = dist.all_gather_into_tensor(output, tensor.contiguous(), group=self.pg, async_op=True)
        return Handle(work, output, self.meter, tag, self.timeout)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        """Exchange equal chunks: chunk ``r`` of ``tensor`` goes to rank ``r``.

        ``tensor`` and ``output`` have the same dtype and ``size * k`` elements
        (viewed flat as ``size`` chunks of ``k``); chunk ``r`` of this rank's
        ``output`` is chunk ``rank`` of rank ``r``'s ``tensor``. Metered as
        ``all_to_all``: each rank sends and receives ``(size - 1) / size`` of
        ``tensor``'s bytes (its own chunk stays local). Uses
        ``torch.distributed.all_to_all_single`` (gloo on CPU and NCCL both
        implement it).
        """
        check_all_to_all(output, tensor, self.size)
        self.meter.record(tag, "all_to_all", _nbytes(tensor), self.size, self.rank)
        if self.size == 1:
            output.view(-1).copy_(tensor.view(-1))
            return Handle(None, output, self.meter, tag, self.timeout)
        work = dist.all_to_all_single(output, tensor.contiguous(), group=self.pg, async_op=True)
        return Handle(work, output, self.meter, tag, self.timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "misc") -> Handle:
        """Overwrite ``tensor`` on every rank with group rank ``src``'s."""
        self._check_rank(src, "src")
        self.meter.record(tag, "broadcast", _nbytes(tensor), self.size, self.rank, src)
        if self.size == 1:
            return Handle(None, tensor, self.meter, tag, self.timeout)
        work = dist.broadcast(tensor, src=self.global_rank(src), group=self.pg, async_op=True)
        return Handle(work, tensor, self.meter, tag, self.timeout)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle:
        """Sum ``tensor`` (``size`` equal chunks) over ranks; chunk ``rank`` lands in ``output``."""
        if tensor.numel() != self.size * output.numel():
            raise ValueError(f"input has {tensor.numel()} elements, expected {self.size} x {output.numel()}")
        if op not in ("sum", "avg"):
            raise ConfigError(f"reduce_scatter supports sum and avg, got {op!r}")
        self.meter.record(tag, "reduce_scatter", _nbytes(tensor), self.size, self.rank)
        size = self.size
        post = (lambda t: t.div_(size)) if op == "avg" else None  # noqa: E731
        if self.size == 1:
            output.view(-1).copy_(tensor.view(-1))
            return Handle(None, output, self.meter, tag, self.timeout, post)
        if self.backend == "gloo":
            # gloo has no reduce_scatter: an all-reduce of the whole input
            # costs the same bytes as reduce-scatter plus all-gather.
            buf = tensor.clone()
            self.meter.record(tag, "all_gather", _nbytes(output), self.size, self.rank)
            work = dist.all_reduce(buf, group=self.pg, async_op=True)
            chunk = buf.view(-1).narrow(0, self.rank * output.numel(), output.numel())

            def take(_out: torch.Tensor) -> torch.Tensor:
                _out.view(-1).copy_(chunk)
                return post(_out) if post is not None else _out

            return Handle(work, output, self.meter, tag, self.timeout, take)
        work = dist.reduce_scatter_tensor(output, tensor.contiguous(), group=self.pg, async_op=True)
        return Handle(work, output, self.meter, tag, self.timeout, post)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", tag: str = "misc") -> Handle:
        """Reduce ``tensor`` over the group into group rank ``dst``'s copy (others' are scratch).

        ``op`` in sum/max/min/product. Used for the intra-host stage of a
        hierarchical all-reduce, where only the host leader needs the sum.
        """
        self._check_rank(dst, "dst")
        if op not in _REDUCE_OPS:
            raise ConfigError(f"reduce supports {sorted(_REDUCE_OPS)}, got {op!r}")
        self.meter.record(tag, "reduce", _nbytes(tensor), self.size, self.rank, dst)
        if self.size == 1:
            return Handle(None, tensor, self.meter, tag, self.timeout)
        work = dist.reduce(tensor, dst=self.global_rank(dst), op=_REDUCE_OPS[op], group=self.pg, async_op=True)
        return Handle(work, tensor, self.meter, tag, self.timeout)

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, tag: str = "misc",
                            cache: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        """Blocking: overwrite ``tensors`` with rank ``src``'s, one flat broadcast per dtype.

        ``cache`` keeps the flat buffers between calls (pass the same dict
        each time on hot paths, e.g. buffers broadcast before every forward).
        """
        self._check_rank(src, "src")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t.detach())
        with torch.no_grad():
            for dtype, same in by_dtype.items():
                total = sum(t.numel() for t in same)
                flat = cache.get(dtype) if cache is not None else None
                if flat is None or flat.numel() != total:
                    flat = torch.empty(total, dtype=dtype, device=same[0].device)
                    if cache is not None:
                        cache[dtype] = flat
                torch.cat([t.reshape(-1) for t in same], out=flat)
                self.broadcast(flat, src=src, tag=tag).wait()
                torch._foreach_copy_(same, flat_views(flat, same))

    def barrier(self, tag: str = "control") -> None:
        self.meter.record(tag, "barrier", 0, self.size, self.rank)
        if self.size > 1:
            dist.barrier(group=self.pg)

    def all_gather_object(self, obj: Any, tag: str = "control") -> list[Any]:
        """Blocking gather of an object from every rank (for checks, not hot paths).

        See :func:`shoal.comm.objects.all_gather_object`: ``obj`` travels with
        ``torch.save`` and is read back with ``weights_only=True`` (tensors,
        numbers, strings and plain containers).
        """
        return all_gather_object(self, obj, tag)

    # --- structure ---------------------------------------------------------
    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "Group | None":
        """Form subgroups (lists of this group's ranks); every rank must call it.

        Returns this rank's subgroup, sharing this group's meter and timeout,
        or ``None`` if this rank is in none of them.
        """
        seen: set[int] = set()
        for ranks in ranks_per_subgroup:
            for r in ranks:
                self._check_rank(r, "subgroup rank")
                if r in seen:
                    raise ConfigError(f"rank {r} appears in more than one subgroup")
                seen.add(r)
        mine: Group | None = None
        for ranks in ranks_per_subgroup:
            pg = dist.new_group([self.global_rank(r) for r in ranks])
            if self.rank in ranks:
                mine = Group(pg, timeout=self.timeout, meter=self.meter)
        connect(mine)  # NCCL: build the communicator now, in program order, not lazily on some thread
        return mine

    def _check_rank(self, r: int, what: str) -> None:
        if not 0 <= r < self.size:
            raise ConfigError(f"{what} {r} is outside this group of {self.size} ranks")

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, size={self.size}, backend={self.backend!r})"
