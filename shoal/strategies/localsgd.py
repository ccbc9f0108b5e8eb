"""Local SGD: train locally, average parameters periodically (C1), after a synchronous warm-up (C2).

:class:`LocalSGD` is torch's ``PeriodicModelAverager`` as a strategy;
:class:`PostLocalSGD` is torch's ``post_localSGD_hook`` with
``PostLocalSGDOptimizer``: gradients all-reduced every step during warm-up,
then local steps (optionally still averaging gradients inside groups of
consecutive ranks, e.g. a host) with periodic parameter averaging.
"""

from __future__ import annotations

import abc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from shoal.averagers import Hierarchy, Levels, ModelAverager, Periodic, PeriodicModelAverager, check_slot
from shoal.codecs.base import Codec
from shoal.codecs.identity import Identity
from shoal.comm.asks import members_fixed
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.group import Group
from shoal.comm.rules import by_slot
from shoal.errors import ConfigError, ShoalError
from shoal.parallel import DistributedDataParallel
from shoal.reducer import GradBucket
from shoal.strategies.base import Strategy, check_state_keys, optimizer_state_tensors
from shoal.strategies.rounds import FailurePolicy, Round, Rounds


@dataclass
class _Scratch:
    """One round's own state from its ``reduce`` to its ``apply`` (empty outside a round).

    ``live`` are the tensors the mean replaces (the parameters and chosen
    optimizer state, or the gradients), ``mean`` their mean over ``group``
    (the scratch the collectives wrote), ``finite`` a parameter round's count
    of contributors whose parameters were finite (read once it committed).
    """

    live: list[torch.Tensor] = field(default_factory=list)
    mean: list[torch.Tensor] = field(default_factory=list)
    group: Group | None = None
    finite: torch.Tensor | None = None
    ready: bool = False

    def fill(self, live: list[torch.Tensor], mean: list[torch.Tensor], group: Group,
             finite: torch.Tensor | None = None) -> None:
        self.live, self.mean, self.group, self.finite, self.ready = live, mean, group, finite, True

    def clear(self) -> None:
        """Forget the round's tensors (applied, or its attempt discarded)."""
        self.live, self.mean, self.group, self.finite, self.ready = [], [], None, None, False


class AveragingStrategy(Strategy):
    """Local training with parameters averaged by an averager after each step (shared base).

    Subclasses build the averager in :meth:`_make_averager`. When
    ``average_optimizer_state`` is set, the optimizer's per-parameter state
    (C4) is averaged with the parameters, over the same group at the same
    steps.

    Every averaging is a round (:class:`~shoal.strategies.rounds.Rounds`,
    ``AVERAGE_SURVIVORS``): the mean is taken into a scratch copy (one copy
    per averaging) and copied back when the round commits, which on a static
    group it always does. On an :class:`~shoal.elastic.ElasticGroup` a
    failed round is run again with the survivors of the next quorum, and the
    average divides by the live contributors; local steps need no vote. A
    member lost during the local steps is seen by the group's peer watch
    (:mod:`shoal.membership.watch`) and left out before the next averaging,
    which then runs once: the kill discards no round (docs/elastic.md).

    NaN/Inf (SPEC G5): a rank whose gradients are non-finite skips its own
    optimizer update (together with its group where gradients are averaged);
    a member whose parameters are non-finite is left out of an average and
    receives the finite members' mean (as :func:`shoal.averagers.finite_mean`).
    Each counts in ``comm_stats().total.nonfinite_skips``; see
    docs/averaging.md.
    """

    def __init__(self, codec: Codec | None, average_optimizer_state: bool | Sequence[str]) -> None:
        super().__init__()
        if codec is not None and not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a shoal.codecs.Codec, got {type(codec).__name__}")
        self.codec = codec
        self.average_optimizer_state = check_state_keys(average_optimizer_state)
        self.averager: ModelAverager | None = None
        self.rounds: Rounds | None = None
        self._rounds: dict[str, Round] = {}   # by name (see _make_rounds)
        self.local_group: Any = None   # post-local SGD's gradient groups after warm-up, if any
        self._grad_codec = Identity()  # post-local SGD's warm-up gradients travel exact, as in its DDP

    @abc.abstractmethod
    def _make_averager(self, group: Group) -> ModelAverager:
        """The averager that runs this strategy's schedule over ``group``."""

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        self._bind(model, optimizer, group)
        return self._start(model, model)

    def _start(self, returned: nn.Module, module: nn.Module, first: Callable[[], None] | None = None) -> nn.Module:
        """Averager and rounds; the first round gives everyone rank 0's state (a heal, or ``first()``)."""
        if self.optimizer is None:  # pragma: no cover - _bind set it
            raise ConfigError("bind the strategy first")
        averager = self.averager = self._quiet_averager(self.group_)

        def load(state: dict[str, Any]) -> None:
            averager.step = int(state["step"])

        self.rounds = Rounds(self.group_, self.name)
        self._rounds = {r.name: self.rounds.add(r) for r in self._make_rounds()}
        self.group_.watch_peers()   # a member lost during the local steps is left out before the averaging
        self.rounds.register(module, self.optimizer, averager.codec, lambda: {"step": averager.step}, load)
        self._finish_joined(self.rounds.join(first))
        self._mark_step()  # the set-up traffic is not the first step's
        return returned

    @property
    def group_(self) -> Group:
        if self.group is None:  # pragma: no cover - _bind set it
            raise ConfigError("bind the strategy first")
        return self.group

    def _finish_joined(self, kind: str) -> None:
        """A newcomer admitted in a round: do what its peers do after that round."""

    def _make_rounds(self) -> list[Round]:
        """``grad``/``local_grad``: a gradient mean (over the group / the local group); ``params``: the
        averaging due after the step just counted (every member of the round holds the same count).

        Each round keeps its own state from its ``reduce`` to its ``apply``
        (a :class:`_Scratch` of its own), so a failed attempt's scratch is
        dropped with the attempt and is never applied by another round.
        """
        grad, local, params = _Scratch(), _Scratch(), _Scratch()
        return [Round("grad", reduce=lambda live: self._reduce_grads(grad, self.group_, "grad"),
                      apply=lambda: self._apply_grads(grad), discard=grad.clear),
                Round("local_grad", reduce=lambda live: self._reduce_grads(local, self.local_group, "local_grad"),
                      apply=lambda: self._apply_grads(local), discard=local.clear),
                Round("params", reduce=lambda live: self._reduce_params(params),
                      apply=lambda: self._apply_params(params), discard=params.clear)]

    def _reduce_grads(self, held: _Scratch, group: Group, kind: str) -> None:
        """The gradients' mean into scratch copies (over the whole group, or the local one)."""
        held.clear()
        if self.rounds is None:  # pragma: no cover - setup made them
            return
        live = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        scratch = [t.detach().clone() for t in live]
        # a non-finite mean is caught by the optimizer step's gradient check
        self.rounds.mean(scratch, list(self.names), self._grad_codec, f"{self.name}/{kind}", group)
        held.fill(live, scratch, group)

    def _reduce_params(self, held: _Scratch) -> None:
        """The parameters' (and chosen optimizer state's) mean into scratch copies, over the level due."""
        held.clear()
        if self.rounds is None or self.optimizer is None or self.averager is None:  # pragma: no cover
            return
        names = list(self.names)
        due = self.averager._group_at(self.averager.step - 1)   # after_step counted the step first
        if due is None:  # pragma: no cover - run only when due
            raise ConfigError(f"no averaging is due after step {self.averager.step - 1}")
        group, tag = due
        live: list[torch.Tensor] = list(self.params)
        if self.average_optimizer_state:
            extra, extra_names = optimizer_state_tensors(self.optimizer, self.params, self.names,
                                                         self.average_optimizer_state)
            live, names = live + extra, names + extra_names
        scratch = [t.detach().clone() for t in live]
        finite, handle = self._finite_count(scratch, group, tag)
        self.rounds.mean(scratch, names, self.averager.codec, tag, group)
        handle.wait()
        held.fill(live, scratch, group, finite)

    def _finite_count(self, scratch: list[torch.Tensor], group: Group, tag: str) -> tuple[torch.Tensor, Any]:
        """Start the count of the round's contributors whose parameters are finite (see :func:`finite_mean`).

        A worker whose parameters hold a NaN/Inf contributes zeros, as a
        newcomer does; :meth:`_apply_params` rescales the mean to the finite
        contributors. The local check is read before the round's collectives.
        Returns the count's tensor (read once the round committed) and its handle.
        """
        bad = read_flag(nonfinite_flag(scratch[:len(self.params)]))
        counts = group.rank not in group.newcomers and not bad
        finite = torch.full((), 1.0 if counts else 0.0, dtype=torch.float32, device=scratch[0].device)
        handle = group.all_reduce(finite, op="sum", tag=f"{tag}/finite")
        if bad:
            torch._foreach_zero_(scratch)
        return finite, handle

    @torch.no_grad()
    def _apply_grads(self, held: _Scratch) -> None:
        """A committed gradient mean becomes the gradients the optimizer steps with."""
        if not held.ready:
            return
        for p, g in zip(self.params, held.mean):
            p.grad = g
        held.clear()

    @torch.no_grad()
    def _apply_params(self, held: _Scratch) -> None:
        """A committed average replaces the parameters (and optimizer state), finite contributors only."""
        if not held.ready or held.group is None or held.finite is None:
            return
        live, scratch, group, finite = held.live, held.mean, held.group, held.finite
        held.clear()
        if self.averager is not None:
            self.averager.last_group = group
        if not self._rescale_finite(group, scratch, finite):
            return
        torch._foreach_copy_(live, scratch)

    def _rescale_finite(self, group: Group, scratch: list[torch.Tensor], count: torch.Tensor) -> bool:
        """Turn a committed mean into the finite contributors' mean; False: none was finite (keep ours)."""
        contributors = group.size - len(group.newcomers)
        finite = int(round(float(count.item())))  # read once the round has committed
        if contributors == 0 or finite == contributors:
            return True
        if self.averager is not None:
            self.averager.last_left_out = contributors - finite
        if finite == 0 and members_fixed(self.group_):
            raise ShoalError(
                f"every one of the {group.size} members averaging under {self.name!r} holds non-finite (NaN/Inf) "
                "parameters: training has diverged on all of them and there is nothing finite to average; lower "
                "the learning rate or restart from a checkpoint")
        if finite > 0:
            torch._foreach_mul_(scratch, contributors / finite)
        self._count_nonfinite("parameters at an averaging",
                              f"{contributors - finite} of {contributors} contributors left out"
                              if finite else "no contributor was finite: the round is not applied")
        return finite > 0

    def _quiet_averager(self, group: Group) -> ModelAverager:
        with warnings.catch_warnings():  # the constructor already warned about this configuration
            warnings.simplefilter("ignore")
            return self._make_averager(group)

    def after_step(self) -> None:
        """Count the step; run the averaging round due after it, if any."""
        if self.averager is None or self.rounds is None:
            raise ConfigError(f"{type(self).__name__} is not set up: use shoal.wrap(model, optimizer, strategy)")
        step = self.averager.step
        self.averager.step += 1
        self.averager.last_group, self.averager.last_left_out = None, 0
        if self.averager._group_at(step) is not None:
            # A quorum dissolved during the local steps (a member lost: the peer watch or the coordinator
            # raised its abort flag) is left first: the averaging then runs once, over the survivors.
            self.group_.renew_if_dissolved()
            self.rounds.run(self._rounds["params"])
        self._mark_step()

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.averager.step if self.averager is not None else 0

    def state_dict(self) -> dict[str, Any]:
        return {"averager": self.averager.state_dict() if self.averager is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.averager is None:
            raise ConfigError(f"load the state of {type(self).__name__} after shoal.wrap (it has no averager yet)")
        self.averager.load_state_dict(state["averager"])


class LocalSGD(AveragingStrategy):
    """Average parameters every ``period`` steps, from step ``warmup_steps`` on (C1).

    The schedule of torch's ``PeriodicModelAverager``: steps count from 0 and
    parameters are averaged after the optimizer step numbered
    ``warmup_steps + k * period``. Nothing is synchronised during warm-up (use
    :class:`PostLocalSGD` to all-reduce gradients then). :func:`shoal.wrap`
    returns the module itself, its parameters and buffers broadcast from rank 0.

    Args:
        period: steps between averagings.
        warmup_steps: steps before the first averaging.
        codec: how parameters travel (default exact; ``shoal.codecs.Cast()`` halves the bytes).
        average_optimizer_state: also average the optimizer's state (``True``:
            every tensor shaped like its parameter; or keys such as ``("exp_avg",)``).

    Example::

        model, opt = shoal.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                shoal.LocalSGD(period=8))
    """

    name = "localsgd"

    def __init__(self, period: int, warmup_steps: int = 0, codec: Codec | None = None,
                 average_optimizer_state: bool | Sequence[str] = False) -> None:
        super().__init__(codec, average_optimizer_state)
        self.schedule = Periodic(period, warmup_steps)

    def _make_averager(self, group: Group) -> ModelAverager:
        return PeriodicModelAverager(self.schedule.period, self.schedule.warmup_steps, group, self.codec)


class PostLocalSGD(AveragingStrategy):
    """Post-local SGD (C2): synchronous gradient averaging for ``warmup_steps``, then local SGD.

    During the first ``warmup_steps`` optimizer steps gradients are averaged
    over the whole group during backward (shoal's DDP). After that, gradients
    stay local, or are averaged inside groups of ``local_group_size``
    consecutive ranks (set it to the ranks per host to keep the fast links
    busy), and parameters are averaged over everyone on the schedule of
    ``period``: an int (as torch's ``PeriodicModelAverager``, first at step
    ``warmup_steps``) or a ``{period: group_size}`` map (as torch's
    ``HierarchicalModelAverager``). Equals torch's ``post_localSGD_hook`` with
    ``PostLocalSGDOptimizer``. :func:`shoal.wrap` returns a
    :class:`shoal.DistributedDataParallel` (on an
    :class:`~shoal.elastic.ElasticGroup`: the module itself; the step's
    gradient mean, over everyone in warm-up and inside the local group after
    it, is then a round at ``optimizer.step()``, the local one ``DISCARD``;
    local groups and a ``{period: size}`` map's levels are groups of launch
    ``RANK``, ``group.subgroup(by_slot(size))``, as :class:`shoal.Hierarchical`
    does there).

    Example::

        model, opt = shoal.wrap(model, opt, shoal.PostLocalSGD(period=4, warmup_steps=100,
                                                               local_group_size=8))
    """

    name = "postlocalsgd"

    def __init__(self, period: int | Mapping[int, int], warmup_steps: int = 0, codec: Codec | None = None,
                 local_group_size: int | None = None, average_optimizer_state: bool | Sequence[str] = False,
                 bucket_cap_mb: float = 25.0) -> None:
        super().__init__(codec, average_optimizer_state)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if local_group_size is not None and (isinstance(local_group_size, bool)
                                             or not isinstance(local_group_size, int) or local_group_size < 1):
            raise ConfigError(f"local_group_size must be None or an int >= 1, got {local_group_size!r}")
        if not isinstance(period, Mapping):
            Periodic(period, warmup_steps)  # validate now, not at setup
        self.period = period
        self.warmup_steps = warmup_steps
        self.local_group_size = local_group_size
        self.bucket_cap_mb = bucket_cap_mb
        self._in_ddp = False   # gradient means in DDP's comm hook (static groups), else in rounds

    def _make_averager(self, group: Group) -> ModelAverager:
        if isinstance(self.period, Mapping):
            return Levels(Hierarchy.from_dict(self.period, self.warmup_steps), group, self.codec, "PostLocalSGD")
        return PeriodicModelAverager(self.period, self.warmup_steps, group, self.codec)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        self._bind(model, optimizer, group)
        size = self.local_group_size
        if size is not None:
            if group.traits.members_change:
                check_slot("PostLocalSGD with local_group_size")
            elif group.size % size:
                raise ConfigError(f"local_group_size {size} does not divide the {group.size} ranks")
            self.local_group = group.subgroup(by_slot(size), f"{self.name}/local")
        if not members_fixed(group):
            # DDP's comm hooks cannot run on an elastic group: gradient means are rounds at opt.step().
            return self._start(model, model)
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=self.bucket_cap_mb)
        ddp.register_comm_hook(self, _post_local_hook)
        self._in_ddp = True
        return self._start(ddp, model, first=lambda: None)   # DDP broadcast rank 0's module

    def before_step(self) -> bool | None:
        """Without DDP (an elastic group) the step's gradient mean is a round here (skipped if it fails)."""
        if self._in_ddp or self.rounds is None:
            return None
        # (a newcomer is admitted at the next round, not between the mean and the optimizer step)
        if self.step >= self.warmup_steps and self.local_group is None:
            return None
        # A quorum dissolved since the last step is left first. A member that missed its flag discards this
        # step there and, its step not counted, runs this same step's round next: on the renewed quorum.
        self.group_.renew_if_dissolved()
        if self.step < self.warmup_steps:
            return self.rounds.run(self._rounds["grad"], admit=False)
        return self.rounds.run(self._rounds["local_grad"], FailurePolicy.DISCARD, admit=False)

    def _finish_joined(self, kind: str) -> None:
        if kind in ("grad", "local_grad") and self.optimizer is not None:  # its peers now step with these
            self.optimizer.step()
            self.after_step()

    def gradient_group(self) -> Group | None:
        """The group gradients are averaged over at the current step (``None``: local)."""
        return self.group if self.step < self.warmup_steps else self.local_group


def _post_local_hook(state: PostLocalSGD, bucket: GradBucket) -> torch.futures.Future:
    group = state.gradient_group()
    if group is None:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    tag = "postlocalsgd/grad" if group is state.group else "postlocalsgd/local_grad"
    return group.all_reduce(bucket.buffer(), op="avg", tag=tag).future()
