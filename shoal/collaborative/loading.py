"""The collaborative optimizer's state: sending and loading it, averaging it, and catching up.

:class:`StateMixin` is the part of :class:`~shoal.collaborative.optimizer.CollaborativeOptimizer`
that deals in whole state (parameters, optimizer and scheduler state, extra tensors, epoch)
rather than in gradients, and that decides where a peer left out of a round goes next:

- others are alive: the peer is behind; it loads the swarm's state in the swarm's next
  round (the first whose member list is not written yet), with weight 0;
- nobody else is alive (everyone left, or it is the first of a new run): the closed rounds
  are history; it moves past them and trains alone, and says so once.

Example (what a peer does after a round closed without it)::

    opt._left_behind(epoch)        # alone: local_epoch jumps past the closed rounds
    opt._catch_up_epoch()          # behind: the epoch whose round it joins to load state
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from shoal.codecs.base import Codec
from shoal.collaborative.config import CollaborativeConfig
from shoal.collaborative.progress import ProgressTracker
from shoal.collaborative.rounds import RoundGroup, RoundReport, as_group
from shoal.collaborative.state import average_tensors, decode_state, encode_state, exchange_state, stat_tensors
from shoal.collaborative.validate import Verdict
from shoal.comm.flat import flat_views

log = logging.getLogger("shoal.collaborative")


class Throttle:
    """Rate-limits a repeated warning: at most one line per ``every`` seconds per key, with a count of the rest.

    >>> t = Throttle(every=60.0)
    >>> t.ready("late", now=0.0), t.ready("late", now=1.0), t.ready("late", now=61.0)
    ((True, 0), (False, 0), (True, 1))
    """

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}

    def ready(self, key: str, now: float | None = None) -> tuple[bool, int]:
        """Whether to log ``key`` now, and how many of its lines were held back since the last one."""
        now = time.monotonic() if now is None else now
        last, held = self._last.get(key, (float("-inf"), 0))
        if now - last >= self.every:
            self._last[key] = (now, 0)
            return True, held
        self._last[key] = (last, held + 1)
        return False, held + 1

    def warning(self, key: str, msg: str, *args: Any) -> None:
        """``log.warning(msg, *args)`` unless ``key`` was logged less than ``every`` seconds ago."""
        ok, held = self.ready(key)
        if ok:
            log.warning(msg + (f" ({held} more like this not shown)" if held else ""), *args)


class StateMixin:
    """State transfer, state averaging and catching up (see the module docstring)."""

    config: CollaborativeConfig
    group: RoundGroup
    tracker: ProgressTracker
    names: list[str]
    params: list[torch.Tensor]
    opt_params: list[torch.Tensor]
    extra: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state_codec: Codec
    local_epoch: int
    _numel: int
    _device: torch.device
    _fresh: bool
    _left_out: bool
    _alone: bool
    _throttle: Throttle
    # provided by the optimizer: one round's averaging, and applying its result
    _round: Callable[[int, int, torch.Tensor, int, bool, float], tuple[RoundReport, torch.Tensor | None]]
    _apply: Callable[[RoundReport, torch.Tensor | None, torch.Tensor, int], None]
    _reset_accumulators: Callable[[], None]
    _copy_back: Callable[[], None]

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self._numel, dtype=torch.float32, device=self._device)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return flat_views(flat, self.params)

    # --- where a peer that is behind or alone goes ------------------------------------
    def _swarm_epoch(self) -> int:
        """The swarm's epoch as a majority of the live settled peers' signed records say (progress.py)."""
        return self.tracker.global_epoch(sorted(self.group.live_members()))[0]

    def _next_round(self) -> int:
        """The swarm's next round for a peer that is behind: the later of what the live settled peers
        report and the first epoch whose round has not closed (the coordinator's list may not show
        the others yet, so their records alone can be missing)."""
        return max(self._swarm_epoch(), self.group.first_open_epoch(self.local_epoch))

    def _catch_up_epoch(self) -> int:
        """The epoch a fresh peer should load state for, or its own epoch if it should just train.

        A claim that a single settled peer makes (everybody else fresh, as at the start of a run)
        is not reason enough to stop training and wait for state: that peer may be lying. The
        fresh peer trains at its own epoch, and follows the swarm only once a round it tried
        to join closed without it.
        """
        if self._left_out:
            return self._next_round()
        epoch, witnesses = self.tracker.global_epoch(sorted(self.group.live_members()))
        return epoch if witnesses >= 2 else self.local_epoch

    def _left_behind(self, epoch: int) -> None:
        """Round ``epoch`` closed without this peer. If others are alive, the next step loads their state
        (``_fresh``, ``_left_out`` are set); if nobody is, train on alone past the rounds already closed."""
        if self.group.live_others():
            self._throttle.warning("late", "epoch %d: the swarm averaged without this peer (too late); it will "
                                   "load the swarm's state in the next round", epoch)
            return
        self._fresh = self._left_out = False
        self.local_epoch = max(self.local_epoch, self.group.first_open_epoch(epoch + 1))
        self._say_alone(f"rounds up to epoch {self.local_epoch - 1} closed before this peer came")

    def _say_alone(self, why: str) -> None:
        """Log once (until a round with others) that this peer trains on its own."""
        if not self._alone:
            self._alone = True
            log.warning("no other peer is in the swarm (%s): training alone from epoch %d; peers that join "
                        "later load this peer's state", why, self.local_epoch)

    def _catch_up(self) -> RoundReport | None:
        """This peer is behind: take part in the swarm's next round with weight 0 and load its state.

        If the others leave meanwhile, nobody can send state: it trains on alone instead."""
        deadline = time.monotonic() + self.config.load_state_timeout
        zeros = self._zeros()
        while time.monotonic() < deadline:
            epoch = self._next_round()
            if not self.group.live_others():
                self._left_behind(epoch - 1)
                return None
            report, averaged = self._round(epoch, self.local_epoch, zeros, 0, True, deadline - time.monotonic())
            if report.outcome == "loaded":
                self._reset_accumulators()
                self._apply(report, averaged, zeros, 0)
                self._copy_back()
                return report
            while self._next_round() == epoch and time.monotonic() < deadline:
                time.sleep(0.01)     # that round closed without this peer: wait for the swarm's next one
        self._throttle.warning("load", "could not load the swarm's state within load_state_timeout=%.1f s; will "
                               "retry at the next step", self.config.load_state_timeout)
        self._reset_accumulators()
        return None

    def _aux_step(self) -> RoundReport | None:
        """An auxiliary peer: wait for the swarm to reach the target, then average with weight 0."""
        deadline = time.monotonic() + self.config.averaging_timeout
        while time.monotonic() < deadline:
            epoch = max(self._catch_up_epoch(), self.local_epoch)   # a lone claim alone does not move it
            if self.tracker.add_samples(epoch, 0) >= self.config.target_batch_size:
                zeros = self._zeros()
                report, averaged = self._round(epoch, self.local_epoch, zeros, 0, True, self.config.averaging_timeout)
                if report.outcome in ("averaged", "loaded"):
                    self._apply(report, averaged, zeros, 0)
                    self._copy_back()
                elif report.outcome == "behind":
                    self._fresh = self._left_out = True
                else:
                    self.local_epoch = max(self.local_epoch, epoch + 1)   # nothing to apply: follow the swarm
                return report
            self.tracker.on_step(0, self.local_epoch, 0)
            time.sleep(0.01)
        return None

    # --- the round's gradient mean, checked (validate.py says what a member may send) -------
    def _robust_mean(self, contrib: torch.Tensor, weights: list[int], codec: Codec,
                     tag: str) -> tuple[torch.Tensor | None, list[int]]:
        """Weighted mean of the members' ``contrib`` (each a weight-scaled sum); see validate.py for the checks."""
        g, total = self.group, sum(weights)
        if total == 0:
            return None, []
        w, dev = weights[g.rank], g.device   # staged on the group's device, wherever contrib lives
        work = contrib.to(dev, copy=True).mul_(g.size / total) if w > 0 \
            else torch.zeros(self._numel, dtype=torch.float32, device=dev)
        with torch.no_grad():
            codec.mean(self._views(work), self.names, as_group(g.group), tag)
        if g.error is not None or bool(torch.isfinite(work).all()):
            return work, []
        # Someone sent NaN/Inf into the sum: gather everyone's raw contribution to find them.
        mine = contrib.to(dev) if w > 0 else torch.zeros(self._numel, dtype=torch.float32, device=dev)
        everyone = torch.empty(g.size * self._numel, dtype=torch.float32, device=dev)
        g.group.all_gather_into(everyone, mine, tag=tag + "/check").wait()
        rows = everyone.view(g.size, self._numel)
        finite = torch.isfinite(rows).all(dim=1).tolist()
        bad = [r for r in range(g.size) if not finite[r] or (weights[r] == 0 and bool(rows[r].any()))]
        good = [r for r in range(g.size) if r not in bad and weights[r] > 0]
        members = g.quorum.members if g.quorum else ()
        for r in bad:
            log.warning("member %d sent non-finite or unweighted data in %s; excluded from this round's mean",
                        members[r], tag)
        if not good:
            return None, bad
        return rows[good].sum(dim=0) / sum(weights[r] for r in good), bad

    # --- state: loading and averaging (wire format and collectives in state.py) ---------------
    def _exchange_state(self, verdict: Verdict) -> bool:
        """The source sends its state to the members that are behind or fresh; True if this peer loaded it."""
        blob = exchange_state(self.group, verdict, self._state_blob, self.config.max_state_bytes,
                              self.config.load_state_timeout)
        if blob is None:
            return False
        q = self.group.quorum
        return self._load_blob(blob, q.members[verdict.source] if q is not None and verdict.source is not None else -1,
                               verdict.epoch)

    def _full_state(self) -> dict[str, Any]:
        return {"params": [p.detach() for p in self.opt_params], "extra": [t.detach() for t in self.extra],
                "optimizer": self.optimizer.state_dict(), "local_epoch": self.local_epoch,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {}}

    def _state_blob(self) -> torch.Tensor:
        """This peer's full state as sent to a peer that loads it (through ``state_loading_codec``)."""
        return encode_state(self._full_state(), self.config.state_loading_codec)

    def _load_blob(self, blob: torch.Tensor, source: int, epoch: int) -> bool:
        """Check a received state blob and, if usable, make it this peer's state; whether it was loaded.

        ``epoch`` is the round's: the source's state must be of that epoch (or the next one, when the
        source already advanced its epoch for a round it averages in the background).
        """
        state = decode_state(blob, self._full_state(), source, epochs=(epoch, epoch + 1))
        if state is None:
            return False
        with torch.no_grad():
            for p, v in zip(self.opt_params + self.extra, state["params"] + state["extra"]):
                p.copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = int(state["local_epoch"])
        log.info("loaded state of epoch %d from member %d", self.local_epoch, source)
        return True

    def _average_state(self, skip: Sequence[int] = ()) -> bool:
        """Average parameters, chosen optimizer statistics and extra tensors (equal weights); applied on commit.

        ``skip``: ranks whose tensors are left out (caught sending bad data earlier in the round, or
        loading state in it); they receive the mean too.
        """
        tensors, names = stat_tensors(self.opt_params, self.names, self.extra, self.optimizer,
                                      self.config.average_opt_statistics)
        return average_tensors(self.group, tensors, names, self.state_codec, skip)
