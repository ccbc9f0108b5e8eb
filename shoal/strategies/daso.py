"""DASO (Heat's Distributed Asynchronous and Selective Optimization, SPEC E2).

Inside each host, gradients are averaged synchronously every step (shoal's
DDP over the host's ranks). Between hosts, only the host leaders talk, and
only every ``global_skips`` steps: each leader sends how far its parameters
moved since the last global agreement, downcast to ``downcast_type`` (bf16 by
default), the leaders average these deltas, and the result lands
``global_skips // 4`` steps later. On landing a host keeps the progress it
made meanwhile: ``params = agreed + (params_now - params_at_launch)``.
During the warm-up and cool-down epochs the global sync happens every step
and is blocking. In between, ``global_skips`` doubles (up to
``max_global_skips``) after every epoch whose world-mean loss stays within
``stability_level`` (relative) of the previous epoch's, and drops back to 1
when the loss moves by more.

Sending deltas rather than parameters (Heat sends the parameters) keeps bf16
rounding off the parameters themselves: a bf16 parameter would swallow
updates smaller than 1/256 of its magnitude. See docs/daso.md.

The schedule, on any group (the step interface, :mod:`shoal.comm.stepping`;
one code path for static and elastic groups):

- **every step** (``FailurePolicy.DISCARD``): DDP over the host subgroup
  (``group.subgroup(by_host)``) averages gradients; ``optimizer.step()`` is
  voted (``group.commit()``: always True on a static group; a failed step is
  dropped on every worker);
- **the epoch's loss** is a round of :class:`~shoal.strategies.rounds.Rounds`
  (``AVERAGE_SURVIVORS``);
- **a global sync** is a round too: every worker takes its host's delta, the
  leaders (``group.subgroup(host_leaders)``) average them, each leader
  broadcasts the mean inside its host; everyone keeps it until the landing
  step, where every worker applies it itself (no collective). On a group
  whose steps cannot fail (static) the leaders' mean runs in the background
  and is waited at the landing, so it overlaps the steps between; an elastic
  group cannot keep a reduction in flight across quorums, so there the round
  waits for it before its vote (the delay then applies to when the result
  lands, not to overlap). A failed round (a leader lost) runs again on the
  next quorum, whose hosts have new leaders; past ``max_attempts`` it is
  skipped;
- **membership** changes only in a round: a quorum waiting to be adopted is
  adopted in an empty round before the next gradient step begins, so a
  newcomer always joins its peers in a round. A member lost between two
  steps is seen by the group's peer watch (:mod:`shoal.membership.watch`);
  the next step first leaves the dissolved quorum and adopts the survivors'
  in that empty round, so a kill costs at most the step in flight. Newcomers receive the run's
  state (module, optimizer, schedule, agreed parameters, pending result),
  then, in the same round, their *host's* state (parameters, buffers,
  optimizer state, parameters at launch) from the lowest-ranked established
  worker of their host. A host whose workers are all new restarts from the
  last agreed parameters and contributes nothing to the round it joined in.
"""

from __future__ import annotations

import math
import warnings
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch
from torch import nn

from shoal.codecs.base import Codec
from shoal.codecs.cast import Cast
from shoal.codecs.identity import Identity
from shoal.comm.asks import members_fixed, step_ends_at_vote
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.flat import flat_views
from shoal.comm.group import Group
from shoal.comm.objects import broadcast_bytes, from_bytes, to_bytes
from shoal.comm.rules import by_host, host_leaders
from shoal.comm.streams import SideStream
from shoal.errors import ConfigError, ShoalError
from shoal.parallel import DistributedDataParallel
from shoal.strategies.base import Strategy
from shoal.strategies.daso_schedule import DASOConfig, DASOSchedule, check_hosts  # noqa: F401 - public here too
from shoal.strategies.rounds import ADOPT, Round, Rounds, run_round

TAG = "daso/global"


def broadcast_state(group: Group, state: Any, src: int, tag: str) -> Any:
    """``state`` of (sub)group rank ``src`` on every member (``torch.save``-able; the size first).

    After a failure (an elastic round then fails) every member keeps its own ``state``.
    """
    blob = broadcast_bytes(group, to_bytes(state) if group.rank == src else None, src, tag)
    if blob is None or group.rank == src:
        return state
    return from_bytes(blob)


class _GlobalSync:
    """The global sync's buffers: the agreed parameters, the leaders' mean of deltas, the landing.

    Every worker holds three flat buffers (on the group's device, they
    travel over it): ``ref`` (the last agreed parameters), ``at_launch`` and
    ``delta`` (this host's delta since ``ref``, then the hosts' mean, kept
    until it lands; at most one sync is in flight).
    """

    def __init__(self, params: list[nn.Parameter], group: Group, host: Any, leaders: Any, codec: Codec) -> None:
        self.params, self.group, self.host, self.leaders, self.codec = params, group, host, leaders, codec
        numel = sum(p.numel() for p in params)
        self.ref = self.flat(torch.empty(numel, dtype=torch.float32, device=group.device))
        self.at_launch = torch.zeros_like(self.ref)   # healed before any launch: never uninitialised memory
        self.delta = torch.zeros_like(self.ref)
        self.active = False     # this round's quorum spans several hosts
        self.pending = False    # a committed mean waits to land
        self.finished = True    # the mean is in ``delta`` on every worker (not in flight)
        self.left_out = False   # the last mean left a host with non-finite progress out
        self._flags = torch.zeros(2, dtype=torch.float32, device=group.device)
        self._thread: ThreadPoolExecutor | None = None
        self._work: ThreadFuture | None = None
        self._side = SideStream(group.device)  # CUDA: the background mean's own stream, events both ways

    def flat(self, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():   # copies across devices and dtypes (torch.cat(out=) does neither)
            torch._foreach_copy_(flat_views(out, self.params), [p.detach() for p in self.params])
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        torch._foreach_copy_([p.detach() for p in self.params], flat_views(flat, self.params))

    def state(self) -> dict[str, Any]:
        return {"ref": self.ref, "at_launch": self.at_launch, "agreed": self.delta, "pending": self.pending}

    def load(self, s: Mapping[str, Any]) -> None:
        self.ref.copy_(s["ref"])
        self.at_launch.copy_(s["at_launch"])
        self.delta.copy_(s["agreed"])
        self.pending = bool(s["pending"])

    def host_heal(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Newcomers of this round take their host's state from an established host member."""
        host = self.host
        needy = set(host.newcomers)
        if not needy:
            return
        established = [r for r in range(host.size) if r not in needy]
        if not established:     # the whole host is new: restart it from the last agreed parameters
            self.write(self.ref)
            self.at_launch.copy_(self.ref)
            return
        state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "at_launch": self.at_launch}
        got = broadcast_state(host, state, established[0], "daso/host-heal")
        if host.rank in needy and got is not state:
            module.load_state_dict(got["module"])
            optimizer.load_state_dict(got["optimizer"])
            self.at_launch.copy_(got["at_launch"])

    def launch(self) -> None:
        """Every worker: this host's delta since the last agreement; leaders: start their mean."""
        self.active = self.host.size < self.group.size    # one host: DDP inside it is all there is
        if not self.active:
            return
        self.flat(self.at_launch)
        torch.sub(self.at_launch, self.ref, out=self.delta)
        self.finished = False
        if self.leaders.member:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-daso")
            self._work = self._thread.submit(self._side.run, self._side.ready(), self._leaders_mean)

    def _leaders_mean(self) -> None:
        """Mean of the deltas of hosts that bring finite progress of their own.

        A host whose delta holds a NaN/Inf, or whose workers were all healed
        in this round, sends zeros and the mean is rescaled; how many hosts
        contribute (and how many could) travels in an 8-byte all-reduce read
        after the mean (as :func:`shoal.averagers.finite_mean`). A host left
        out for non-finite progress restarts from the agreed parameters when
        the result lands.
        """
        leaders, flags = self.leaders, self._flags
        fresh = len(self.host.newcomers) == self.host.size
        bad = read_flag(nonfinite_flag([self.delta]))    # this host's own delta, before the collectives
        flags[0], flags[1] = float(not (fresh or bad)), float(not fresh)
        count = leaders.all_reduce(flags, op="sum", tag=f"{TAG}/finite")
        if fresh or bad:
            self.delta.zero_()
        with torch.no_grad():
            self.codec.mean([self.delta], ["params"], leaders, TAG)
            count.wait()
            contributors, live = (int(round(v)) for v in flags.tolist())   # the one read after the collectives
            if 0 < contributors < leaders.size:
                self.delta.mul_(leaders.size / contributors)
        self.left_out = contributors < live

    def finish(self) -> None:
        """Wait for the leaders' mean; each leader broadcasts it inside its host."""
        if self._work is not None:
            _, done = self._work.result()
            self._work = None
            self._side.join(done)     # CUDA: read the mean after it is written
        if self.host.size > 1:
            self.host.broadcast(self.delta, src=0, tag="daso/local-bcast").wait()   # the leader is host rank 0
        self.finished = True

    def commit(self) -> None:
        """The round committed: its mean is agreed, to land later."""
        self.pending = self.active

    @torch.no_grad()
    def land(self) -> None:
        """Agreed parameters + this host's progress since the launch (every worker)."""
        if not self.pending:
            return
        self.pending = False
        if not self.finished:     # static group: the mean ran in the background since the launch
            self.finish()
        if self.left_out:         # (on leaders only, which ran the mean)
            self.left_out = False
            self.group.meter.add_nonfinite_skip(f"{TAG}/nonfinite")
            warnings.warn("DASO: a host's parameter delta held NaN/Inf: left out of the global mean; it "
                          "restarts from the agreed parameters now; counted in nonfinite_skips",
                          RuntimeWarning, stacklevel=3)
        self.ref.add_(self.delta)
        now = self.flat(self.delta)     # reuse the buffer: parameters now
        now.sub_(self.at_launch).add_(self.ref)
        if read_flag(nonfinite_flag([now])):    # this host's own progress is not finite: drop it
            now.copy_(self.ref)
        self.write(now)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class DASO(Strategy):
    """DASO as a strategy: host-synchronous, globally skipping and delayed, loss-adaptive.

    Args: those of :class:`DASOConfig` (Heat's names), and ``max_attempts``:
    tries of a global or loss round on an elastic group before it is skipped.

    With :func:`shoal.wrap` the module returned is
    :class:`shoal.DistributedDataParallel` over the ranks of this rank's host
    (exact gradient averaging every step); the global schedule runs after
    each ``optimizer.step()``. Give it each step's loss with
    :meth:`report_loss` so the skips can adapt (without losses they stay at
    1). Hosts come from each worker's host identity (``SHOAL_HOST_ID``, else
    the hostname; see :mod:`shoal.comm.topology`).

    Every host needs at least 2 workers when there are several hosts (a
    static group checks it at set-up and raises :class:`~shoal.errors.ConfigError`;
    see :func:`~shoal.strategies.daso_schedule.check_hosts`): a host of one
    worker trains on single-worker steps between global syncs, which DASO is
    not made for; use :class:`shoal.LocalSGD` or :class:`shoal.DiLoCo` there.

    The same code runs on a static group and on an
    :class:`~shoal.elastic.ElasticGroup` (see the module docstring): there
    hosts and leaders follow each quorum, every step is voted (a failed one
    is dropped), each global sync is a round re-run with the survivors (its
    result still lands ``global_skips // 4`` steps later), and newcomers heal
    from the run and then from their host. ``rounds.commits`` /
    ``rounds.skipped`` count the rounds.

    NaN/Inf (SPEC G5): a host whose averaged gradients are non-finite skips
    that step on all its ranks; a host whose delta is non-finite is left out
    of the leaders' mean and restarts from the agreed parameters when it
    lands. Counted in ``comm_stats().total.nonfinite_skips`` (see docs/daso.md).

    Example::

        daso = shoal.DASO(total_epochs=20, steps_per_epoch=len(loader))
        model, opt = shoal.wrap(model, opt, daso)
        for epoch in range(20):
            for x, y in loader:
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step(); opt.zero_grad()
                daso.report_loss(loss.item())
    """

    name = "daso"

    def __init__(self, total_epochs: int, steps_per_epoch: int, warmup_epochs: int = 4, cooldown_epochs: int = 4,
                 max_global_skips: int = 8, stability_level: float = 0.05,
                 downcast_type: torch.dtype = torch.bfloat16, max_attempts: int = 3) -> None:
        super().__init__()
        self.config = DASOConfig(total_epochs, steps_per_epoch, warmup_epochs, cooldown_epochs,
                                 max_global_skips, stability_level, downcast_type)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self.max_attempts = max_attempts
        self.schedule = DASOSchedule(self.config)
        self.host: Any = None
        self.leaders: Any = None
        self.rounds: Rounds | None = None
        self._rounds: dict[str, Round] = {}   # by name (see _make_rounds)
        self._sync: _GlobalSync | None = None
        self._loss_sum = 0.0
        self._loss_count = 0
        self._losses = (0.0, 0)        # this epoch's, taken for the loss round
        self._shared: torch.Tensor | None = None   # the loss round's world sums
        self._busy = False             # in one of DASO's own rounds

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> nn.Module:
        self._bind(model, optimizer, group)
        if members_fixed(group):   # otherwise there are no members yet: nothing to check
            check_hosts(group.member_infos())
        group.start_state(model, list(zip(self.names, self.params)), tag="daso/init")
        dtype = self.config.downcast_type
        codec: Codec = Identity() if dtype == torch.float32 else Cast(dtype)
        self.host = group.subgroup(by_host, "daso/host")
        self.leaders = group.subgroup(host_leaders, "daso/leaders")
        ddp = DistributedDataParallel(model, process_group=self.host, hierarchical=False)   # + ddp/module
        self._sync = _GlobalSync(self.params, group, self.host, self.leaders, codec)
        self.rounds = Rounds(group, "daso", max_attempts=self.max_attempts)
        self._rounds = self._make_rounds(self.rounds)
        self.rounds.register(optimizer=optimizer, get_state=self._state, load_state=self._load_state)
        group.before_begin_step(self._admit)
        group.watch_peers()   # a member lost between steps is left out before the next one: _admit
        self._busy = True
        try:
            joined = self.rounds.join()
        finally:
            self._busy = False
        if joined != ADOPT:     # a newcomer that joined its peers' round: finish their after_step with them
            self._after_step(resume=joined)
        self._mark_step()
        return ddp

    # --- state ------------------------------------------------------------------
    def _ready(self) -> _GlobalSync:
        if self._sync is None:
            raise ShoalError("DASO is not set up: use shoal.wrap(model, optimizer, strategy)")
        return self._sync

    def _state(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(), **self._ready().state()}

    def _load_state(self, s: dict[str, Any]) -> None:
        sync = self._ready()
        self.schedule.load_state_dict(s["schedule"])
        sync.load(s)

    # --- rounds -------------------------------------------------------------------
    def _admit(self) -> None:
        """Before a step begins: leave a quorum dissolved since the last step (a member lost: the peer watch or
        the coordinator raised its abort flag), then adopt a waiting quorum in empty rounds, so newcomers
        join in a round and the step runs once over the survivors. A member that missed the flag runs its
        step on the dissolved quorum, which discards it there and then adopts in the same empty round."""
        if self._busy or self.rounds is None or self.group is None:
            return
        self._busy = True
        try:
            self.group.renew_if_dissolved()   # outside a step only
            while self.group is not None and self.group.quorum_pending:
                self.rounds.run(ADOPT)
        finally:
            self._busy = False

    def _make_rounds(self, rounds: Rounds) -> dict[str, Round]:
        """DASO's rounds: an empty one (newcomers take their host's state), the epoch's loss, a global sync
        (``global+land``: one whose landing is due in the same step)."""
        made = [Round(ADOPT, reduce=lambda live: self._host_heal()),
                Round("loss", reduce=self._reduce_loss, apply=self._apply_loss)]
        # A committed round may admit a waiting newcomer at once (Rounds.run), which heals the state as it is
        # then: so a landing due in the round's step happens in its apply, never after the round returns.
        made += [Round("global", reduce=lambda live: self._reduce_global(), apply=lambda: self._ready().commit()),
                 Round("global+land", reduce=lambda live: self._reduce_global(), apply=self._commit_and_land)]
        return {r.name: rounds.add(r) for r in made}

    def _commit_and_land(self) -> None:
        sync = self._ready()
        sync.commit()
        sync.land()

    def _run(self, name: str, admit: bool = True) -> bool:
        if self.rounds is None:
            raise ShoalError("DASO is not set up: use shoal.wrap(model, optimizer, strategy)")
        self._busy = True
        try:
            return self.rounds.run(self._rounds[name], admit=admit)
        finally:
            self._busy = False

    def _host_heal(self) -> None:
        """Every round begins here: newcomers of this round take their host's state."""
        if self.optimizer is None or self.module is None:  # pragma: no cover - bound with _sync
            raise ShoalError("DASO is not set up: use shoal.wrap(model, optimizer, strategy)")
        self._ready().host_heal(self.module, self.optimizer)

    def _reduce_loss(self, contributes: bool) -> None:
        self._host_heal()
        sync = self._ready()
        total, count = self._losses if contributes else (0.0, 0)
        t = torch.tensor([total, float(count)], dtype=torch.float64, device=sync.group.device)
        sync.group.all_reduce(t, op="sum", tag="daso/control").wait()
        self._shared = t

    def _apply_loss(self) -> None:
        if self._shared is not None:
            total, count = self._shared.tolist()   # the one host read, after the collective
            if count > 0:
                self.schedule.record_loss(total / count)

    def _reduce_global(self) -> None:
        self._host_heal()
        sync = self._ready()
        sync.launch()
        if step_ends_at_vote(sync.group) and sync.active:   # no reduction may outlive the round's vote
            sync.finish()

    # --- the schedule ----------------------------------------------------------------
    def before_step(self) -> bool | None:
        """The gradient step's vote (a failed step is dropped on every worker; always True on a static group)."""
        if self.group is None:
            raise ShoalError("DASO is not set up: pass it to shoal.wrap(model, optimizer, strategy) first")
        return run_round(self.group)

    def report_loss(self, loss: float | torch.Tensor) -> None:
        """This step's training loss on this rank (the schedule adapts to the world's epoch mean)."""
        self._loss_sum += float(loss)
        self._loss_count += 1

    def after_step(self) -> None:
        if self._sync is None or self.group is None:
            raise ShoalError("DASO is not set up: pass it to shoal.wrap(model, optimizer, strategy) first")
        self._after_step()
        self._mark_step()

    def _after_step(self, resume: str | None = None) -> None:
        """Loss round at an epoch's end, global round at a launch, landing (``resume``: a newcomer's round).

        Whoever is admitted right after one of these rounds heals the state of that moment and then
        trains the next step: so the loss round admits no one (the schedule's step and maybe a global
        round follow in this step; the next round admits), and ``global+land`` lands in its apply.
        """
        sync = self._ready()
        s = self.schedule
        if resume is not None and resume != "loss":   # a newcomer healed into a global round: it ran (and landed)
            return
        if resume is None and (s.step + 1) % s.config.steps_per_epoch == 0:
            self._losses = (self._loss_sum, self._loss_count)
            self._loss_sum, self._loss_count = 0.0, 0
            self._run("loss", admit=False)
        launch, land = s.after_step()
        if launch:
            if not self._run("global+land" if land else "global"):
                sync.pending = False   # given up on every worker alike: nothing lands
        elif land:
            sync.land()

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])

    def close(self) -> None:
        """Stop the background thread (epochs end with nothing in flight)."""
        if self._sync is not None:
            self._sync.close()


def expected_global_bytes(numel: int, hosts: int, dtype: torch.dtype) -> int:
    """Bytes a leader sends per global sync (ring all-reduce of the deltas among ``hosts``).

    >>> expected_global_bytes(1000, 2, torch.bfloat16)
    2000
    """
    size = dtype.itemsize
    return math.floor(2 * (hosts - 1) * numel * size / hosts) if hosts > 1 else 0
