"""The elastic failure policy of ``shoal run --elastic``: restart, admit, go on.

:class:`ElasticLaunch` configures it; :class:`ElasticSupervisor` extends the
launcher's supervisor through its ``on_exit`` and ``on_tick`` hooks:

- a worker that crashes (non-zero exit, or killed by ``--kill``) is started
  again with the same ``RANK`` and ``SHOAL_RESTART`` incremented, up to
  ``max_restarts`` times per rank; the new process joins the run and heals
  from a live peer;
- ``--join @SECONDS`` starts an extra worker then (``RANK`` = world size,
  world size + 1, ...), which joins and heals the same way;
- the run goes on while at least ``min_workers`` workers live; it ends when
  all have exited, with code 0 if every last incarnation exited 0.

In elastic mode ``RANK`` labels a worker; its place in the group is
``group.rank``, which changes with each quorum.

Example::

    launch([sys.executable, "train.py"], nprocs=4,
           elastic=ElasticLaunch(min_workers=2, max_restarts=3, joins=(30.0,)))
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from shoal.cli.launcher import _Output, _Supervisor, _Worker
from shoal.errors import ConfigError


@dataclass(frozen=True)
class ElasticLaunch:
    """Options of an elastic launch.

    Attributes:
        min_workers: fewest live workers the run tolerates (also each worker's
            quorum minimum, passed as ``SHOAL_MIN_WORKERS``).
        max_restarts: restarts allowed per rank (0: crashed workers stay dead).
        joins: seconds after the start at which to add one worker each.
        coordinator: ``host:port`` of a standalone coordinator; ``None``
            embeds one in the launcher.
    """

    min_workers: int = 1
    max_restarts: int = 3
    joins: tuple[float, ...] = ()
    coordinator: str | None = None

    def __post_init__(self) -> None:
        for name in ("min_workers", "max_restarts"):
            v = getattr(self, name)
            low = 1 if name == "min_workers" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
        for t in self.joins:
            if not isinstance(t, (int, float)) or t < 0:
                raise ConfigError(f"join times must be seconds >= 0, got {t!r}")


@dataclass
class _Spawn:
    argv: list[str]
    env: dict[str, str]
    host: int
    local: int
    restarts: int = 0


class ElasticSupervisor(_Supervisor):
    """Restarts crashed workers and starts joiners; see the module docstring."""

    def __init__(self, spec: ElasticLaunch, kill: list[tuple[int, float]], grace_s: float,
                 output: _Output, quiet: bool) -> None:
        super().__init__(kill, tolerate_kills=True, grace_s=grace_s, output=output, quiet=quiet)
        self.spec = spec
        self.spawns: dict[int, _Spawn] = {}
        self.pending_joins = sorted(spec.joins)

    def start(self, argv: list[str], env: dict[str, str], rank: int, host: int, local_rank: int) -> None:
        self.spawns.setdefault(rank, _Spawn(list(argv), dict(env), host, local_rank))
        super().start(argv, env, rank, host, local_rank)

    def on_tick(self, elapsed: float) -> None:
        while self.pending_joins and elapsed >= self.pending_joins[0]:
            at = self.pending_joins.pop(0)
            template = self.spawns[0]
            rank = len(self.workers)
            env = {**template.env, "RANK": str(rank), "LOCAL_RANK": str(rank), "SHOAL_RESTART": "0"}
            self.note(f"starting worker {rank} at {at:g} s as asked (--join)")
            self.spawns[rank] = _Spawn(template.argv, env, template.host, rank)
            super().start(template.argv, env, rank, template.host, rank)

    def on_exit(self, w: _Worker) -> bool:
        if w.code == 0:
            return False
        spawn = self.spawns[w.rank]
        how = "killed as scheduled" if w.injected_kill else f"exited with code {w.code}"
        if spawn.restarts < self.spec.max_restarts:
            spawn.restarts += 1
            self.note(f"rank {w.rank} {how}; restarting it ({spawn.restarts}/{self.spec.max_restarts})")
            env = {**spawn.env, "SHOAL_RESTART": str(spawn.restarts)}
            super().start(spawn.argv, env, w.rank, spawn.host, spawn.local)
            self.workers[self.workers.index(w)] = self.workers.pop()
            return False
        alive = sum(1 for x in self.workers if x.code is None)
        if alive >= self.spec.min_workers:
            self.note(f"rank {w.rank} {how}; no restarts left, {alive} workers go on")
            if self.failed_rank is None and w.code is not None and w.code != 128 + signal.SIGKILL:
                self.failed_rank, self.result_code = w.rank, w.code
            return False
        if self.failed_rank is None and w.code is not None:
            self.failed_rank, self.result_code = w.rank, w.code
        self.note(f"rank {w.rank} {how}; only {alive} workers left (< --min-workers "
                  f"{self.spec.min_workers}): stopping the run")
        return True


__all__ = ["ElasticLaunch", "ElasticSupervisor"]
