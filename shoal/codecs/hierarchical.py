"""Two-level (topology-aware) mean around any codec: exact inside hosts, ``inner`` between them."""

from __future__ import annotations

from typing import Any, Sequence, cast

import torch

from shoal.codecs.base import BufferPool, Codec, LossyCodec, check_inputs, common_dtype, flatten_into, sub_tag, unflatten_from
from shoal.codecs.identity import Identity
from shoal.comm.asks import members_fixed
from shoal.comm.flat import flat_views
from shoal.comm.group import Group
from shoal.comm.stepping import StaticLevels
from shoal.comm.topology import HostGroups, Topology, discover
from shoal.errors import ConfigError, ShoalError


class Hierarchical(LossyCodec):
    """Reduce inside each host, mean among host leaders through ``inner``, broadcast inside each host.

    With ``H`` hosts, ``W`` ranks and ``S`` bytes, a flat ring all-reduce
    sends ``2(W-1)/W * S`` bytes over each host's link; this sends
    ``2(H-1)/H * S`` (times ``inner``'s compression) over it, and the
    intra-host stages (exact sums, in the tensors' dtype) stay on the host.
    With 2 hosts x 2 ranks that is ``S`` instead of ``1.5 S``. With the
    exact inner codec (:class:`Identity`) the buffer goes in chunks of
    ``chunk_mb`` MiB, pipelined so that the host stages of one chunk overlap
    the leaders' all-reduce of another; lossy codecs see whole tensors.

    Uneven hosts work: each leader scales its host's sum by ``H / W`` so the
    leaders' mean is the mean over all ``W`` ranks. Only leaders run
    ``inner``, so codec state (PowerSGD's Q, error-feedback residuals) lives
    on leaders. Wrapped by :class:`~shoal.codecs.ErrorFeedback`, a lossy
    ``inner``'s error is charged to the leader (scaled by ``W / H``), so the
    feedback still conserves the sum.

    The subgroups are made on first use with a group (a collective: every
    rank of the group must be calling), or ahead of time by :meth:`setup`.
    Host identities come from :func:`shoal.comm.topology.host_identity`
    (``SHOAL_HOST_ID``, else the hostname). Meter tags: ``<tag>/intra`` for
    the host stages, ``inner``'s own tags for the leaders' stage.

    The subgroups come from ``group.host_groups(...)`` (the step interface,
    :mod:`shoal.comm.stepping`): built once on a static group; on an
    :class:`~shoal.membership.elastic.ElasticGroup` they follow each quorum (no
    collective): hosts and their leaders are recomputed from the quorum's
    members, and a failure at any level fails the step on every member (the
    group's vote discards it).

    Example::

        codec = Hierarchical(Cast(torch.bfloat16))   # bf16 between hosts only
        codec.mean(grads, names, group, tag="ddp/grad")
        model = shoal.DistributedDataParallel(model, codec=Hierarchical(PowerSGD(rank=4)))
    """

    def __init__(self, inner: Codec | None = None, chunk_mb: float = 4.0) -> None:
        super().__init__()
        if not chunk_mb > 0:
            raise ConfigError(f"chunk_mb must be > 0 (MiB per pipelined chunk), got {chunk_mb}")
        self.chunk_mb = chunk_mb
        inner = Identity() if inner is None else inner
        if not isinstance(inner, Codec):
            raise ConfigError(f"inner must be a shoal.codecs.Codec, got {type(inner).__name__}")
        if isinstance(inner, Hierarchical):
            raise ConfigError("Hierarchical(Hierarchical(...)) reduces inside hosts twice; wrap the inner codec once")
        self.inner = inner
        self.lossy = inner.lossy
        self.error_feedback = bool(getattr(inner, "error_feedback", False))
        self.automatic = False    # chosen by reduction_codec(hierarchical=None) on an elastic group
        self._pool = BufferPool()
        # keyed by id(group); the group is kept so its id cannot be reused
        self._levels: dict[int, tuple[Group, Any]] = {}

    def attach(self, group: Group) -> Any:
        """The per-step levels of ``group`` (``group.host_groups``; ``.current()`` -> :class:`HostGroups`).

        Made once per group: a collective on a static group (every rank must
        call it, e.g. when building the model), none on an elastic group.
        """
        cached = self._levels.get(id(group))
        if cached is None:
            cached = self._levels[id(group)] = (group, group.host_groups("hier"))
        return cached[1]

    def setup_elastic(self, group: Group) -> Any:
        """:meth:`attach` (the name it had when only elastic groups needed it)."""
        return self.attach(group)

    def levels(self, group: Group) -> HostGroups:
        """The subgroups a mean over ``group`` uses now (an elastic group's: this quorum's)."""
        return self.attach(group).current()

    def current_topology(self, group: Group) -> Topology | None:
        """This step's layout over ``group``; ``None`` before an elastic group's first quorum."""
        try:
            return self.levels(group).topology
        except ShoalError:   # no quorum yet: nothing is laid out
            return None

    def setup(self, group: Group, topology: Topology | None = None) -> HostGroups:
        """Discover the topology and make the subgroups for static ``group`` now (collective).

        ``topology``: an already discovered layout (saves a collective).
        """
        if group.traits.members_change:
            raise ConfigError("an elastic group's layout changes with each quorum: use attach(group) (no "
                              "collective) and levels(group) inside a step")
        if topology is not None and id(group) not in self._levels:
            self._levels[id(group)] = (group, StaticLevels(HostGroups.build(group, topology)))
        return self.levels(group)

    @torch.no_grad()
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        check_inputs(tensors, names, "Hierarchical")
        levels = self.levels(group)
        if not tensors:
            return
        topo = levels.topology
        numel = sum(t.numel() for t in tensors)
        flat = self._pool.get("flat", numel, common_dtype(tensors), tensors[0].device)
        flatten_into(tensors, flat)
        intra = sub_tag(tag, "intra")
        if type(self.inner) is Identity and residuals is None and topo.num_hosts > 1:
            self._pipelined_exact(flat, levels, tag)
            unflatten_from(flat, tensors)
            self._count(tensors, flat.numel() * flat.element_size())
            return
        if levels.local.size > 1:
            levels.local.reduce(flat, dst=0, op="sum", tag=intra).wait()
        if residuals is not None:
            for r in residuals:
                r.zero_()  # non-leaders' contributions travel exactly
        if levels.leaders is not None:
            # a level is a Group or an ElasticSubgroup (a registered virtual subclass of Group)
            self._leaders_mean(flat, tensors, names, cast(Group, levels.leaders), topo, tag, residuals)
        if levels.local.size > 1:
            levels.local.broadcast(flat, src=0, tag=intra).wait()
        unflatten_from(flat, tensors)
        self._count(tensors, flat.numel() * flat.element_size())

    def _pipelined_exact(self, flat: torch.Tensor, levels: HostGroups, tag: str) -> None:
        """Exact mean in chunks, so the three stages of different chunks overlap.

        Chunk i's leaders' all-reduce runs while chunk i+1 is still being
        reduced inside the host and chunk i-1 broadcast; every collective of
        one process group is issued in chunk order on every rank.
        """
        intra, inter = sub_tag(tag, "intra"), sub_tag(tag, "identity")
        chunk = max(1, int(self.chunk_mb * 2**20) // flat.element_size())
        chunks = list(flat.split(chunk))
        local, leaders, world = levels.local, levels.leaders, levels.topology.world_size
        reduced = [local.reduce(c, dst=0, op="sum", tag=intra) for c in chunks]
        if leaders is None:
            for h in [local.broadcast(c, src=0, tag=intra) for c in chunks]:
                h.wait()
            for h in reduced:
                h.wait()
            return
        crossing = []
        for c, h in zip(chunks, reduced):
            h.wait()
            c.div_(world)  # the leaders' sum of host sums / W is the mean
            crossing.append(leaders.all_reduce(c, op="sum", tag=inter))
        back = []
        for c, h in zip(chunks, crossing):
            h.wait()
            back.append(local.broadcast(c, src=0, tag=intra))
        for h in back:
            h.wait()
        self.inner._count([flat], flat.numel() * flat.element_size())

    def _leaders_mean(self, flat: torch.Tensor, like: Sequence[torch.Tensor], names: Sequence[str],
                      leaders: Group, topo: Topology, tag: str,
                      residuals: Sequence[torch.Tensor] | None) -> None:
        """On a leader: turn the host sum in ``flat`` into the global mean."""
        hosts, world = topo.num_hosts, topo.world_size
        if hosts == 1:
            flat.div_(world)
            return
        flat.mul_(hosts / world)  # the leaders' mean of these is the mean over all ranks
        views = flat_views(flat, like)
        if residuals is not None and isinstance(self.inner, LossyCodec):
            self.inner.mean_with_residual(views, names, leaders, tag, residuals)
            torch._foreach_mul_(list(residuals), world / hosts)
        else:
            self.inner.mean(views, names, leaders, tag)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.inner.load_state_dict(state["inner"])

    def rollback_state(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self.inner.rollback_state()}

    def newcomer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        # The leaders' codec: a newcomer healed from a leader must not inherit its error feedback.
        return {**state, "inner": self.inner.newcomer_state(state["inner"])}

    def stats(self) -> dict[str, Any]:  # type: ignore[override]
        return {**super().stats(), "inner": self.inner.stats()}




def reduction_codec(group: Group, codec: Codec | None, hierarchical: bool | None,
                    per_quorum: bool = False) -> tuple[Codec | None, Topology | None]:
    """The codec a gradient reduction over ``group`` should use, and the topology if it was discovered.

    ``hierarchical=None`` chooses a two-level reduction when the ranks span
    several hosts and some host holds several ranks; ``True`` forces it,
    ``False`` never. A :class:`Hierarchical` ``codec`` is used as given.
    ``None`` as the codec means the caller's own exact all-reduce.
    Collective on a static group (it may all-gather host identities and make
    subgroups); none on an elastic group, whose layout is known only per
    quorum: there ``None`` is flat, unless ``per_quorum`` (the caller then
    makes the choice at each quorum, see :attr:`Hierarchical.automatic`:
    the exact two-level codec is returned, marked automatic).

    Example::

        codec, topo = reduction_codec(group, None, hierarchical=None)   # Hierarchical(Identity()) or None
    """
    if hierarchical is not None and not isinstance(hierarchical, bool):
        raise ConfigError(f"hierarchical must be True, False or None (automatic), got {hierarchical!r}")
    if isinstance(codec, Hierarchical):
        if hierarchical is False:
            raise ConfigError("codec is a Hierarchical codec but hierarchical=False; pass its inner codec instead")
        codec.attach(group)
        return codec, codec.current_topology(group)
    changing = not members_fixed(group)
    if hierarchical is False or (group.size == 1 and not changing):
        return codec, None
    if changing:    # no collective: the layout is the quorum's, known at each step
        if hierarchical is None and (codec is not None or not per_quorum):
            return codec, None
        two_level = Hierarchical(codec)
        two_level.automatic = hierarchical is None
        two_level.attach(group)
        return two_level, None
    topology = discover(group)
    if hierarchical is None and not topology.is_hierarchical():
        return codec, topology
    two_level = Hierarchical(codec)
    two_level.setup(group, topology)
    return two_level, topology
