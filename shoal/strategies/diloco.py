"""DiLoCo (C5): H local steps of the inner optimizer, then an outer step on the averaged pseudo-gradient.

Each round starts from the *global* parameters ``g`` (kept as a flat fp32
copy, in host memory when the model is on a GPU). After ``inner_steps`` steps
of the user's (inner) optimizer, every rank computes the pseudo-gradient
``g - local``, the codec averages it over the group, the outer optimizer
steps ``g`` with it as the gradient, and the model restarts from the new
``g``. The inner optimizer's state stays local.

The machinery is written for fragments (:class:`shoal.StreamingDiLoCo`):
parameter subsets whose rounds are staggered and whose reduction may run on a
communication thread for ``overlap_steps`` inner steps; plain DiLoCo is one
fragment with no overlap.
"""

from __future__ import annotations

from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from shoal.codecs.base import Codec
from shoal.codecs.identity import Identity
from shoal.comm.asks import step_ends_at_vote
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.flat import flat_views
from shoal.comm.streams import SideStream
from shoal.comm.group import Group
from shoal.comm.rules import whole_quorum
from shoal.errors import ConfigError, ShoalError
from shoal.strategies.base import Strategy
from shoal.strategies.diloco_heal import (admission_due, enable_background_heal, enter_between_rounds, save_seed,
                                          train_before_admission)
from shoal.strategies.diloco_state import (checkpoint, load_checkpoint, load_outer, load_pending, load_schedule,
                                           outer_state, pending_state, schedule_state)
from shoal.strategies.rounds import Round, Rounds

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum 0.9 and lr 0.7: the DiLoCo paper's outer optimizer."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class DiLoCoConfig:
    """What DiLoCo and streaming DiLoCo are configured with (validated here).

    Attributes:
        inner_steps: H, inner steps per round of each fragment.
        outer_optimizer: builds the outer optimizer from a list of fp32 tensors.
        fragments: number of parameter fragments synchronised at staggered steps.
        overlap_steps: inner steps a fragment's reduction runs in the background
            before it is merged (0: blocking, plain DiLoCo).
        mixing: weight of the local parameters when a fragment is merged
            (``local <- mixing * local + (1 - mixing) * global``).
        merge: ``"mix"`` (the rule above) or ``"carry"``: the merged
            fragment is the new global copy plus the inner progress made
            since the launch (``local <- global + (local - local at launch)``),
            so no overlapped inner step is lost or counted twice; needs
            ``overlap_steps >= 1`` and ``mixing == 0``.
        layout: ``"sequential"`` (contiguous fragments of about equal size) or
            ``"strided"`` (parameter ``i`` in fragment ``i % fragments``).
        offload: keep global parameters and outer state in host memory
            (``None``: when the model is on a GPU).
    """

    inner_steps: int
    outer_optimizer: OuterOptimizerFactory = default_outer_optimizer
    fragments: int = 1
    overlap_steps: int = 0
    mixing: float = 0.0
    layout: str = "sequential"
    offload: bool | None = None
    merge: str = "mix"

    def __post_init__(self) -> None:
        for name in ("inner_steps", "fragments", "overlap_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an int, got {v!r}")
        if self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be >= 1 (local steps per round), got {self.inner_steps}")
        if not 1 <= self.fragments <= self.inner_steps:
            raise ConfigError(
                f"fragments must be between 1 and inner_steps={self.inner_steps} (each fragment needs its "
                f"own step in the round), got {self.fragments}"
            )
        if not 0 <= self.overlap_steps < self.inner_steps:
            raise ConfigError(
                f"overlap_steps must be in [0, inner_steps={self.inner_steps}): a fragment's reduction must "
                f"be merged before its next round starts, got {self.overlap_steps}"
            )
        if not 0.0 <= self.mixing < 1.0:
            raise ConfigError(f"mixing must be in [0, 1) (weight of the local parameters), got {self.mixing}")
        if self.merge not in ("mix", "carry"):
            raise ConfigError(f"merge must be 'mix' or 'carry', got {self.merge!r}")
        if self.merge == "carry" and (self.overlap_steps < 1 or self.mixing != 0.0):
            raise ConfigError(
                "merge='carry' keeps the inner progress made while a reduction is in flight: it needs "
                f"overlap_steps >= 1 and mixing == 0, got overlap_steps={self.overlap_steps}, mixing={self.mixing}"
            )
        if self.layout not in ("sequential", "strided"):
            raise ConfigError(f"layout must be 'sequential' or 'strided', got {self.layout!r}")
        if not callable(self.outer_optimizer):
            raise ConfigError("outer_optimizer must be a callable building an optimizer from a list of tensors")

    def launch_offset(self, fragment: int) -> int:
        """Fragment ``fragment`` launches after steps ``s`` with ``s % inner_steps`` equal to this.

        >>> [DiLoCoConfig(inner_steps=12, fragments=3).launch_offset(p) for p in range(3)]
        [4, 8, 0]
        """
        return (fragment + 1) * self.inner_steps // self.fragments % self.inner_steps


def split_fragments(sizes: Sequence[int], n: int, layout: str, modules: Sequence[str] | None = None) -> list[list[int]]:
    """Indices of parameters per fragment; every fragment non-empty.

    ``sequential``: contiguous runs of about ``sum(sizes) / n`` elements.
    ``strided``: whole modules (``modules[i]`` names parameter ``i``'s module)
    dealt round-robin, so each fragment spans the depth of the model (per
    parameter when there are fewer modules than fragments).

    >>> split_fragments([4, 4, 4, 4], 2, "sequential")
    [[0, 1], [2, 3]]
    >>> split_fragments([4, 1, 4, 1, 4, 1], 2, "strided", ["a", "a", "b", "b", "c", "c"])
    [[0, 1, 4, 5], [2, 3]]
    """
    if n > len(sizes):
        raise ConfigError(f"cannot split {len(sizes)} parameter tensors into {n} non-empty fragments")
    out: list[list[int]] = [[] for _ in range(n)]
    if layout == "strided":
        units = list(modules) if modules is not None else [str(i) for i in range(len(sizes))]
        order = list(dict.fromkeys(units))
        if len(order) < n:
            order, units = [str(i) for i in range(len(sizes))], [str(i) for i in range(len(sizes))]
        where = {u: j % n for j, u in enumerate(order)}
        for i, u in enumerate(units):
            out[where[u]].append(i)
        return out
    total, acc, k = sum(sizes), 0, 0
    for i, size in enumerate(sizes):
        left = len(sizes) - i  # parameters not placed yet, this one included
        # Move on when this parameter's midpoint lies past the fragment's share, or to keep later fragments non-empty.
        if out[k] and k < n - 1 and (acc + size / 2 > (k + 1) * total / n or left == n - 1 - k):
            k += 1
        out[k].append(i)
        acc += size
    return out


class _Fragment:
    """One fragment's global copy, outer optimizer, pseudo-gradient buffer and in-flight reduction."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], offset: int,
                 offload: bool, factory: OuterOptimizerFactory, carry: bool = False) -> None:
        self.index, self.params, self.names, self.offset = index, params, names, offset
        device = params[0].device
        shapes = [p.shape for p in params]
        numel = sum(p.numel() for p in params)
        host = offload and device.type != "cpu"
        pin = host and torch.cuda.is_available()
        where = torch.device("cpu") if host else device
        self.snapshot = torch.empty(numel, dtype=torch.float32, device=where, pin_memory=pin)
        self.delta = torch.empty(numel, dtype=torch.float32, device=device)
        self.global_views = flat_views(self.snapshot, shapes)
        self.delta_views = flat_views(self.delta, shapes)
        # The outer gradient: the averaged pseudo-gradient, where the global copy lives.
        self.grad = self.delta if not host else torch.empty(numel, dtype=torch.float32, device="cpu", pin_memory=pin)
        for g, v in zip(self.global_views, flat_views(self.grad, shapes)):
            g.grad = v
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1).float() for p in params], out=self.delta)
            self.snapshot.copy_(self.delta)
        self.outer = factory(self.global_views)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ConfigError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.outer).__name__}")
        # merge="carry": the local parameters when the pending reduction started (the inner progress since then
        # is carried over the merge); on the parameters' device, fp32.
        self.launched = self.delta.clone() if carry else None
        self.launched_views = flat_views(self.launched, shapes) if self.launched is not None else []
        self.future: ThreadFuture | None = None
        self.merge_at: int | None = None
        self.redo = False   # a failed landing: the next attempt reduces in the foreground


class DiLoCo(Strategy):
    """DiLoCo: ``inner_steps`` local steps, then an outer step on the averaged pseudo-gradient (C5).

    Args:
        inner_steps: H, local steps per round (100 to 500 in the paper).
        outer_optimizer: factory ``list[Tensor] -> Optimizer`` for the outer
            optimizer (default: SGD, lr 0.7, momentum 0.9, Nesterov).
        codec: how the pseudo-gradient travels (default exact;
            ``shoal.codecs.Cast()`` or ``Int8Blockwise()`` cut bytes 2x / ~4x).
        offload: keep the global copy and outer state in host memory (default:
            when the model is on a GPU).

    :func:`shoal.wrap` returns the module itself (parameters and buffers
    broadcast from rank 0). Meter tag: ``diloco/pseudograd``. The outer
    optimizer's, the codec's and the global copy's state are in
    :meth:`state_dict` (also inside the wrapped optimizer's ``state_dict()``).

    Each synchronisation is a round (:class:`~shoal.strategies.rounds.Rounds`).
    On an :class:`~shoal.elastic.ElasticGroup` a failed one is run again with
    the survivors of the next quorum, the pseudo-gradient mean divides by the
    live contributors, and global copies, outer optimizer state, counters,
    codec state and the module's buffers heal into newcomers, whose
    parameters are rebuilt from the healed global copies (not sent twice).
    A member lost during the inner steps is seen by the group's peer watch
    (:mod:`shoal.membership.watch`) and left out before the next round (with
    overlapped reductions: the next launch), which then runs once (docs/elastic.md).
    The inner optimizer's state stays each worker's own, as in the paper (a
    newcomer starts from a peer's; background heal: docs/elastic.md).

    NaN/Inf (SPEC G5): an inner step with non-finite gradients is skipped by
    that rank alone; a non-finite averaged pseudo-gradient (the same on every
    rank) skips the outer step on every rank, which restart from the
    unchanged global copy. Both count in ``comm_stats().total.nonfinite_skips``.

    Example::

        model, opt = shoal.wrap(model, torch.optim.AdamW(model.parameters(), lr=4e-4),
                                shoal.DiLoCo(inner_steps=100, codec=shoal.codecs.Cast()))
        for x, y in data:                      # unchanged training loop
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()        # every 100th step also runs the outer step
    """

    name = "diloco"

    def __init__(self, inner_steps: int, outer_optimizer: OuterOptimizerFactory = default_outer_optimizer,
                 codec: Codec | None = None, offload: bool | None = None) -> None:
        self._init(DiLoCoConfig(inner_steps, outer_optimizer, offload=offload), codec)

    def _init(self, config: DiLoCoConfig, codec: Codec | None) -> None:
        super().__init__()
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a shoal.codecs.Codec, got {type(codec).__name__}")
        self.config = config
        self.codec: Codec = codec if codec is not None else Identity()
        self.step = 0
        self.trained_steps = 0   # inner steps this process ran (never loaded: a heal moves step, not this)
        # Outer steps this process's parameters have taken in (merged, or reset to the global copy after a
        # skipped one, or healed from the peers'): 0 means its model is still its own replica.
        self.merged_rounds = 0
        self.fragments: list[_Fragment] = []
        self._thread: ThreadPoolExecutor | None = None
        self._side = SideStream(torch.device("cpu"))   # replaced by the parameters' device's with the thread
        self._comm_group: Any = None
        self.rounds: Rounds | None = None
        self._rounds: list[tuple[Round, Round]] = []   # each fragment's (fragment:<k>, merge:<k>)
        self._unadmitted = False   # a joiner training from the survivors' state before its admission

    @property
    def tag(self) -> str:
        return f"{self.name}/pseudograd"

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        self._bind(model, optimizer, group)
        for n, p in zip(self.names, self.params):   # the global copies and outer state are fp32
            if p.is_complex():
                raise TypeError(f"{self.name}: parameter {n!r} is {p.dtype}; DiLoCo keeps real fp32 global "
                                "copies: train complex parameters as real pairs (torch.view_as_real) or use Sync")
        cfg = self.config
        offload = cfg.offload if cfg.offload is not None else self.params[0].device.type == "cuda"
        # Background reductions get a process group of their own: a collective the training thread
        # issues meanwhile (a logged loss, an evaluation) must not interleave with them differently on
        # different ranks.
        self._comm_group = group.subgroup(whole_quorum, f"{self.name}/background") if cfg.overlap_steps > 0 else group
        modules = [n.rsplit(".", 1)[0] if "." in n else "" for n in self.names]
        layout = split_fragments([p.numel() for p in self.params], cfg.fragments, cfg.layout, modules)
        self.fragments = [
            _Fragment(k, [self.params[i] for i in idx], [self.names[i] for i in idx], cfg.launch_offset(k),
                      offload, cfg.outer_optimizer, carry=cfg.merge == "carry")
            for k, idx in enumerate(layout)
        ]
        # Every synchronisation is a round. A newcomer heals the global copies, outer state, inner
        # optimizer, codec and the module's buffers; its parameters are rebuilt from the global copies
        # (they are a peer's local drift otherwise, which it would count twice): not sent.
        self.rounds = Rounds(group, self.name, background=True)
        self._rounds = [self._fragment_rounds(self.rounds, f) for f in self.fragments]
        self.rounds.register(None, optimizer, self.codec, lambda: outer_state(self), self._heal_outer)
        key = self.rounds.key   # the parts a background heal moves at different times: diloco_state
        group.register_state(f"{key}/buffers", self._buffers, self._load_buffers)
        group.register_state(f"{key}/schedule", lambda: schedule_state(self), lambda s: load_schedule(self, s))
        group.register_state(f"{key}/pending", lambda: pending_state(self), lambda s: load_pending(self, s))
        enable_background_heal(self, group, optimizer)   # SHOAL_HEAL=background: shoal.strategies.diloco_heal
        group.watch_peers()   # a member lost during the inner steps is left out before the round: _renew
        group.before_begin_step(self._settle)
        # A worker joining a run in progress that already holds the survivors' state trains until their next round,
        # which admits it and takes those inner steps (shoal.membership.preadmit); else it waits for that round here.
        self._unadmitted = train_before_admission(self)
        if not self._unadmitted:
            self.rounds.join(self._first_state)
            save_seed(self)   # the module is the global copies now: the host's copy (and its progress) count from here
        self._mark_step()  # the set-up traffic is not the first step's
        return model

    def _first_state(self) -> None:
        """The start: rank 0's module everywhere (static; elastic: the first heal), the global copies made from it."""
        if self.module is None or self.group is None:  # pragma: no cover - bound in setup
            raise ShoalError("not set up")
        self.group.start_state(self.module, tag=f"{self.name}/init")
        with torch.no_grad():
            for f in self.fragments:
                torch.cat([p.detach().reshape(-1).float() for p in f.params], out=f.delta)
                f.snapshot.copy_(f.delta)
                if f.launched is not None:
                    f.launched.copy_(f.delta)

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The module's state that no global copy holds (buffers, frozen parameters)."""
        if self.module is None:  # pragma: no cover - bound in setup
            return {}
        trained = {id(p) for p in self.params}
        return {k: v.detach() for k, v in self.module.state_dict(keep_vars=True).items() if id(v) not in trained}

    def _load_buffers(self, state: Mapping[str, torch.Tensor]) -> None:
        if self.module is not None:
            self.module.load_state_dict(dict(state), strict=False)

    def after_step(self) -> None:
        if not self.fragments or self.rounds is None:
            raise ShoalError(f"{type(self).__name__} is not set up: use shoal.wrap(model, optimizer, strategy)")
        self.step += 1
        self.trained_steps += 1
        if self._unadmitted:   # trained from the survivors' state before its admission
            if admission_due(self):   # they wait at their round's barrier: it admits this worker and takes its steps
                self._unadmitted = False
                self.rounds.join(lambda: None)   # (its global copies are the survivors': not made from the module)
                save_seed(self)
            self._mark_step()
            return
        enter_between_rounds(self)   # a joiner whose background download finished starts from the global copies
        for f in self.fragments:
            if self.step % self.config.inner_steps == f.offset:
                if self.config.overlap_steps == 0:
                    self._renew()
                    self.rounds.run(self._rounds[f.index][0])
                elif self._renew():   # no quorum to launch on: the landing round reduces over the survivors
                    f.merge_at, f.redo = self.step + self.config.overlap_steps, True
                else:
                    self._launch(f)
        for f in self.fragments:
            if f.merge_at == self.step:
                self._merge_round(f)
        save_seed(self)   # a round applied just now: this host's copy for this worker's next life
        self._mark_step()

    def _renew(self) -> bool:
        """Before a round or a launch: a quorum dissolved during the inner steps (a member lost: its abort flag,
        raised by the peer watch or the coordinator) is left now (True), so the round runs once over the
        survivors' quorum instead of failing and running again (docs/elastic.md). A launch after a renewal
        starts nothing (only a round adopts the next quorum): its landing round reduces in the foreground,
        as the retry of a failed landing does, which is what a member that missed the flag runs after its
        landing failed. Not while a launched reduction is in flight: it runs on the quorum it was launched in."""
        if self.group is None or any(f.future is not None and not f.future.done() for f in self.fragments):
            return False
        return self.group.renew_if_dissolved()

    def _merge_round(self, f: _Fragment) -> None:
        """The round in which a background reduction lands: voted, then merged (or dropped, given up)."""
        if self.rounds is not None and not self.rounds.run(self._rounds[f.index][1]):
            f.merge_at, f.redo = None, False   # given up on every member alike: local parameters kept

    def _settle(self) -> None:
        """Before every round on an elastic group: let the background reductions in flight land.

        They run over the quorum they were launched in, which adopting another
        would cut; and the round's begin_step snapshots the codec for its
        rollback, which must not race a background ``codec.mean`` (a discard
        would restore over its update on some members only). A fragment whose
        launch shares a step with another's merge round therefore loses its
        overlap on an elastic group. Never on a static group: its quorum does
        not change and nothing rolls back.
        """
        if self.group is not None and step_ends_at_vote(self.group):
            for f in self.fragments:
                self._land(f)

    def _land(self, f: _Fragment) -> None:
        if f.future is not None:
            _, done = f.future.result()
            f.future = None
            self._side.join(done)   # CUDA: this stream reads the mean only once it is written

    # --- one fragment's round ----------------------------------------------
    @torch.no_grad()
    def _pseudo_gradient(self, f: _Fragment) -> None:
        """``global - local`` into ``f.delta``; merge="carry": the local parameters into ``f.launched`` too
        (what the merge carries is the progress from here on)."""
        f.delta.copy_(f.snapshot, non_blocking=True)
        local = [p.detach() for p in f.params]
        torch._foreach_sub_(f.delta_views, local)
        if f.launched is not None:
            torch._foreach_copy_(f.launched_views, local)

    def _launch(self, f: _Fragment) -> None:
        """Pseudo-gradient into ``f.delta``; start its reduction on the communication thread."""
        if f.merge_at is not None:  # pragma: no cover - overlap_steps < inner_steps prevents it
            raise ShoalError(f"fragment {f.index} launched while its previous reduction is pending")
        self._pseudo_gradient(f)
        f.merge_at = self.step + self.config.overlap_steps
        # A joiner still catching up in the background counts zero (the same answer on every member between
        # two rounds: shoal.membership.catchup reads its record at each commit).
        mine, live = self.group.contribution() if self.group is not None else (True, 1)
        n = self._comm_group.size if self._comm_group is not None else 1
        if not mine:
            f.delta.zero_()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-diloco")
            self._side = SideStream(f.delta.device)   # CUDA: the thread's own stream, events both ways
        side = self._side
        scale = n / live if 0 < live < n else 1.0
        f.future = self._thread.submit(side.run, side.ready(), lambda: self._reduce(f, scale))

    def _reduce(self, f: _Fragment, scale: float = 1.0) -> None:
        with torch.no_grad():
            self.codec.mean(f.delta_views, f.names, self._comm_group, self.tag)
            if scale != 1.0:   # the mean over the contributors
                f.delta.mul_(scale)

    @torch.no_grad()
    def _merge(self, f: _Fragment) -> None:
        """Outer step on the averaged pseudo-gradient; local parameters move to (or toward) the result."""
        self._land(f)
        f.merge_at, f.redo = None, False
        self.merged_rounds += 1
        if read_flag(nonfinite_flag([f.delta])):
            # The mean is the same on every rank: all skip the outer step and restart from the
            # unchanged global copy, so no NaN reaches the global copy, the outer state or a model.
            self._count_nonfinite("pseudo-gradient", f"fragment {f.index}'s outer step skipped, local "
                                  "parameters reset to the global copy")
            self._reset_to_global(f)
            return
        if f.grad is not f.delta:
            f.grad.copy_(f.delta)
        f.outer.step()
        target = f.global_views
        if f.snapshot.device != f.delta.device:
            f.delta.copy_(f.snapshot, non_blocking=True)
            target = f.delta_views
        if f.launched is not None:   # merge="carry": local <- global + (local - local at launch)
            # In fp32 and in this order: no progress since the launch gives exactly the new global copy.
            for p, g, at in zip(f.params, target, f.launched_views):
                p.copy_(g + (p.float() - at))
            return
        alpha = self.config.mixing
        for p, g in zip(f.params, target):
            if alpha == 0.0:
                p.copy_(g)
            else:
                p.lerp_(g.to(p.dtype), 1.0 - alpha)

    @torch.no_grad()
    def _reset_to_global(self, f: _Fragment) -> None:
        """Local parameters <- the global copy (merge="carry": the progress a pending merge carries starts here)."""
        target = f.global_views
        if f.snapshot.device != f.delta.device:
            f.delta.copy_(f.snapshot, non_blocking=True)
            target = f.delta_views
        torch._foreach_copy_([p.detach() for p in f.params], target)
        if f.launched is not None:
            torch._foreach_copy_(f.launched_views, target)

    # --- rounds ----------------------------------------------------------------------
    def _fragment_rounds(self, rounds: Rounds, f: _Fragment) -> tuple[Round, Round]:
        """Fragment ``k``'s two rounds: ``fragment:<k>`` (reduce now) and ``merge:<k>`` (a launched one lands).

        Both merge the mean once they commit. Their names travel with the
        healed state: a newcomer runs the round its peers are in.
        """
        now = Round(f"fragment:{f.index}", reduce=lambda live: self._reduce_now(f), apply=lambda: self._merge(f))
        land = Round(f"merge:{f.index}", reduce=lambda live: self._reduce_landing(f), apply=lambda: self._merge(f))
        return rounds.add(now), rounds.add(land)

    def _reduce_now(self, f: _Fragment) -> None:
        """``fragment:<k>``: the pseudo-gradient averaged over the live contributors, now."""
        if self.rounds is None:  # pragma: no cover - setup made them
            return
        self._pseudo_gradient(f)
        # Resumable: a member lost mid-round costs the survivors the chunk in flight, not the round (exact mean).
        self.rounds.mean(f.delta_views, f.names, self.codec, self.tag, resumable=True)

    def _reduce_landing(self, f: _Fragment) -> None:
        """``merge:<k>``: the background reduction lands (on an elastic group every member checks that all
        hold the same mean); an attempt after a failed one reduces in the foreground instead, with the
        pseudo-gradient of the current parameters (the launch's was overwritten by the failed mean).
        """
        if f.redo:
            self._reduce_now(f)
            return
        self._land(f)
        f.redo = True   # until this round commits: a retry reduces in the foreground
        if self.group is not None and step_ends_at_vote(self.group):
            self._check_landed(f, self.group)

    def _check_landed(self, f: _Fragment, group: Any) -> None:   # an elastic group (report_error)
        """Fail the round unless every member holds the same mean (bit patterns of two fp64 sums).

        An elastic collective that fails records the failure instead of
        raising, and a background reduction's failure may be recorded in
        another step than the one that lands it: this check makes it this
        round's. A static group's collectives raise on failure: nothing to check.
        """
        if group.size == 1:
            return
        d = f.delta.double()
        mine = torch.stack([d.sum(), (d * d).sum()]).view(torch.int64)
        table = torch.empty(2 * group.size, dtype=torch.int64, device=mine.device)
        group.all_gather_into(table, mine, tag=f"{self.tag}/landed").wait()
        if not bool((table.view(-1, 2) == mine).all()):   # read after the collective
            group.report_error(ShoalError(f"fragment {f.index}'s background reduction did not land alike on "
                                          "every member"))

    def wait_in_flight(self) -> None:
        """Wait until every reduction in flight has landed, without merging it: each still merges at its own
        step, so training computes what it would have (a benchmark calls this before it stops its clock). A
        reduction that failed raises here."""
        for f in self.fragments:
            self._land(f)

    def close(self) -> None:
        """Merge every reduction still in flight now (a round each) and stop the communication thread."""
        for f in self.fragments:
            if f.merge_at is not None:
                self._merge_round(f)
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    # --- checkpoints (shoal.strategies.diloco_state) --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, global copies, outer optimizers, codec, and finished-but-unmerged reductions.

        A reduction still in flight is waited for, so that a run resumed from
        this state merges it at the same step, with the same values.
        """
        return checkpoint(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_checkpoint(self, state)

    def _heal_outer(self, state: Mapping[str, Any]) -> None:
        """A newcomer's heal: the peers' global copies, and its parameters rebuilt from them."""
        load_outer(self, state)
        self.merged_rounds += 1
        for f in self.fragments:
            self._reset_to_global(f)
