"""The process group of one quorum, and the collectives over it that record failures instead of raising.

Owned here:

:class:`Link`
    What a quorum group shares with its subgroups: the member's client, the
    backend factory that builds a quorum's gloo group (:class:`BackendSpec`,
    :func:`gloo_backend`) and the step's :class:`~shoal.membership.vote.Failures`;
    it lets go of the groups abandoned after a failure. A failed gloo group is never
    waited on and never destroyed in the training thread (its destructor would
    wait for its stuck operations, up to ``Timeouts.op``): it goes to
    :data:`shoal.comm.lifetime.REAPER`, which destroys it on a thread of its
    own a second later (kept longer, a group whose peer reset a connection can
    spin gloo's loop thread on a core). :meth:`Link.await_work` waits for one
    operation without raising.
:class:`ElasticCollectives`
    The collectives of a :class:`~shoal.comm.Group` whose members follow the
    run's quorums, for both :class:`~shoal.membership.elastic.ElasticGroup` and
    :class:`~shoal.membership.views.ElasticSubgroup`. A failure (a peer's
    socket closed, the op timeout passed, another member reporting a failure)
    is recorded in the link's failures; from then on this step's collectives
    return at once with unreduced data, so the step finishes quickly and the
    vote discards it.

Example (a backend factory that wraps gloo, as fault plans do)::

    def factory(spec: BackendSpec):
        return gloo_backend(spec)
    group = ElasticGroup(backend_factory=factory)
"""

from __future__ import annotations

import abc
import datetime
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shoal.comm import lifetime
from shoal.comm.group import (_REDUCE_OPS, Group, Handle, _nbytes, broadcast_coalesced, check_all_to_all,
                              check_reduce_op, start_gather_into)
from shoal.membership.client import MemberClient
from shoal.membership.coordinator import Timeouts
from shoal.comm.meter import Meter
from shoal.membership.vote import Failures
from shoal.comm.start import ELASTIC
from shoal.comm.objects import all_gather_object
from shoal.errors import CommTimeoutError, ConfigError, PeerLostError, ShoalError

_SLICE = datetime.timedelta(milliseconds=10)   # await_work checks the abort flag and deadline this often


@dataclass(frozen=True)
class BackendSpec:
    """What a backend factory gets to build one quorum's process group.

    ``step`` returns the group's committed step when called (fault plans use it).
    The factory is called on a helper thread (:mod:`shoal.membership.rendezvous`:
    a member lost meanwhile must not hold the training thread in the
    constructor), so it must not rely on thread-local state such as the current
    CUDA device: a factory building an NCCL group names its device explicitly.
    """

    store: dist.Store
    rank: int
    size: int
    timeout: float
    step: Callable[[], int]


BackendFactory = Callable[[BackendSpec], Any]


def gloo_backend(spec: BackendSpec) -> Any:
    """The default factory: a gloo group on the quorum's own store prefix."""
    return dist.ProcessGroupGloo(spec.store, spec.rank, spec.size, datetime.timedelta(seconds=spec.timeout))


@dataclass(frozen=True)
class Seat:
    """This member's place in one quorum's group: its rank, the group's size, and its process group.

    An :class:`~shoal.membership.elastic.ElasticGroup` holds one and replaces
    it with each quorum it adopts; ``pg`` is None for a quorum of one, and
    once the group is abandoned after a failure.
    """

    rank: int = 0
    size: int = 1
    pg: Any = None


@dataclass
class ElasticStats:
    """Counters of one worker's elastic life (all since construction)."""

    commits: int = 0
    discards: int = 0
    quorums: int = 0             # groups built (the first one included)
    heals_received: int = 0
    heal_bytes: int = 0          # size of the last state blob sent or received
    heal_s: float = 0.0          # seconds the last heal took (exchange + broadcast + load)
    reconfigure_s: float = 0.0   # seconds the last begin_step spent adopting a quorum


class Link:
    """What a quorum group shares with its subgroups (see the module docstring).

    Args:
        client: the member's connection to the coordinator.
        timeouts: the run's timeouts (``op`` bounds every operation).
        factory: builds a quorum's process group.
        failures: this step's failures (shared).
        step: returns the group's committed step (handed to the factory).
    """

    def __init__(self, client: MemberClient, timeouts: Timeouts, factory: BackendFactory, failures: Failures,
                 step: Callable[[], int]) -> None:
        self.client, self.timeouts, self.factory, self.failures = client, timeouts, factory, failures
        self._step = step
        self.on_abandon: list[Callable[[], None]] = []   # subgroups drop their groups with the quorum's

    def build(self, prefix: str, rank: int, size: int) -> Any:
        """A process group of ``size`` members on the store prefix ``prefix`` (raises if a peer does not connect)."""
        store = dist.PrefixStore(prefix, self.client.store.clone())  # type: ignore[attr-defined]
        return self.factory(BackendSpec(store, rank, size, self.timeouts.op, self._step))

    def retire(self, pg: Any) -> None:
        """Let go of ``pg`` (failed or superseded): destroyed on the reaper's thread, never in this one.

        The caller drops its own reference right after (within the reaper's grace).
        """
        if pg is not None:
            lifetime.REAPER.take(pg, limit=self.timeouts.op)

    def await_work(self, work: Any, limit: float | None, tag: str, whole: bool = False) -> bool:
        """Wait for ``work``; on any failure record it and return False, never raise.

        Waits in slices of ``work.wait(timeout)`` in this thread: no Python
        callback is attached to the work's future, because gloo runs those in
        its own threads, where a garbage collection could destroy a process
        group whose peer just closed its sockets, and an exception there
        aborts the process (an uncaught gloo::IoException).
        ``whole``: one wait for the whole limit instead (point-to-point work:
        a timed wait on a gloo send or recv that runs out closes every
        connection of the group, so it must not be sliced).
        """
        failures = self.failures
        if failures.error is not None:
            return False
        deadline = time.monotonic() + (limit if limit is not None else self.timeouts.op)
        if whole:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                return True
            except RuntimeError as e:
                late = time.monotonic() >= deadline
                failures.record(CommTimeoutError(f"{tag!r} did not finish within {limit} s (Timeouts.op)") if late
                                else PeerLostError(f"{tag!r} failed: {e}"))
                return False
        while True:
            try:
                work.wait(_SLICE)
                return True
            except RuntimeError as e:
                if work.is_completed():      # a failure, not the end of a slice
                    return self._finish(work, tag, e)
            if failures.error is not None:
                return False
            if failures.aborted:
                failures.record(PeerLostError(f"collective {tag!r} abandoned: another member reported a failure"))
                return False
            if time.monotonic() > deadline:
                failures.record(CommTimeoutError(f"collective {tag!r} did not finish within {limit} s "
                                                 "(Timeouts.op); a peer is slow, hung or gone"))
                return False

    def _finish(self, work: Any, tag: str, e: RuntimeError) -> bool:
        why = str(e)
        try:
            work.wait()                      # completed: returns at once, or raises its own error
        except RuntimeError as err:
            why = str(err)                   # not the error itself: its traceback holds this frame, and so the
        else:                                # work and its group's connections, until a garbage collection
            return True                      # it completed just after the slice ran out
        self.failures.record(PeerLostError(f"collective {tag!r} failed: {why}"))
        return False


class _ElasticHandle(Handle):
    """A collective on an elastic group: its wait records failures instead of raising."""

    def __init__(self, link: Link, work: Any, result: Any, meter: Meter, tag: str, timeout: float | None,
                 post: Callable[[Any], Any] | None, whole: bool = False) -> None:
        super().__init__(work, result, meter, tag, timeout, post)
        self._link = link
        self._whole = whole

    def wait(self, timeout: float | None = None) -> Any:
        work = self._work   # read once: another thread's wait may drop it (below)
        if self._done or work is None:
            return self._result
        t0 = time.perf_counter()
        ok = self._link.await_work(work, self._timeout if timeout is None else timeout, self._tag, self._whole)
        self._meter.add_wait(self._tag, time.perf_counter() - t0)
        self._done = True
        self._work = None   # a gloo work holds its group's connections: kept, a reset one can spin gloo's loop
        if ok and self._post is not None:
            self._result = self._post(self._result)
        return self._result

    def future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(self.wait())
        return fut

    def is_completed(self) -> bool:
        work = self._work
        return self._done or work is None or self._link.failures.error is not None or bool(work.is_completed())


class ElasticCollectives(abc.ABC):
    """Collectives over a quorum's process group that record failures (see the module docstring).

    Not built directly: the base of :class:`~shoal.membership.elastic.ElasticGroup`
    and :class:`~shoal.membership.views.ElasticSubgroup`, which say where
    their process group comes from (:meth:`_live_pg`), whether a quorum was
    adopted yet (:meth:`_started`), and this member's :attr:`rank` and the
    :attr:`size` in the current quorum. It is not a :class:`~shoal.comm.Group`
    (it has no fixed process group to wrap), but it offers the same
    collectives and step interface, and the concrete ones are registered as
    virtual subclasses of Group so that ``isinstance(g, Group)`` holds for
    every group.

    Args:
        link: what a quorum group shares with its subgroups.
        meter: where bytes are counted.
        timeout: the per-collective timeout (``Timeouts.op``).
    """

    elastic = True
    traits = ELASTIC
    backend = "gloo"

    def __init__(self, link: Link, meter: Meter, timeout: float | None) -> None:
        self.link, self.meter, self.timeout = link, meter, timeout

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This member's rank in the current quorum's group."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The size of the current quorum's group."""

    @abc.abstractmethod
    def _live_pg(self) -> Any:
        """The process group this step's collectives go to (``None``: none, the step is lost)."""

    @abc.abstractmethod
    def _started(self) -> bool:
        """Whether a quorum was adopted (a collective before that is a usage error)."""

    # --- the step (each concrete group's) and its older names, once for both -------------------
    @abc.abstractmethod
    def begin_step(self) -> None:
        """Begin a step: adopt a newer quorum if one is due."""

    @abc.abstractmethod
    def commit(self) -> bool:
        """End the step: the same verdict on every member."""

    @abc.abstractmethod
    def before_begin_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the top of every ``begin_step``."""

    def start_step(self) -> None:
        """The older name of :meth:`begin_step`."""
        self.begin_step()

    def should_commit(self) -> bool:
        """The older name of :meth:`commit`."""
        return self.commit()

    def before_start_step(self, fn: Callable[[], None]) -> None:
        """The older name of :meth:`before_begin_step` (NonBlocking ends its lazily ended step there)."""
        self.before_begin_step(fn)

    @property
    def member(self) -> bool:
        """Whether this worker belongs to this group (a subgroup's rule may leave it out)."""
        return True

    def global_rank(self, group_rank: int) -> int:
        """A quorum's group is built on its own store: its ranks are the only ranks."""
        return group_rank

    def _check_rank(self, r: int, what: str) -> None:
        if not 0 <= r < self.size:
            raise ConfigError(f"{what} {r} is outside this group of {self.size} ranks")

    def split(self, ranks_per_subgroup: Sequence[Sequence[int]]) -> "Group | None":
        raise ShoalError("an elastic group cannot be split: its members change from one quorum to the "
                         "next; use shoal.membership.views.ElasticSubgroup (a rule applied to each quorum)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # --- failures --------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """This step's first failure (shared by a quorum group and its subgroups), or None."""
        return self.link.failures.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self.link.failures.error = value

    def _record(self, err: BaseException) -> None:
        self.link.failures.record(err)

    def report_error(self, err: BaseException) -> None:
        """Make this step fail on every member (e.g. a NaN found outside shoal)."""
        self._record(err)

    # --- the background heal (shoal.membership.catchup) -------------------------------------------------
    # No default here (the static answers are Group's, shoal.comm.group): each elastic group answers for
    # itself, the ElasticGroup from its catch-up and a subgroup from its parent; a default "every member
    # counts" would silently count a background joiner's data in a mean.
    @abc.abstractmethod
    def contribution(self) -> tuple[bool, int]:
        """(whether this member's data counts in this step's means, how many members' data does)."""

    @abc.abstractmethod
    def shortfall(self) -> float:
        """How much weight this step's means lack from joiners counted with part of one (0.0 mostly)."""

    @abc.abstractmethod
    def out_ranks(self) -> frozenset[int]:
        """The ranks whose data counts zero in this step's means (joiners catching up), the same on every member."""

    @abc.abstractmethod
    def register_replay(self, replayer: Any) -> None:
        """Replay the updates a joiner received while it downloads (the background heal)."""

    @abc.abstractmethod
    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None:
        """Make quorums heal blocking (while ``when()``, or always): a component cannot have a non-contributor."""

    @abc.abstractmethod
    def watch_peers(self) -> None:
        """Watch the quorum's heartbeats between rounds (:mod:`shoal.membership.watch`)."""

    @abc.abstractmethod
    def renew_if_dissolved(self) -> bool:
        """Before a round, outside a step: leave a quorum whose abort flag is raised; True if it left."""

    def start_state(self, module: nn.Module, named_params: list[tuple[str, Any]] | None = None,
                    tag: str = "init", buffers: bool = True) -> None:
        """Nothing: an elastic group has no members yet; its first quorum's heal gives newcomers the state."""

    # --- collectives ---------------------------------------------------------------
    def _issue(self, tag: str, result: Any, launch: Callable[[Any], Any],
               post: Callable[[Any], Any] | None = None, whole: bool = False) -> Handle:
        pg = self._live_pg()
        if not self._started():
            raise ShoalError("collective on an elastic group before its first step: call begin_step() "
                             "first (shoal's DistributedDataParallel does so in forward)")
        if self.size == 1:
            return Handle(None, result, self.meter, tag, self.timeout, post)
        if self.error is not None or pg is None:
            return Handle(None, result, self.meter, tag, self.timeout)   # the step is lost anyway
        try:
            work = launch(pg)
        except Exception as e:  # noqa: BLE001 - e.g. the connection died before the op started
            self._record(PeerLostError(f"collective {tag!r} could not start: {e}"))
            return Handle(None, result, self.meter, tag, self.timeout)
        return _ElasticHandle(self.link, work, result, self.meter, tag, self.timeout, post, whole)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle:
        check_reduce_op(op)
        self.meter.record(tag, "all_reduce", _nbytes(tensor), self.size, self.rank)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS["sum" if op == "avg" else op]  # type: ignore[assignment]
        size = self.size  # averages divide by the live contributors of this quorum
        post = (lambda t: t.div_(size)) if op == "avg" else None  # noqa: E731
        return self._issue(tag, tensor, lambda pg: pg.allreduce([tensor], opts), post)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "misc") -> Handle:
        self._check_rank(src, "src")
        self.meter.record(tag, "broadcast", _nbytes(tensor), self.size, self.rank, src)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._issue(tag, tensor, lambda pg: pg.broadcast([tensor], opts))

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", tag: str = "misc") -> Handle:
        """Reduce into rank ``dst``'s ``tensor`` (e.g. the intra-host stage of a two-level mean)."""
        self._check_rank(dst, "dst")
        if op not in _REDUCE_OPS:
            raise ConfigError(f"reduce supports {sorted(_REDUCE_OPS)}, got {op!r}")
        self.meter.record(tag, "reduce", _nbytes(tensor), self.size, self.rank, dst)
        opts = dist.ReduceOptions()
        opts.reduceOp, opts.rootRank, opts.rootTensor = _REDUCE_OPS[op], dst, 0  # type: ignore[assignment]
        return self._issue(tag, tensor, lambda pg: pg.reduce([tensor], opts))

    def all_gather(self, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        self.meter.record(tag, "all_gather", _nbytes(tensor), self.size, self.rank)
        out = [tensor] if self.size == 1 else [torch.empty_like(tensor) for _ in range(self.size)]
        return self._issue(tag, out, lambda pg: pg.allgather([out], [tensor.contiguous()]))

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        start_gather_into(output, tensor, self.size)   # the size-1 case is filled here, _issue returns at once
        self.meter.record(tag, "all_gather", _nbytes(tensor), self.size, self.rank)
        return self._issue(tag, output, lambda pg: pg._allgather_base(output, tensor.contiguous()))

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, tag: str = "misc") -> Handle:
        check_all_to_all(output, tensor, self.size)
        self.meter.record(tag, "all_to_all", _nbytes(tensor), self.size, self.rank)
        if self.size == 1:
            output.view(-1).copy_(tensor.view(-1))
        src = tensor.contiguous()
        return self._issue(tag, output, lambda pg: pg.alltoall_base(output, src, [], [], dist.AllToAllOptions()))

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", tag: str = "misc") -> Handle:
        if tensor.numel() != self.size * output.numel():
            raise ValueError(f"input has {tensor.numel()} elements, expected {self.size} x {output.numel()}")
        if op not in ("sum", "avg"):
            raise ConfigError(f"reduce_scatter supports sum and avg, got {op!r}")
        buf = tensor.clone()
        chunk = buf.view(-1).narrow(0, self.rank * output.numel(), output.numel())
        inner = self.all_reduce(buf, op=op, tag=tag)   # gloo has no reduce_scatter

        def take(_: Any) -> torch.Tensor:
            inner.wait()
            return output.view(-1).copy_(chunk).view_as(output)

        return Handle(None, output, self.meter, tag, self.timeout, take)

    def p2p(self, op: str, tensor: torch.Tensor, peer: int, slot: int, tag: str) -> Handle:
        """Send ``tensor`` to rank ``peer`` (``op="send"``) or receive it from there (``"recv"``).

        One wait for the whole op timeout (see :meth:`Link.await_work`); ``slot``
        tells apart the messages between the same two ranks.
        """
        self.meter.record(tag, op, _nbytes(tensor), self.size, self.rank)
        if op == "send":
            return self._issue(tag, tensor, lambda pg: pg.send([tensor], peer, slot), whole=True)
        return self._issue(tag, tensor, lambda pg: pg.recv([tensor], peer, slot), whole=True)

    def barrier(self, tag: str = "control") -> None:
        self.all_reduce(torch.zeros(1, device=self.device), tag=tag).wait()

    def all_gather_object(self, obj: Any, tag: str = "control") -> list[Any]:
        """Gather objects (see :func:`shoal.comm.objects.all_gather_object`); after a failure, ``[obj] * size``."""
        return all_gather_object(self, obj, tag)

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, tag: str = "misc",
                            cache: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        """Overwrite ``tensors`` with rank ``src``'s (see :func:`shoal.comm.group.broadcast_coalesced`)."""
        self._check_rank(src, "src")
        broadcast_coalesced(self, tensors, src, tag, cache)

