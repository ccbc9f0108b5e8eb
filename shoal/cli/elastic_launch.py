"""The elastic failure policy of ``shoal run --elastic``: restart, admit, go on.

:class:`ElasticLaunch` configures it; :class:`ElasticSupervisor` extends the
launcher's supervisor through its ``on_exit`` and ``on_tick`` hooks:

- a worker that crashes (non-zero exit, or killed by ``--kill``) is started
  again with the same ``RANK`` and ``SHOAL_RESTART`` incremented, up to
  ``max_restarts`` times per rank; the new process joins the run and heals
  from a live peer;
- ``--join @SECONDS`` starts an extra worker then (``RANK`` = world size,
  world size + 1, ...), which joins and heals the same way;
- on an emulated cluster a restarted worker runs in its own host's namespace
  again, joiners are placed round-robin over the hosts (``RANK`` r on host
  ``r % H``), and the coordinator is a :class:`NamespacedCoordinator` in host
  0's namespace (the hosts cannot reach the launcher's);
- the run goes on while at least ``min_workers`` workers live; it ends when
  all have exited, with code 0 if every last incarnation exited 0;
- the run is over once a worker finished its part (it left the group after
  committing steps: ``ElasticGroup.leave`` marks it in the coordinator's
  store, see :class:`RunEnd`) and no live worker is still training (none
  trained in its life without finishing its part): a worker that exits
  non-zero after finishing its part (in its teardown), or once the run is
  over, is not restarted (a restart would wait for a quorum that cannot
  form, or train alone from scratch), and workers still waiting to join a
  run that is over are stopped. Such an exit fails nothing, except a crash
  of a worker that trained and never finished its part: the run then exits
  with its code (a SIGKILL, ``--kill`` included, is chaos the run survives).

In elastic mode ``RANK`` labels a worker; its place in the group is
``group.rank``, which changes with each quorum.

Example::

    launch([sys.executable, "train.py"], nprocs=4,
           elastic=ElasticLaunch(min_workers=2, max_restarts=3, joins=(30.0,)))
"""

from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

from shoal.cli.cluster import EmulatedCluster
from shoal.cli.supervise import _Output, _Supervisor, _Worker
from shoal.membership.auth import check_token
from shoal.membership.seed import OWN, PROGRESS
from shoal.errors import ConfigError, ShoalError

COORDINATOR_PORT = 29400  # a fresh namespace has every port free


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
        token: the run token the workers prove at their join (they get it
            as ``SHOAL_TOKEN``). ``None``: ``$SHOAL_TOKEN`` of the launch
            environment, else, with an embedded coordinator, a fresh random
            one (only the launcher and its workers know it); a standalone
            coordinator needs it given (its own token), ConfigError otherwise.
        state_cache: a folder on this machine (e.g. ``/dev/shm``): each worker slot keeps its copy of the
            averaged state in a file there (``SHOAL_STATE_CACHE``, :mod:`shoal.membership.seed`), so that
            its restart downloads only what changed since; the files are removed when the launch ends.
            ``None``: restarts download all of it.
    """

    min_workers: int = 1
    max_restarts: int = 3
    joins: tuple[float, ...] = ()
    coordinator: str | None = None
    token: str | None = None
    state_cache: str | None = None

    def __post_init__(self) -> None:
        for name in ("min_workers", "max_restarts"):
            v = getattr(self, name)
            low = 1 if name == "min_workers" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
        for t in self.joins:
            if not isinstance(t, (int, float)) or t < 0:
                raise ConfigError(f"join times must be seconds >= 0, got {t!r}")
        check_token(self.token)
        if self.state_cache is not None and not os.path.isdir(self.state_cache):
            raise ConfigError(f"state_cache must be an existing folder, got {self.state_cache!r}")

    def __repr__(self) -> str:   # the token stays out of logs and tracebacks
        return (f"ElasticLaunch(min_workers={self.min_workers}, max_restarts={self.max_restarts}, "
                f"joins={self.joins}, coordinator={self.coordinator!r}, token={'***' if self.token else None}, "
                f"state_cache={self.state_cache!r})")

    def resolve_token(self, env: Mapping[str, str]) -> str:
        """The run's token: this spec's, else ``env["SHOAL_TOKEN"]``, else a fresh one for an embedded coordinator."""
        token = self.token or env.get("SHOAL_TOKEN")
        if token:
            return str(check_token(token))
        if self.coordinator is not None:
            raise ConfigError(f"the standalone coordinator at {self.coordinator} needs the run's token, and none "
                              "was given: pass `--token` (or set $SHOAL_TOKEN) to the token it was started with")
        return secrets.token_urlsafe(24)


@dataclass
class _Spawn:
    argv: list[str]
    env: dict[str, str]
    host: int
    local: int
    restarts: int = 0


class RunEnd:
    """What the workers' marks in the coordinator's store say about the run's end.

    An elastic worker marks ``<run>/trained/<RANK>-<life>@<launch>`` at its
    first committed step and, when it leaves after training,
    ``<run>/finished/<RANK>-<life>@<launch>`` (and counts ``<run>/finished``);
    ``<launch>`` is its launcher's id (``SHOAL_LAUNCH_ID``), so a launcher
    started again on a machine of the same run never reads the marks of an
    earlier launcher's workers with the same labels.

    Example::

        end = RunEnd("127.0.0.1:29400", "a1b2c3", launch_id="9f8e7d6c")
        end.finished(2, 0)        # did rank 2's first life (of this launcher) finish its part?
    """

    def __init__(self, address: str, run_id: str, launch_id: str = "") -> None:
        from shoal.membership.coordinator import connect

        self.store = connect(address, 30.0)
        self.run_id = run_id
        self.suffix = f"@{launch_id}" if launch_id else ""

    def _has(self, key: str) -> bool:
        return bool(self.store.check([f"{self.run_id}/{key}"]))

    def finished(self, rank: int, life: int) -> bool:
        """Whether this life of ``rank`` left the run after committing steps."""
        return self._has(f"finished/{rank}-{life}{self.suffix}")

    def trained(self, rank: int, life: int) -> bool:
        """Whether this life of ``rank`` committed a step."""
        return self._has(f"trained/{rank}-{life}{self.suffix}")

    def any_finished(self) -> bool:
        """Whether some worker left the run after committing steps."""
        return int(self.store.add(f"{self.run_id}/finished", 0)) > 0


class ElasticSupervisor(_Supervisor):
    """Restarts crashed workers and starts joiners; see the module docstring."""

    def __init__(self, spec: ElasticLaunch, kill: list[tuple[int, float]], grace_s: float,
                 output: _Output, quiet: bool) -> None:
        super().__init__(kill, tolerate_kills=True, grace_s=grace_s, output=output, quiet=quiet)
        self.spec = spec
        self.spawns: dict[int, _Spawn] = {}
        self.pending_joins = sorted(spec.joins)
        self.label: Callable[[int], int] = lambda i: i  # worker i's RANK label (interleaved across machines)
        self.end: RunEnd | None = None   # set by the launcher once the coordinator serves
        self.clean_exit = False          # some worker exited 0
        self.over = False                # the run is over (see the module docstring)
        # One machine of a run across machines sees only its own workers: "no live worker has trained"
        # cannot be judged from here, so only each worker's own finished mark applies.
        self.across_machines = False
        self._next_check = 0.0
        self.cache_files: list[str] = []   # SHOAL_STATE_CACHE of each slot (spec.state_cache), removed at the end
        self.cache_warned = False

    def start(self, argv: list[str], env: dict[str, str], rank: int, host: int, local_rank: int) -> None:
        env = self._with_cache(env, rank)
        self.spawns.setdefault(rank, _Spawn(list(argv), dict(env), host, local_rank))
        super().start(argv, env, rank, host, local_rank)

    def _with_cache(self, env: dict[str, str], rank: int) -> dict[str, str]:
        """``env`` with this slot's own state-cache file (``spec.state_cache``; over any inherited one), the same
        for all of the slot's lives, named by the run, this launcher and the slot's RANK label."""
        if self.spec.state_cache is None:
            return env
        name = f"shoal-{env.get('SHOAL_RUN_ID', 'run')}-{env.get('SHOAL_LAUNCH_ID', '')}-{env.get('RANK', rank)}"
        env = {**env, "SHOAL_STATE_CACHE": os.path.join(self.spec.state_cache, f"{name}.state")}
        if env["SHOAL_STATE_CACHE"] not in self.cache_files:
            self.cache_files.append(env["SHOAL_STATE_CACHE"])
            if env.get("SHOAL_HEAL") != "background" and not self.cache_warned:
                self.cache_warned = True
                self.note("--state-cache is used only by the background heal of DiLoCo and streaming DiLoCo: "
                          "set SHOAL_HEAL=background (or enable it in code: group.catchup.enabled; docs/elastic.md)")
        return env

    def remove_state_cache(self) -> None:
        """The launch is over: its workers' state-cache files go (each holds a model's worth of state)."""
        for path in self.cache_files:
            # .own: the slot's own state beside it; .<pid>.tmp: a write cut off by a kill
            for name in [path, path + OWN, path + PROGRESS, *glob.glob(f"{glob.escape(path)}.*.tmp")]:
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self.note(f"could not remove the state cache {name} ({e})")

    def _life(self, w: _Worker) -> int:
        return self.spawns[w.rank].restarts

    def _run_over(self) -> bool:
        """Some worker finished its part and no live worker is still training: none has trained in its life
        without finishing its part (checked in the store)."""
        if self.end is None or self.over or self.across_machines:
            return self.over
        try:
            if not (self.clean_exit or self.end.any_finished()):
                return False
            self.over = not any(self.end.trained(self.label(w.rank), self._life(w))
                                and not self.end.finished(self.label(w.rank), self._life(w))
                                for w in self.workers if w.code is None)
        except Exception:  # noqa: BLE001 - the coordinator is gone: the workers will fail on their own
            return False
        return self.over

    def _stop_if_over(self, elapsed: float) -> None:
        if elapsed < self._next_check or not self.clean_exit or self.over:
            return
        self._next_check = elapsed + 0.2
        if self._run_over():
            for w in self.workers:
                if w.code is None and not self._finished(w):   # one that finished its part is leaving
                    self.note(f"the run is over (its workers finished); stopping rank {w.rank}, which has not "
                              "trained in it")
                    try:
                        os.killpg(w.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass

    def _finished(self, w: _Worker) -> bool:
        try:
            return bool(self.end is not None and self.end.finished(self.label(w.rank), self._life(w)))
        except Exception:  # noqa: BLE001 - the coordinator is gone: stop it as before
            return False

    def on_tick(self, elapsed: float) -> None:
        self._stop_if_over(elapsed)
        while self.pending_joins and elapsed >= self.pending_joins[0]:
            at = self.pending_joins.pop(0)
            rank = len(self.workers)
            hosts = sorted({s.host for s in self.spawns.values()})
            host = hosts[rank % len(hosts)]
            # The host's first worker carries its namespace prefix, interface and host variables.
            template = self.spawns[min(r for r, s in self.spawns.items() if s.host == host)]
            local = sum(1 for s in self.spawns.values() if s.host == host)
            env = self._with_cache({**template.env, "RANK": str(self.label(rank)), "LOCAL_RANK": str(local),
                                    "SHOAL_RESTART": "0"}, rank)   # its own state-cache file, not the template's
            self.note(f"starting worker {rank} at {at:g} s as asked (--join)"
                      + (f" on host {host}" if len(hosts) > 1 else ""))
            self.spawns[rank] = _Spawn(template.argv, env, host, local)
            super().start(template.argv, env, rank, host, local)

    def on_exit(self, w: _Worker) -> bool:
        if w.code == 0:
            self.clean_exit = True
            return False
        spawn = self.spawns[w.rank]
        how = "killed as scheduled" if w.injected_kill else f"exited with code {w.code}"
        if self.end is not None and self._ended_for(w, how):
            return False
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

    def _ended_for(self, w: _Worker, how: str) -> bool:
        """True (and noted) when ``w``'s non-zero exit needs no restart and fails nothing: it had
        finished its part of the run, or the run is over."""
        assert self.end is not None
        try:
            done = self.end.finished(self.label(w.rank), self._life(w))  # the RANK label the worker wrote
        except Exception:  # noqa: BLE001 - the coordinator is gone: the usual policy applies
            return False
        if done:
            self.note(f"rank {w.rank} {how} after it finished its part of the run (it left after training); "
                      "not restarting it")
            return True
        if self._run_over():
            crashed = w.code != 128 + signal.SIGKILL and not w.injected_kill and self._trained(w)
            if crashed and self.failed_rank is None:
                # It trained and never finished its part: the crash is the run's failure (a SIGKILL or a
                # scheduled --kill is the chaos a run survives), even though nobody is left to restart into.
                self.failed_rank, self.result_code = w.rank, w.code if w.code is not None else 1
            self.note(f"rank {w.rank} {how}; the run is over (its workers finished): not restarting it"
                      + ("; it had trained and not finished its part, so the run fails with its code"
                         if crashed else ""))
            return True
        return False

    def _trained(self, w: _Worker) -> bool:
        try:
            return bool(self.end is not None and self.end.trained(self.label(w.rank), self._life(w)))
        except Exception:  # noqa: BLE001 - the coordinator is gone: count it as a crash of a trained worker
            return True


class NamespacedCoordinator:
    """``shoal coordinator`` as a child process inside one emulated host's namespace.

    The emulated hosts reach only addresses inside the run's namespaces, so
    a coordinator in the launcher (root namespace, 127.0.0.1) is out of their
    reach; this one listens on ``host``'s address, which every host can
    reach over the bridge (and ``host``'s own workers over its loopback). It
    is stopped on exit (and killed with the namespace, whatever happens).

    Args:
        cluster: the emulated cluster, already built.
        host: the host whose namespace runs it.
        initial_workers: the first quorum waits for this many workers.
        env: its environment (``PYTHONPATH`` must find shoal).
        token: the run token (passed as ``SHOAL_TOKEN`` in its environment,
            never on its command line); None: ``env``'s ``SHOAL_TOKEN``.
        on_line: called with each line it prints (default: dropped).
        port: the port it listens on.
        ready_s: how long it may take to start serving.

    Example::

        with EmulatedCluster(ClusterSpec(2, 1, ("20mbit",))) as emu, \\
                NamespacedCoordinator(emu, initial_workers=2, token="s3cret-token") as coord:
            env["SHOAL_COORDINATOR"] = coord.address      # "10.213.0.1:29400"
    """

    def __init__(self, cluster: EmulatedCluster, host: int = 0, initial_workers: int = 1,
                 env: Mapping[str, str] | None = None, on_line: Callable[[str], None] | None = None,
                 port: int = COORDINATOR_PORT, ready_s: float = 60.0, token: str | None = None) -> None:
        if not 0 <= host < cluster.spec.hosts:
            raise ConfigError(f"host must be in [0, {cluster.spec.hosts}), got {host}")
        self.cluster, self.host, self.port = cluster, host, port
        self.argv = cluster.exec_prefix(host) + [
            sys.executable, "-m", "shoal", "coordinator", "--host", cluster.address(host), "--port", str(port),
            "--initial-workers", str(initial_workers)]
        self.env = dict(env if env is not None else os.environ)
        if token is not None:
            self.env["SHOAL_TOKEN"] = str(check_token(token))
        # torch's C++ warnings (e.g. about the namespace's missing hostname) would read like failures.
        self.env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        self.on_line = on_line
        self.ready_s = ready_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._pump: threading.Thread | None = None
        self._started = 0.0

    @property
    def address(self) -> str:
        return f"{self.cluster.address(self.host)}:{self.port}"

    def __enter__(self) -> "NamespacedCoordinator":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start(self, wait: bool = True) -> None:
        """Start it and (``wait``) wait until it serves; see :meth:`wait_ready`.

        Workers may start before it serves (their store clients retry
        connecting until ``Timeouts.quorum``), so a launcher can overlap its
        start-up with theirs and call :meth:`wait_ready` afterwards.
        """
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._pump = threading.Thread(target=self._read, args=(self.proc,), name="shoal-coordinator-out",
                                      daemon=True)
        self._pump.start()
        self._started = time.monotonic()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once it serves; raise ShoalError with its output if it exited or ``ready_s`` passed."""
        if self.proc is None or self._pump is None:
            raise ShoalError("the coordinator was not started (or was closed): call start() first")
        deadline = self._started + self.ready_s
        while not self._ready.wait(0.05):
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                self._pump.join(timeout=2)
                why = f"exited with code {code}" if code is not None else f"did not serve within {self.ready_s} s"
                raise ShoalError(f"the coordinator in namespace {self.cluster.namespace(self.host)} {why}; "
                                 f"its output: {' | '.join(self.lines[-10:]) or '(none)'}")

    def _read(self, proc: "subprocess.Popen[bytes]") -> None:
        assert proc.stdout is not None  # set by PIPE
        with proc.stdout:
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self.lines = (self.lines + [line])[-50:]
                if "serving on" in line:
                    self._ready.set()
                if self.on_line is not None:
                    self.on_line(line)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop it (SIGTERM, SIGKILL after ``grace_s``); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        if self._pump is not None:
            self._pump.join(timeout=5)


__all__ = ["COORDINATOR_PORT", "ElasticLaunch", "ElasticSupervisor", "NamespacedCoordinator", "RunEnd"]
