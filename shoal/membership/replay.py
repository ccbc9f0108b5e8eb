"""What a background heal replays: a replayer records each committed step's update while a joiner downloads
the run's state (:mod:`shoal.membership.catchup`) and applies them again onto the snapshot once it is loaded.

:class:`OptimizerReplay` replays optimizer steps (DDP, ``Sync``); DiLoCo's outer steps are replayed by
:class:`shoal.strategies.diloco_heal.OuterReplay`.

Example::

    group.register_replay(OptimizerReplay(optimizer, key="optimizer"))   # what ElasticOptimizer does
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from shoal.comm.stepping import StateEntry
from shoal.membership.stateserve import tree_tensors


class Replayer(Protocol):
    """Something that can record a committed step's update and apply it again later."""

    def covers(self, states: dict[str, StateEntry]) -> set[str]:
        """The registered state keys that replaying keeps up to date."""

    def record(self) -> Any:
        """This committed step's update (called before it is applied)."""

    def replay(self, update: Any) -> None:
        """Apply a recorded update."""

    def admission(self, states: dict[str, StateEntry]) -> set[str]:
        """Small state keys a joiner needs at once, at its admission (e.g. a strategy's schedule)."""

    def own(self, states: dict[str, StateEntry]) -> set[str]:
        """State keys each member holds for itself: never transferred (:meth:`caught_up` resets them)."""

    def caught_up(self) -> bool | None:
        """After the snapshot is loaded and every recorded update replayed. True if it kept some of this
        member's own progress from before the load (DiLoCo's fragments whose global copy had not changed:
        its inner optimizer then goes on as it is, :meth:`restore_own` is not called)."""

    def keep_own(self) -> Any:
        """What of :meth:`own` this worker slot's next life on this host may start from (``SHOAL_STATE_CACHE``,
        :mod:`shoal.membership.seed`), or None: nothing. Live tensors may be returned: the caller
        (:func:`~shoal.membership.seed.keep_own`) copies them to the host at once, on the training thread."""

    def restore_own(self, kept: Any) -> str | None:
        """After :meth:`caught_up`: load ``kept`` (what an earlier life's :meth:`keep_own` returned, read back
        from this host). None if it was loaded, else why not (what it would replace is left as it is)."""


class OptimizerReplay:
    """Replays optimizer steps: records the averaged ``.grad`` of every parameter, then steps with it.

    Covers the optimizer's state key and every registered state whose tensors
    are all parameters of the optimizer (a module without buffers). Exact for
    a deterministic optimizer whose hyperparameters do not change during the
    download (a learning-rate scheduler is not replayed).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, key: str) -> None:
        self.optimizer, self.key = optimizer, key

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def covers(self, states: dict[str, StateEntry]) -> set[str]:
        ptrs = {p.data_ptr() for p in self._params()}
        out = {self.key}
        for k, s in states.items():
            found = tree_tensors(s.get())
            if found and all(t.data_ptr() in ptrs for t in found):
                out.add(k)
        return out

    def record(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for p in self._params()]

    def replay(self, update: list[torch.Tensor | None]) -> None:
        params = self._params()
        for p, g in zip(params, update):
            p.grad = g
        self.optimizer.step()
        for p in params:
            p.grad = None

    def admission(self, states: dict[str, StateEntry]) -> set[str]:
        return set()   # a step-synchronous joiner needs only the step, which the plan gives

    def own(self, states: dict[str, StateEntry]) -> set[str]:
        return set()

    def caught_up(self) -> None:
        return None

    def keep_own(self) -> Any:
        return None   # nothing is a member's own: the optimizer state is the run's (replayed)

    def restore_own(self, kept: Any) -> str | None:
        return "a step-synchronous member keeps nothing of its own"
