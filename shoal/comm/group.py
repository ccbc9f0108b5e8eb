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

import abc
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shoal.comm.flat import flat_views
from shoal.comm import lifetime
from shoal.comm.handle import Handle
from shoal.comm.meter import Meter
from shoal.comm.objects import all_gather_object
from shoal.comm.rules import MemberInfo, Partition
from shoal.comm.start import STATIC, Traits, broadcast_module, check_same_model
from shoal.comm.stepping import Levels, Outside, StaticLevels, StepHooks
from shoal.comm.streams import connect
from shoal.comm.topology import HostGroups, discover
from shoal.errors import ConfigError, ShoalError

# torch 2.13 renamed the flat-tensor collectives (the old names warn with a FutureWarning at every call);
# older torch has only the old names.
_ALL_GATHER_SINGLE: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["Group", "Handle", "check_reduce_op", "check_all_to_all", "start_gather_into", "broadcast_coalesced"]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


class _Broadcasts(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "misc") -> Handle: ...


def broadcast_coalesced(group: _Broadcasts, tensors: Sequence[torch.Tensor], src: int = 0, tag: str = "misc",
                        cache: dict[torch.dtype, torch.Tensor] | None = None) -> None:
    """Blocking: overwrite ``tensors`` with rank ``src``'s, one flat broadcast per dtype over ``group``.

    ``cache`` keeps the flat buffers between calls (pass the same dict
    each time on hot paths, e.g. buffers broadcast before every forward).

    Example::

        broadcast_coalesced(group, list(model.buffers()), src=0, tag="ddp/buffers")
    """
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
            group.broadcast(flat, src=src, tag=tag).wait()
            torch._foreach_copy_(same, flat_views(flat, same))


class Group(metaclass=abc.ABCMeta):
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

    It implements the step interface (:class:`~shoal.comm.stepping.StepInterface`)
    with the static answers: every step commits, nobody is ever healed, and
    a failed collective raises. An elastic group
    (:class:`~shoal.membership.elastic.ElasticGroup`) is not a subclass: it
    implements the same interface over a process group per quorum, and is
    registered as a virtual subclass so that ``isinstance(g, Group)`` holds
    for every group.
    """

    elastic = False       # True on groups whose members change between steps
    traits: Traits = STATIC
    newcomers: tuple[int, ...] = ()

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
        self.hooks = StepHooks()   # registered states and step hooks (kept, never healed: no member changes)
        self.step = 0              # committed steps (the step interface's count; an elastic group heals it)
        lifetime.hold(self)        # its process group is destroyed at exit, not during finalization

    def _let_go_at_exit(self) -> None:
        """Drop the process group (:mod:`shoal.comm.lifetime`): called at interpreter exit only."""
        self.__dict__.pop("pg", None)

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
        work = _ALL_GATHER_SINGLE(output, tensor.contiguous(), group=self.pg, async_op=True)
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
        work = _REDUCE_SCATTER_SINGLE(output, tensor.contiguous(), group=self.pg, async_op=True)
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
        """Blocking: overwrite ``tensors`` with rank ``src``'s (see :func:`broadcast_coalesced`)."""
        self._check_rank(src, "src")
        broadcast_coalesced(self, tensors, src, tag, cache)

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

    # --- the step interface (static) -----------------------------------------------
    @property
    def member(self) -> bool:
        """Whether this worker belongs to this group (False only for a subgroup whose rule leaves it out)."""
        return True

    @property
    def quorum_pending(self) -> bool:
        """Whether the next :meth:`begin_step` adopts a new membership (never, on a static group)."""
        return False

    def begin_step(self) -> None:
        """Begin a step (:mod:`shoal.comm.stepping`); on a static group only the hooks run."""
        self.hooks.run_before_begin()

    def commit(self) -> bool:
        """End the step; True on every member of a static group (:attr:`step` counts it, the hooks of
        :meth:`on_commit` run)."""
        self.step += 1
        self.hooks.run_on_commit()
        return True

    @property
    def error(self) -> BaseException | None:
        """This step's first failure; always None on a static group (a failed collective raises there)."""
        return None

    def report_error(self, err: BaseException) -> None:
        """Make this step fail on every member; a static group cannot vote, so ``err`` is raised at once."""
        raise err

    # --- the background heal (shoal.membership.catchup): only ElasticGroup has one -----------------------
    def contribution(self) -> tuple[bool, int]:
        """(whether this member's data counts in this step's means, how many members' data does): every
        member's, here (an elastic group's joiner catching up in the background counts zero)."""
        return True, self.size

    def shortfall(self) -> float:
        """How much weight this step's means lack from members counted with part of one (an elastic group's
        joiner that entered between two rounds): none here."""
        return 0.0

    def out_ranks(self) -> frozenset[int]:
        """The ranks whose data counts zero in this step's means (an elastic group's joiners catching up in the
        background): none here. ``size - len(out_ranks())`` is :meth:`contribution`'s count."""
        return frozenset()

    def register_replay(self, replayer: Any) -> None:
        """Nothing here: only an elastic group's background heal replays the updates a joiner received."""

    def refuse_background_heal(self, why: str, when: Callable[[], bool] | None = None) -> None:
        """Nothing here: only an elastic group heals joiners in the background (SHOAL_HEAL=background)."""

    def watch_peers(self) -> None:
        """Nothing here: only an elastic group watches its members' heartbeats (shoal.membership.watch)."""

    def renew_if_dissolved(self) -> bool:
        """False: a static group's membership never changes (an elastic group may re-form before a round)."""
        return False

    def start_state(self, module: nn.Module, named_params: list[tuple[str, Any]] | None = None,
                    tag: str = "init", buffers: bool = True) -> None:
        """Give every member rank 0's model (collective): check that every rank built the same model, then broadcast.

        ``named_params`` (default: the module's parameters that require grad)
        are the ones compared; ``buffers=False`` broadcasts parameters only
        (torch DDP's ``broadcast_buffers=False`` at start). An elastic group does nothing here: it has no
        members yet, and its first quorum's heal gives newcomers the state.

        Example::

            group.start_state(model, tag="mystrategy/init")
        """
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad] \
            if named_params is None else named_params
        check_same_model(self, named)
        broadcast_module(module, self, tag=tag, buffers=buffers)

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every committed step (e.g. to advance a data cursor)."""
        self.hooks.on_commit.append(fn)

    def before_begin_step(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the top of every :meth:`begin_step` (e.g. to end a lazily ended step)."""
        self.hooks.before_begin.append(fn)

    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any],
                       rollback: bool = False, heal_load: Callable[[Any], Any] | None = None,
                       snapshot: Callable[[], Any] | None = None) -> None:
        """Add state that newcomers receive when they heal (and, with ``rollback``, that a discard restores).

        ``get()`` returns something ``torch.save`` can write; ``load(x)``
        restores it. With ``rollback=True`` it is also snapshotted at each
        step start and restored when the step is discarded (e.g. a codec's
        error feedback, which a failed step may have half-updated); then
        ``get()`` must return a copy, not views of live tensors (codecs'
        ``state_dict()`` do), because it is called every step and copying
        it again would double the cost.
        ``heal_load(x)``, if given, replaces ``load`` when the state comes
        from a peer rather than from a rollback snapshot: state that is the
        peer's own and must not be copied (an error-feedback residual, see
        :meth:`shoal.codecs.Codec.newcomer_state`) is dropped there.
        ``snapshot()``, if given, replaces ``get`` for the per-step rollback
        snapshot: something cheaper that ``load`` accepts and that stays valid
        through one step (a codec's :meth:`~shoal.codecs.Codec.rollback_state`
        holds its tensors by reference and never overwrites them in place).
        Every member must register the same keys (a key twice: ConfigError).
        On a static group nothing heals and nothing is discarded: the
        registration is checked and kept, never used. This is the group's one
        registry (:class:`StepHooks`): an elastic group heals and rolls back exactly these states.

        Example::

            group.register_state("optimizer", opt.state_dict, opt.load_state_dict)
        """
        self.hooks.register(key, get, load, rollback, heal_load, snapshot)

    def unique_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``... if taken on this group (every worker asks in the same order)."""
        return self.hooks.unique_name(name)

    def member_infos(self) -> list[MemberInfo]:
        """Every member's slot (its rank here) and host identity, by rank (collective the first time)."""
        if self.hooks.infos is None:
            topo = discover(self)
            hosts = {r: i for i, h in enumerate(topo.hosts) for r in h}
            self.hooks.infos = [MemberInfo(r, f"host-{hosts[r]}") for r in range(self.size)]
        return self.hooks.infos

    def subgroup(self, rule: Partition, name: str) -> "Group | Outside":
        """This worker's subgroup under ``rule`` (collective: every member calls it, in the same order).

        On a static group the rule is applied once; a worker that the rule
        leaves out gets an :class:`~shoal.comm.stepping.Outside` (``member`` False).
        """
        name = self.unique_name(name)
        mine = self.split(rule(self.member_infos()))
        return mine if mine is not None else Outside(name)

    def host_groups(self, name: str) -> Levels:
        """The subgroups of a two-level mean (``.current()`` -> :class:`~shoal.comm.topology.HostGroups`)."""
        self.unique_name(name)
        return StaticLevels(HostGroups.build(self))

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
