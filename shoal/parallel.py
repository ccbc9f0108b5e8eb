"""Drop-in replacement for ``torch.nn.parallel.DistributedDataParallel``.

Swapping the import is the whole migration::

    import shoal
    shoal.init()
    model = shoal.DistributedDataParallel(model)      # was torch's DDP
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()                                 # gradients averaged here
        opt.step(); opt.zero_grad()
    print(model.comm_stats().last.bytes_sent)           # bytes of the last step
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shoal.comm.group import Group
from shoal.codecs.base import Codec
from shoal.codecs.hierarchical import Hierarchical, reduction_codec
from shoal.comm.topology import Topology
from shoal.comm.meter import CommStats, StepMeter
from shoal.comm.start import check_same_model  # noqa: F401 - re-exported: its home was here
from shoal.ddp_args import torch_ddp_options
from shoal.ddp_join import JoinableDDP
from shoal.errors import ConfigError, ShoalError
from shoal.reducer import BucketStepper, CommHook, Reducer
from shoal.steps import open_step


def _as_group(process_group: Any) -> Group:
    if isinstance(process_group, Group):
        return process_group
    return Group(process_group)


def _single_device(module: nn.Module) -> torch.device:
    devices: dict[torch.device, str] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{n!r} on {d}" for d, n in devices.items())
        raise ConfigError(
            f"the module's parameters and buffers live on several devices ({where}); "
            "DistributedDataParallel replicates a module on one device per process: move it with .to(device)"
        )
    return next(iter(devices), torch.device("cpu"))


class DistributedDataParallel(nn.Module, JoinableDDP):
    """Data-parallel wrapper with the constructor of torch's DDP.

    Args:
        module: the model replica of this process (on one device).
        device_ids: ``None`` for CPU modules; ``[i]`` (this process's GPU) for CUDA.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        process_group: a ``torch.distributed`` ProcessGroup or a :class:`shoal.Group`;
            default: the world. An :class:`shoal.elastic.ElasticGroup` makes the
            model elastic: each forward starts a step, the step ends with
            ``ElasticOptimizer.step()`` (or ``group.commit()``); see
            docs/elastic.md. Any :class:`shoal.Group` runs the same code: each
            forward calls ``group.begin_step()``, trivial on a static group.
        broadcast_buffers: broadcast buffers (e.g. BatchNorm statistics) from
            rank 0 before each forward (default ``None``: on); ``False`` also
            leaves them out of the start broadcast (torch's rule; its newer
            ``forward_sync_buffers`` wins and never affects the start).
        init_sync: ``False`` skips the start check and broadcast: every rank
            must then hold the same parameters already.
        bucket_cap_mb: bucket size cap in MiB (default ``None``: 25); smaller
            buckets start communicating earlier, larger ones amortise
            per-call overhead.
        static_graph: torch's promise that every step uses the same graph;
            shoal then tolerates parameters the forward never uses (as
            ``find_unused_parameters=True``, unless ``optimizer=`` is given).
        mixed_precision: torch's ``_MixedPrecision``: a ``reduce_dtype`` of
            float16/bfloat16 reduces through ``codecs.Cast``; a
            ``param_dtype``/``buffer_dtype`` that differs from the module's
            is refused (use ``torch.autocast``).
        device_mesh: a one-dimensional DeviceMesh, instead of ``process_group``.
        check_reduction, batched_grad_copy, delay_all_reduce_named_params,
            param_to_hook_all_reduce: accepted, no effect on the result
            (torch-internal scheduling); ``bucket_cap_mb_list`` and
            ``skip_all_reduce_unused_params=True`` are refused with the
            alternative. Every argument: docs/migrating.md.
        find_unused_parameters: walk the forward's graph to find parameters it
            did not use, so they do not block their bucket; costs a graph
            traversal per step, so leave it off when every parameter is used.
        gradient_as_bucket_view: in both modes, a parameter whose ``.grad``
            is None when a synchronised backward starts gets a view of its
            gradient bucket as ``.grad``, and autograd accumulates into it
            (no copy; the usual case after ``zero_grad()``). ``True``: the
            buckets are reused at every backward and ``.grad`` aliases them
            (no allocation; a ``.grad`` kept across steps is overwritten).
            ``False`` (torch's semantics): after backward the bucket hands
            its buffer over to those ``.grad``; at the next backward it takes
            it back if nothing else sees it any more (``zero_grad()`` dropped
            them), else it takes a fresh one, so a kept ``.grad`` never
            changes; they are views of one flat tensor per bucket, which
            stays allocated while any of them lives. A ``.grad`` that is some other tensor keeps its
            identity and receives the average (one batched copy per bucket).
        codec: a :class:`shoal.codecs.Codec` that averages each bucket's
            gradients (e.g. ``shoal.codecs.PowerSGD(rank=4)``), run on a
            communication thread so it overlaps backward. ``None``: exact
            all-reduce. Its state is in ``model.codec.state_dict()``.
        optimizer: a :class:`shoal.ZeroRedundancyOptimizer` over this
            module's parameters, to step during backward: each gradient
            bucket belongs to one rank, which steps it as soon as it is
            reduced and broadcasts the result; the next forward waits for
            the broadcasts. ``optimizer.step()`` then has nothing left to do.
            On an elastic group (the optimizer on the same group) a
            backward's bucket steps form one elastic step that
            ``zero.step()`` votes (or, if the loop skips it, the next step
            start): a failure anywhere discards it on every member; see
            :mod:`shoal.optim.zero_overlap`. Any object implementing
            :class:`shoal.reducer.BucketStepper` is accepted.
        hierarchical: reduce inside each host, all-reduce among one leader
            per host (through ``codec``), broadcast inside each host (SPEC
            A7). ``None`` (default): on when the ranks span several hosts and
            some host holds several ranks (host identity: ``SHOAL_HOST_ID``,
            else the hostname); ``False``: always flat; ``True``: always
            two-level. The layout is in ``model.topology``. On an elastic
            group, ``True`` (or a ``Hierarchical`` codec) rebuilds the host
            and leader subgroups at every quorum from the members' host
            identities (``ElasticGroup(host_id=...)``); a failure at any
            level drops the step on every member (the vote in
            ``ElasticOptimizer.step()``); ``model.topology`` is the current
            quorum's. ``None`` (with no codec) is automatic there too,
            re-decided at each quorum: the exact two-level reduction when the
            quorum spans several hosts and some host holds several workers,
            else the flat one. With a codec, ``None`` stays flat on an elastic
            group (the codec's state would have to move between leaders and
            every worker whenever the choice flips): pass ``True``.
        skip_nonfinite: when the averaged gradients hold a NaN/Inf (some
            rank's gradients were not finite), every rank skips the step
            together (SPEC G5): the averaged gradients are written to
            ``.grad`` as usual, and the next ``step()`` of any optimizer
            holding these parameters first sets their ``.grad`` to ``None``
            (a global optimizer pre-hook, :mod:`shoal.nonfinite`), so it
            changes nothing (torch optimizers skip parameters without a
            gradient); a ``RuntimeWarning`` is issued and
            ``comm_stats().total.nonfinite_skips`` counts it. All ranks hold
            the same averaged gradients, so one fused check after the step's
            last collective gives every rank the same verdict with no extra
            message (docs/codecs.md). ``torch.amp.GradScaler`` works
            unchanged: its ``unscale_`` sees the same Inf on every rank,
            skips the step and lowers its scale. Gradients accumulated under
            ``no_sync()`` are dropped with the step. The verdict is read on
            the host (a sync) only when an optimizer needs it: torch's fused
            Adam/AdamW (and fused SGD once its momentum exists) get it as
            their ``found_inf`` and skip on the device, and the warning then
            comes at the next forward (on an H100 the host read cost ~5 % of
            a small GPT's step: docs/BENCHMARKS.md). ``False``: no check.

    Example::

        model = shoal.DistributedDataParallel(nn.Linear(10, 1), bucket_cap_mb=1)
        model(torch.randn(4, 10)).sum().backward()
        stats = model.comm_stats()        # .last / .total CommCounters
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        codec: Codec | None = None,
        optimizer: BucketStepper | None = None,
        hierarchical: bool | None = None,
        skip_nonfinite: bool = True,
    ) -> None:
        super().__init__()
        self._init_join()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a shoal.codecs.Codec, got {type(codec).__name__}")
        if optimizer is not None and not isinstance(optimizer, BucketStepper):
            raise ConfigError(f"optimizer must be a shoal.ZeroRedundancyOptimizer (its step is overlapped with "
                              f"backward; any shoal.reducer.BucketStepper), got {type(optimizer).__name__}; "
                              "other optimizers step after backward")
        if optimizer is not None and find_unused_parameters:
            raise ConfigError("optimizer= cannot be combined with find_unused_parameters=True: which parameters "
                              "were unused is known only after backward, too late to step buckets during it")
        if not isinstance(skip_nonfinite, bool):
            raise ConfigError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
        if dim != 0:
            raise ConfigError(f"dim={dim} is not supported: shoal replicates whole batches, one per process (dim=0)")
        opts = torch_ddp_options(
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers, init_sync=init_sync,
            check_reduction=check_reduction, static_graph=static_graph, mixed_precision=mixed_precision,
            device_mesh=device_mesh, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            bucket_cap_mb_list=bucket_cap_mb_list, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, batched_grad_copy=batched_grad_copy, codec=codec,
            param_dtypes={p.dtype for p in module.parameters() if p.requires_grad},
            buffer_dtypes={b.dtype for b in module.buffers() if b.is_floating_point()})
        codec, bucket_cap_mb = opts.codec, opts.bucket_cap_mb
        if opts.static_graph and optimizer is None:
            # torch's static graph tolerates parameters the forward never uses (the same ones every step).
            find_unused_parameters = True
        device = _single_device(module)
        self._check_device_ids(device_ids, device)
        self.module = module
        self.group = _as_group(opts.process_group)
        self.broadcast_buffers = opts.forward_sync_buffers
        self.static_graph = opts.static_graph
        self.dim = dim
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self._require_forward_param_sync = True
        self._flat_buffers: dict[torch.dtype, torch.Tensor] = {}  # reused for buffer broadcasts
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the module has no parameter that requires grad: nothing to synchronise")
        self.elastic = self.group.traits.members_change
        if opts.init_sync:   # elastic: nothing, its first heal does it
            self.group.start_state(module, named, tag="ddp/init", buffers=opts.init_sync_buffers)
        self.reducer = Reducer(named, self.group, int(bucket_cap_mb * 1024 * 1024),
                               find_unused_parameters, gradient_as_bucket_view)
        self.reducer.skip_nonfinite = skip_nonfinite
        self.codec = codec
        self._topology: Topology | None = None
        self._two_level: Hierarchical | None = None
        self._auto_hierarchical = False
        self._per_quorum: Hierarchical | None = None   # elastic automatic choice, re-made at each quorum
        reducer_codec = self._reduction_codec(codec, hierarchical)
        self._register_heal_state(codec)  # after every check, so that a refused model leaves nothing registered
        if reducer_codec is not None:
            self.reducer.set_codec(reducer_codec)
        self._refuse_background_heal(reducer_codec)
        self._steps = StepMeter(self.group.meter, "ddp")
        self.reducer.on_step_done = self._steps.mark_step
        self.optimizer = optimizer
        if optimizer is not None:
            optimizer.attach_to_reducer(self.reducer, self.module)

    def _refuse_background_heal(self, reducer_codec: Codec | None) -> None:
        """A codec's means (a two-level one's too) count every member: no quorum with a non-contributor
        (shoal.membership.catchup), always with a codec, in quorums that span hosts when automatic."""
        per_quorum = self._per_quorum
        if reducer_codec is not None:
            self.group.refuse_background_heal("shoal DDP with a codec or a two-level reduction (its means count "
                                              "every member)")
        elif per_quorum is not None:
            self.group.refuse_background_heal("shoal DDP's two-level reduction in a quorum that spans hosts",
                           lambda: bool(per_quorum.levels(self.group).topology.is_hierarchical()))

    def _reduction_codec(self, codec: Codec | None, hierarchical: bool | None) -> Codec | None:
        """The codec buckets go through: ``codec``, or it inside a two-level reduction."""
        chosen, self._topology = reduction_codec(self.group, codec, hierarchical, per_quorum=True)
        self._two_level = chosen if isinstance(chosen, Hierarchical) else None
        self._auto_hierarchical = hierarchical is None and codec is None and chosen is not None
        if self._two_level is not None and self._two_level.automatic:
            # Elastic and automatic: the layout is known per quorum, so forward picks the reduction.
            self._per_quorum, chosen = self._two_level, None
        return chosen

    def _choose_per_quorum(self, two_level: Hierarchical) -> None:
        """This quorum's automatic choice (cached per quorum): two-level if it spans hosts, else flat."""
        two = two_level.levels(self.group).topology.is_hierarchical()
        self.reducer.codec = two_level if two else None

    @property
    def topology(self) -> Topology | None:
        """Where the ranks are (hosts, leaders), if it was discovered; on an elastic group with a
        two-level reduction (or the automatic choice), the current quorum's (``None`` before the
        first forward)."""
        if self._two_level is not None and self._topology is None:   # elastic: known per quorum
            return self._two_level.current_topology(self.group)
        return self._topology

    def _register_heal_state(self, codec: Codec | None) -> None:
        # No collective here: a newcomer's peers are mid-training, not constructing.
        # The first quorum's heal broadcasts everything from one member instead (A2).
        # A static group keeps the registration and never uses it.
        group = self.group
        key = group.unique_name("ddp")   # two models on one group register apart
        group.register_state(f"{key}/module", self.module.state_dict, self.module.load_state_dict)
        if codec is not None:  # a failed step may have half-updated it: roll back on discard
            group.register_state(f"{key}/codec", codec.state_dict, codec.load_state_dict, rollback=True,
                                 heal_load=lambda s: codec.load_state_dict(codec.newcomer_state(s)),
                                 snapshot=codec.rollback_state)

    @staticmethod
    def _check_device_ids(device_ids: Sequence[int | torch.device] | None, device: torch.device) -> None:
        if device.type == "cpu":
            if device_ids:
                raise ConfigError(f"device_ids must be None for a module on the CPU, got {list(device_ids)}")
            return
        if device_ids is not None and len(device_ids) != 1:
            raise ConfigError(f"device_ids must name exactly one device (this process's), got {list(device_ids)}")
        if device_ids:
            first = device_ids[0]
            want = first if isinstance(first, torch.device) else torch.device(device.type, first)
            if want != device:
                raise ConfigError(f"device_ids={list(device_ids)} but the module lives on {device}")

    # --- training ------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The last backward's deferred non-finite verdict is read before begin_step clears a failed
        # step's error: the flag of a step that failed since is no verdict (shoal.nonfinite).
        self.reducer.verdict.resolve()
        open_step(self.group)  # elastic: adopt the latest quorum (rebuild, heal) before any collective
        if self._per_quorum is not None:
            self._choose_per_quorum(self._per_quorum)
        self._notify_join()  # inside torch's Join: this rank is live (ranks that joined shadow what follows)
        if self._require_forward_param_sync and self.broadcast_buffers and self.group.size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                self.group.broadcast_coalesced(buffers, src=self._buffer_source(), tag="ddp/buffers",
                                               cache=self._flat_buffers)
        if self._join_config.enable:
            self._agree_on_sync(joined=False)
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._require_forward_param_sync = True
            self.reducer.prepare_for_backward(out)
        else:
            self._require_forward_param_sync = False
            self.reducer.disarm()
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block syncs them all.

        Example::

            with model.no_sync():
                model(x1).sum().backward()      # local only
            model(x2).sum().backward()          # averaged: x1's and x2's gradients
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]``, torch's contract.

        torch's own hooks (``default_hooks.allreduce_hook``,
        ``fp16_compress_hook``, ``powerSGD_hook.powerSGD_hook``) run unchanged.
        The hook must divide by the world size itself. Register before the
        first backward, once. The non-finite check (``skip_nonfinite``) runs
        on the tensor the hook's future returns; it gives every rank the
        same verdict only if that tensor is the same on every rank (true of
        torch's hooks, which all-reduce) and a NaN/Inf sent by any rank
        reaches it: a hook that returns rank-dependent results or drops
        values must ensure that itself.

        Example::

            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        """
        if not callable(hook):
            raise ConfigError(f"hook must be callable, got {type(hook).__name__}")
        if self.group.traits.members_change:
            raise ShoalError("communication hooks cannot run on an elastic group (they would talk to a "
                             "process group that is replaced at each quorum); pass codec= instead")
        if self.reducer.comm_hook is not None:
            raise ShoalError("a communication hook is already registered; register_comm_hook may be called once")
        if self._auto_hierarchical:
            # The hook replaces the exact two-level reduction chosen automatically.
            self.reducer.codec = None
            self._auto_hierarchical = False
        if self.reducer.codec is not None:
            if self.codec is None:
                raise ShoalError(
                    "this model reduces hierarchically (hierarchical=True); a communication hook "
                    "replaces that reduction: pass hierarchical=False to use one"
                )
            raise ShoalError(
                f"this model already averages through codec {type(self.codec).__name__}; "
                "use either codec= or register_comm_hook, not both"
            )
        self.reducer.comm_hook = hook
        self.reducer.hook_state = state

    def comm_stats(self) -> CommStats:
        """Bytes sent/received and seconds waited on communication: last step and total.

        Bytes are counted for shoal's own collectives; a foreign comm hook that
        calls ``torch.distributed`` directly is not seen by the meter (its wait
        time is). A non-finite verdict not read yet (a fused optimizer skipped on
        the device) is read first, so a skip in the last step is counted.
        """
        self.reducer.verdict.resolve()
        return self._steps.stats()

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.group.pg
