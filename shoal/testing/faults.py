"""Declarative fault injection for elastic runs (shipped: chaos-test your own loop).

A :class:`FaultPlan` lists what goes wrong, where and when: "worker 1 fails
its first collective of step 5", "worker 2 is SIGKILLed in the middle of an
all-reduce at step 7", "worker 0 stalls 3 s before a collective of step 4".
Workers are named by their launch ``RANK`` (stable across quorums and
restarts), steps by the elastic group's committed step counter, and
collectives by their index within the step (``nth``; a rebuild's heal
exchange counts as the step's first collectives).

The plan acts through :class:`FaultyBackend`, a wrapper around the process
group that an :class:`~shoal.membership.elastic.ElasticGroup` builds for each
quorum; nothing of the production path is copied or patched: the fault
happens where a real one would (a collective that raises, never starts, or
whose process vanishes mid-flight).

Example::

    plan = FaultPlan().crash(rank=2, step=7).fail(rank=1, step=12)
    group = ElasticGroup(backend_factory=plan.backend_factory())
    # in a launched worker: plan = FaultPlan.from_env() reads $SHOAL_FAULT_PLAN
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable

from shoal.membership.elastic import BackendFactory, BackendSpec, gloo_backend
from shoal.errors import ConfigError

_KINDS = ("fail", "delay", "crash")
_OPS = ("", "allreduce", "broadcast", "allgather", "alltoall", "reduce", "send", "recv")


@dataclass(frozen=True)
class Fault:
    """One planned fault.

    Attributes:
        kind: ``"fail"`` (the collective raises, as on a reset connection),
            ``"delay"`` (sleep ``seconds`` before issuing it: peers time out),
            ``"crash"`` (issue it, then SIGKILL this process: peers lose it mid-flight).
        rank: the worker's launch RANK.
        step: committed step at which it fires.
        nth: index of the collective within that step (0: the first).
        seconds: the delay's length.
        incarnation: fires only in this incarnation of the worker
            (``$SHOAL_RESTART``, 0 for the first start), so a restarted
            worker does not crash again at the same step.
        op: count only collectives of this kind (``"broadcast"``,
            ``"allreduce"``, ...; ``""``: any): ``nth=1, op="broadcast"``
            is the second broadcast of the step, whatever ran before it
            (e.g. a parameter broadcast that runs on its own subgroup,
            while gradient all-reduces race it on the main group).
    """

    kind: str
    rank: int
    step: int
    nth: int = 0
    seconds: float = 0.0
    incarnation: int = 0
    op: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"fault kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("rank", "step", "nth", "incarnation"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"Fault.{name} must be an integer >= 0, got {v!r}")
        if self.op not in _OPS:
            raise ConfigError(f"Fault.op must be one of {_OPS}, got {self.op!r}")
        if self.seconds < 0 or (self.kind == "delay" and self.seconds == 0):
            raise ConfigError(f"a delay needs seconds > 0, got {self.seconds!r}")


class FaultPlan:
    """An immutable list of :class:`Fault`; the builder methods return a new plan.

    Example::

        plan = FaultPlan().fail(rank=1, step=3).delay(rank=0, step=6, seconds=4.0)
        env = {"SHOAL_FAULT_PLAN": plan.to_json()}     # hand it to launched workers
    """

    def __init__(self, faults: tuple[Fault, ...] | list[Fault] = ()) -> None:
        self.faults = tuple(faults)

    def _with(self, fault: Fault) -> "FaultPlan":
        return FaultPlan(self.faults + (fault,))

    def fail(self, rank: int, step: int, nth: int = 0, incarnation: int = 0, op: str = "") -> "FaultPlan":
        return self._with(Fault("fail", rank, step, nth, 0.0, incarnation, op))

    def delay(self, rank: int, step: int, seconds: float, nth: int = 0, incarnation: int = 0,
              op: str = "") -> "FaultPlan":
        return self._with(Fault("delay", rank, step, nth, float(seconds), incarnation, op))

    def crash(self, rank: int, step: int, nth: int = 0, incarnation: int = 0, op: str = "") -> "FaultPlan":
        return self._with(Fault("crash", rank, step, nth, 0.0, incarnation, op))

    def to_json(self) -> str:
        return json.dumps([asdict(f) for f in self.faults])

    @classmethod
    def from_json(cls, text: str) -> "FaultPlan":
        try:
            return cls([Fault(**d) for d in json.loads(text)])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"not a fault plan: {e}") from e

    @classmethod
    def from_env(cls, name: str = "SHOAL_FAULT_PLAN") -> "FaultPlan":
        """The plan in ``$name`` (empty plan if unset)."""
        text = os.environ.get(name)
        return cls.from_json(text) if text else cls()

    def backend_factory(self, rank: int | None = None, inner: BackendFactory = gloo_backend) -> BackendFactory:
        """A factory for :class:`ElasticGroup` that wraps each quorum's backend.

        ``rank`` defaults to ``$RANK``; the incarnation is ``$SHOAL_RESTART``.
        """
        me = int(os.environ.get("RANK", "0")) if rank is None else rank
        life = int(os.environ.get("SHOAL_RESTART", "0"))
        mine = [f for f in self.faults if f.rank == me and f.incarnation == life]
        fired: set[Fault] = set()   # shared by every quorum's backend: a fault fires once

        def make(spec: BackendSpec) -> Any:
            return FaultyBackend(inner(spec), mine, spec.step, fired)

        return make


class FaultyBackend:
    """A process-group backend that misbehaves as planned and otherwise forwards.

    Wraps the five operations an ElasticGroup issues (``allreduce``,
    ``broadcast``, ``allgather``, ``_allgather_base``, ``alltoall_base``).
    """

    def __init__(self, inner: Any, faults: list[Fault], step: Callable[[], int], fired: set[Fault]) -> None:
        self.inner = inner
        self.faults = faults
        self.step = step
        self.fired = fired
        self.calls: Counter[tuple[int, str]] = Counter()   # (step, "" or op) -> collectives so far

    def _run(self, what: str, launch: Callable[[], Any]) -> Any:
        step = self.step()
        nth = {"": self.calls[(step, "")], what: self.calls[(step, what)]}
        self.calls[(step, "")] += 1
        self.calls[(step, what)] += 1
        for f in self.faults:
            if f in self.fired or f.step != step or f.op not in nth or f.nth != nth[f.op]:
                continue
            self.fired.add(f)
            if f.kind == "fail":
                among = f" among {f.op}s" if f.op else ""
                raise RuntimeError(f"injected fault: {what} #{nth[f.op]}{among} of step {step} failed "
                                   "(connection reset by plan)")
            if f.kind == "delay":
                time.sleep(f.seconds)
            if f.kind == "crash":
                work = launch()          # peers are now inside this collective
                time.sleep(0.01)         # let its first bytes leave
                os.kill(os.getpid(), signal.SIGKILL)
                return work              # pragma: no cover - the process is gone
        return launch()

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        return self._run("allreduce", lambda: self.inner.allreduce(tensors, opts))

    def broadcast(self, tensors: Any, opts: Any) -> Any:
        return self._run("broadcast", lambda: self.inner.broadcast(tensors, opts))

    def allgather(self, outputs: Any, inputs: Any) -> Any:
        return self._run("allgather", lambda: self.inner.allgather(outputs, inputs))

    def _allgather_base(self, output: Any, tensor: Any) -> Any:
        return self._run("allgather", lambda: self.inner._allgather_base(output, tensor))

    def alltoall_base(self, output: Any, tensor: Any, out_splits: Any, in_splits: Any, opts: Any) -> Any:
        return self._run("alltoall", lambda: self.inner.alltoall_base(output, tensor, out_splits, in_splits, opts))

    def reduce(self, tensors: Any, opts: Any) -> Any:
        return self._run("reduce", lambda: self.inner.reduce(tensors, opts))

    def send(self, tensors: Any, dst: int, tag: int) -> Any:
        return self._run("send", lambda: self.inner.send(tensors, dst, tag))

    def recv(self, tensors: Any, src: int, tag: int) -> Any:
        return self._run("recv", lambda: self.inner.recv(tensors, src, tag))
