"""DASO on an :class:`~shoal.comm.elastic.ElasticGroup`: hosts and leaders follow each quorum.

The host of a worker is the host identity it published when it joined
(``$SHOAL_HOST_ID``, else the hostname, see :mod:`shoal.comm.topology`); in
every quorum the workers of one host form a subgroup, and the lowest-ranked
worker of each host is that host's leader
(:class:`~shoal.comm.elastic_sub.ElasticSubgroup`). What happens:

- **every step** (``FailurePolicy.DISCARD``): shoal's DDP over the host
  subgroup averages gradients; ``optimizer.step()`` votes, and a failed step
  is dropped on every worker (as :class:`shoal.strategies.Sync`);
- **a global sync** (``AVERAGE_SURVIVORS``) is an elastic round: the leaders
  average their hosts' parameter deltas since the last agreement (``bf16``),
  each leader broadcasts the mean inside its host, and everyone keeps it
  until the landing step, where every worker applies it itself (no
  collective). A failed round (a leader lost) is run again on the next
  quorum, whose hosts have new leaders; past ``max_attempts`` it is skipped.
  The round is blocking: an elastic group cannot keep a reduction in flight
  across quorums, so the delay ``global_skips // 4`` applies to *when the
  result lands* (the arithmetic is the static one), not to overlap;
- **the epoch's loss** is shared in a round too (newcomers send zeros);
- **newcomers** receive the run's state (module, optimizer, schedule, the
  agreed parameters, the pending result) from the usual heal, then, in the
  same step, their *host's* state (parameters, buffers, optimizer state,
  parameters at launch) from the lowest-ranked established worker of their
  host. A host whose workers are all new restarts from the last agreed
  parameters and contributes nothing to the round it joined in (the mean is
  over the hosts that bring progress of their own).

Example: ``shoal.wrap(model, opt, shoal.DASO(...), process_group=ElasticGroup())``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shoal.codecs.base import Codec
from shoal.comm.elastic import ElasticGroup
from shoal.comm.elastic_sub import ElasticSubgroup, by_host, host_leaders, member_infos
from shoal.comm.finite import nonfinite_flag, read_flag
from shoal.comm.flat import flat_views
from shoal.comm.objects import broadcast_bytes, from_bytes, to_bytes
from shoal.strategies.rounds import ADOPT

TAG = "daso/global"


def broadcast_state(group: ElasticGroup, state: Any, src: int, tag: str) -> Any:
    """``state`` of subgroup rank ``src`` on every member (``torch.save``-able; the size first).

    After a failure (the step is lost) every member keeps its own ``state``.
    """
    blob = broadcast_bytes(group, to_bytes(state) if group.rank == src else None, src, tag)
    if blob is None or group.rank == src:
        return state
    return from_bytes(blob)


class ElasticDASO:
    """The elastic side of :class:`shoal.DASO` (see the module docstring); built by its setup.

    Attributes: ``host``, ``leaders`` (the subgroups), ``ddp`` (the module
    to train), ``commits`` / ``skipped`` (global rounds), ``max_attempts``.
    """

    def __init__(self, group: ElasticGroup, module: nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[nn.Parameter], schedule: Any, codec: Codec,
                 losses: Callable[[], tuple[float, int]], max_attempts: int = 3) -> None:
        from shoal.parallel import DistributedDataParallel

        self.group, self.module, self.optimizer, self.params = group, module, optimizer, params
        self.schedule, self.codec, self._losses, self.max_attempts = schedule, codec, losses, max_attempts
        self.host = ElasticSubgroup(group, "daso/host", by_host)
        self.leaders = ElasticSubgroup(group, "daso/leaders", host_leaders)
        numel = sum(p.numel() for p in params)
        # Flat buffers on the group's device (they travel over it); the parameters may live elsewhere.
        self.ref = self._flat(torch.empty(numel, dtype=torch.float32, device=group.device))   # last agreed
        self.at_launch = torch.zeros_like(self.ref)   # healed before any launch: no uninitialised memory (may be NaN)
        self.agreed = torch.zeros_like(self.ref)     # the committed mean delta, until it lands
        self.scratch = torch.empty_like(self.ref)
        self.pending = False
        self.kind: dict[str, Any] = {"kind": ADOPT, "land": False}   # healed: a newcomer joins the same round
        self.commits = self.skipped = 0
        self.ddp = DistributedDataParallel(module, process_group=self.host, hierarchical=False)  # + ddp/module
        group.register_state("daso/optimizer", optimizer.state_dict, optimizer.load_state_dict)
        group.register_state("daso/state", self._state, self._load_state)
        group.register_state("daso/round", lambda: dict(self.kind), self._load_round)
        self.host.on_adopt(self._host_heal)

    # --- state ----------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(), "ref": self.ref, "at_launch": self.at_launch,
                "agreed": self.agreed, "pending": self.pending}

    def _load_state(self, s: dict[str, Any]) -> None:
        self.schedule.load_state_dict(s["schedule"])
        for name in ("ref", "at_launch", "agreed"):
            getattr(self, name).copy_(s[name])
        self.pending = bool(s["pending"])

    def _load_round(self, s: dict[str, Any]) -> None:
        self.kind = dict(s)

    def _flat(self, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():   # copies across devices and dtypes (torch.cat(out=) does neither)
            torch._foreach_copy_(flat_views(out, self.params), [p.detach() for p in self.params])
        return out

    @torch.no_grad()
    def _write(self, flat: torch.Tensor) -> None:
        torch._foreach_copy_([p.detach() for p in self.params], flat_views(flat, self.params))

    def _host_heal(self) -> None:
        """Newcomers take their host's state from an established host member (see the module docstring)."""
        host = self.host
        needy = set(host.newcomers)
        if not needy:
            return
        established = [r for r in range(host.size) if r not in needy]
        if not established:     # the whole host is new: restart it from the last agreed parameters
            self._write(self.ref)
            self.at_launch.copy_(self.ref)
            return
        state = {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "at_launch": self.at_launch}
        got = broadcast_state(host, state, established[0], "daso/host-heal")
        if host.rank in needy and host.error is None:
            self.module.load_state_dict(got["module"])
            self.optimizer.load_state_dict(got["optimizer"])
            self.at_launch.copy_(got["at_launch"])

    # --- the schedule -------------------------------------------------------------
    def begin(self) -> None:
        """Start an elastic step (adopt a quorum, heal, host-heal newcomers)."""
        self.host.start_step()

    def join(self) -> None:
        """In setup: the first quorum (or, for a newcomer, admission into its peers' step)."""
        for _ in range(self.max_attempts):
            self.kind = {"kind": ADOPT, "land": False}
            self.begin()
            kind = self.kind["kind"]
            if kind == "grad":          # the peers are in a gradient step: the user's loop completes it
                return
            if kind in ("loss", "global"):
                self.after_step(resume=kind)
                return
            if self.group.should_commit():
                break
        self.kind = {"kind": "grad", "land": False}

    def before_step(self) -> bool:
        """End the gradient step: True if committed on every worker (then the optimizer steps)."""
        self.begin()
        return self.group.should_commit()

    def after_step(self, resume: str | None = None) -> None:
        """Loss round at an epoch's end, global round at a launch, landing (``resume``: a newcomer's)."""
        s = self.schedule
        if resume == "global":
            land = bool(self.kind["land"])
            self._global_round(land)
        else:
            if resume == "loss" or (s.step + 1) % s.config.steps_per_epoch == 0:
                self._loss_round()
            launch, land = s.after_step()
            if launch:
                self._global_round(land)
        if land:
            self._land()
        self.kind = {"kind": "grad", "land": False}

    def _loss_round(self) -> None:
        total, count = self._losses()
        for _ in range(self.max_attempts):
            self.kind = {"kind": "loss", "land": False}
            self.begin()
            mine = self.group.rank not in self.group.newcomers
            t = torch.tensor([total, float(count)] if mine else [0.0, 0.0], dtype=torch.float64,
                             device=self.group.device)
            self.group.all_reduce(t, op="sum", tag="daso/control").wait()
            if self.group.should_commit():
                world_total, world_count = t.tolist()
                if world_count > 0:
                    self.schedule.record_loss(world_total / world_count)
                return

    def _global_round(self, land: bool) -> None:
        for _ in range(self.max_attempts):
            self.kind = {"kind": "global", "land": land}
            self.begin()
            hosts = by_host(member_infos(self.group.client, self.group.quorum)) if self.group.quorum else [[0]]
            if len(hosts) == 1:         # one host: DDP inside it is all there is (as on a static group)
                self.pending = False
                if self.group.should_commit():
                    return
                continue
            self._flat(self.at_launch)
            torch.sub(self.at_launch, self.ref, out=self.scratch)
            if self.leaders.member:
                self._leaders_mean(hosts)
            self.host.broadcast(self.scratch, src=0, tag="daso/local-bcast").wait()  # the leader is host rank 0
            if self.group.should_commit():
                self.agreed.copy_(self.scratch)
                self.pending = True
                self.commits += 1
                return
        self.pending = False
        self.skipped += 1

    def _leaders_mean(self, hosts: list[list[int]]) -> None:
        """Mean of the deltas of hosts that bring progress of their own (not only newcomers) and finite.

        A host whose delta holds a NaN/Inf is left out as a host of newcomers
        is (zeros, and the mean rescaled); how many hosts contribute travels
        in a 4-byte all-reduce read after the mean (see
        :func:`shoal.averagers.finite_mean`); such a host restarts from the
        agreed parameters when the result lands.
        """
        new = set(self.group.newcomers)
        fresh = [all(r in new for r in h) for h in hosts]       # by leader rank order = host order
        live = len(hosts) - sum(fresh)
        bad = read_flag(nonfinite_flag([self.scratch]))         # this host's own delta, before the collectives
        mine = not (fresh[self.leaders.rank] or bad)
        finite = torch.full((), 1.0 if mine else 0.0, dtype=torch.float32, device=self.scratch.device)
        count = self.leaders.all_reduce(finite, op="sum", tag=f"{TAG}/finite")
        if not mine:
            self.scratch.zero_()
        with torch.no_grad():
            self.codec.mean([self.scratch], ["params"], self.leaders, TAG)
            count.wait()
            if self.leaders.error is not None:    # the round fails; nothing of it is kept
                return
            contributors = int(round(float(finite.item())))
            if 0 < contributors < len(hosts):
                self.scratch.mul_(len(hosts) / contributors)
            if contributors < live:
                self.group.meter.add_nonfinite_skip(f"{TAG}/nonfinite")

    @torch.no_grad()
    def _land(self) -> None:
        """Agreed parameters + this host's progress since the launch (every worker, no collective)."""
        if not self.pending:
            return
        self.pending = False
        self.ref.add_(self.agreed)
        now = self._flat(self.scratch)
        now.sub_(self.at_launch).add_(self.ref)
        if read_flag(nonfinite_flag([now])):    # this host's own progress is not finite: drop it
            now.copy_(self.ref)
        self._write(now)
