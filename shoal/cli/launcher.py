"""Start and supervise worker processes: the engine of ``shoal run``.

:func:`launch` starts a command once per rank with the torchrun environment,
prefixes each output line with the rank, stops every worker when one fails,
injects scheduled kills, and optionally runs the ranks on an emulated cluster
(:mod:`shoal.cli.cluster`).

Failure policy (non-elastic): the first worker to exit non-zero decides the
run's exit code, and the others are stopped (SIGTERM to each worker's process
group, SIGKILL after ``grace_s``). A worker killed by a ``kill`` entry counts
as such a failure (exit code 137 = 128 + SIGKILL), because in a static group
the survivors cannot go on without it. With ``tolerate_kills=True`` an
injected kill neither stops the others nor decides the exit code; the
survivors' own exit codes do (this is what fault tests of survivors use; the
elastic mode, :mod:`shoal.cli.elastic_launch`, extends :meth:`_Supervisor.on_exit`).

Example::

    from shoal.cli.launcher import ClusterSpec, launch
    res = launch([sys.executable, "train.py"], nprocs=2)
    res = launch([sys.executable, "train.py"],
                 cluster=ClusterSpec(hosts=4, procs_per_host=1, bandwidth=("100mbit",)))
    print(res.returncode, res.duration_s, res.host_bytes)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TextIO

from shoal.cli.cluster import ClusterSpec, EmulatedCluster
from shoal.cli.elastic_launch import ElasticLaunch, ElasticSupervisor, NamespacedCoordinator, RunEnd
from shoal.cli.nodes import NodeLayout, NodeRendezvous, NodeSpec, interface_of, route_address
from shoal.cli.supervise import _free_port, _Output, _Supervisor, _trap_signals, _Worker
from shoal.errors import ConfigError, ShoalError

__all__ = ["ClusterSpec", "LaunchResult", "NodeSpec", "launch"]


@dataclass
class LaunchResult:
    """What :func:`launch` saw.

    Attributes:
        returncode: 0 when every worker exited 0; else the failing worker's
            exit code (a worker killed by signal ``s`` counts as ``128 + s``),
            or ``128 + s`` when the launcher itself got SIGINT/SIGTERM.
        duration_s: wall-clock seconds from starting the first worker to the
            last one's exit.
        host_bytes: per emulated host, ``{"sent": .., "received": ..}`` bytes
            of its link from the interface counters; ``None`` unemulated.
        failed_rank: the rank whose exit decided ``returncode`` (``None`` if
            none failed).
        interrupted: the launcher itself got SIGINT/SIGTERM (a caller running
            several launches should stop, not go on to the next).
    """

    returncode: int
    duration_s: float
    host_bytes: list[dict[str, int]] | None = None
    failed_rank: int | None = None
    interrupted: bool = False


def _validate(cmd: Sequence[str], nprocs: int, cluster: ClusterSpec | None,
              kill: Sequence[tuple[int, float]], grace_s: float) -> int:
    if isinstance(cmd, str) or not cmd or not all(isinstance(c, str) for c in cmd):
        raise ConfigError(f"cmd must be a non-empty list of strings (an argv), got {cmd!r}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    world = nprocs
    if cluster is not None:
        world = cluster.world_size
        if nprocs not in (1, world):
            raise ConfigError(
                f"nprocs={nprocs} contradicts the cluster's {cluster.hosts} hosts x "
                f"{cluster.procs_per_host} procs = {world} workers; leave nprocs at 1 or pass {world}"
            )
    for entry in kill:
        if len(entry) != 2:
            raise ConfigError(f"kill entries must be (rank, seconds), got {entry!r}")
        rank, at = entry
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ConfigError(f"kill rank must be an integer in [0, {world}), got {rank!r}")
        if not isinstance(at, (int, float)) or at < 0:
            raise ConfigError(f"kill time must be seconds >= 0, got {at!r}")
    if grace_s < 0:
        raise ConfigError(f"grace_s must be >= 0, got {grace_s}")
    return world


def _worker_env(base: Mapping[str, str], rank: int, host: int, local: int, world: int, hosts: int,
                per_host: int, addr: str, port: int, host_id: str, ifname: str | None) -> dict[str, str]:
    env = dict(base)
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the prefixer as they are printed
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # N workers x all cores would oversubscribe
    env.update(
        RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_host),
        GROUP_RANK=str(host), NODE_RANK=str(host), GROUP_WORLD_SIZE=str(hosts),
        MASTER_ADDR=addr, MASTER_PORT=str(port), SHOAL_HOST_ID=host_id,
    )
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def launch(
    cmd: list[str],
    nprocs: int = 1,
    cluster: ClusterSpec | None = None,
    kill: Sequence[tuple[int, float]] = (),
    env: Mapping[str, str] | None = None,
    prefix_output: bool = True,
    stdout: TextIO | None = None,
    quiet: bool = False,
    *,
    tolerate_kills: bool = False,
    grace_s: float = 5.0,
    elastic: ElasticLaunch | None = None,
    nodes: NodeSpec | None = None,
) -> LaunchResult:
    """Run ``cmd`` once per rank and wait for all; see the module docstring for the policy.

    Args:
        cmd: the worker's argv, e.g. ``[sys.executable, "train.py", "--lr", "0.1"]``.
        nprocs: workers on this machine when ``cluster`` is ``None``. With a
            cluster the world is ``hosts * procs_per_host`` and ``nprocs``
            must be 1 (the default) or equal to it.
        cluster: run on an emulated cluster (root only); ranks are laid out
            host by host: host ``h`` holds ranks ``h*P .. h*P+P-1``.
        kill: ``(rank, seconds)`` pairs: SIGKILL that rank that many seconds
            after the start.
        env: variables added to the launcher's environment for the workers
            (the torchrun variables always win).
        prefix_output: prefix each output line with ``[rank] ``; False passes
            output through untouched (inherited file descriptors when
            ``stdout`` is None).
        stdout: where worker output goes (stdout and stderr both); None:
            worker stdout to ``sys.stdout``, stderr to ``sys.stderr``.
        quiet: silence the launcher's own ``[shoal run]`` messages.
        tolerate_kills: an injected kill does not stop the run nor decide
            its exit code.
        grace_s: seconds between SIGTERM and SIGKILL when stopping workers.
        elastic: run elastically (:mod:`shoal.cli.elastic_launch`): an
            embedded coordinator (``SHOAL_COORDINATOR``, ``SHOAL_RUN_ID``,
            ``SHOAL_MIN_WORKERS``, ``SHOAL_TOKEN`` in each worker's
            environment; see :class:`~shoal.cli.elastic_launch.ElasticLaunch`
            for where the token comes from), crashed
            workers restarted, joiners started. With ``cluster`` the
            coordinator runs inside host 0's namespace (the hosts cannot
            reach the launcher's), restarts stay on their host and joiners
            are placed round-robin over the hosts.
        nodes: this machine's place in a run launched on several machines
            (:mod:`shoal.cli.nodes`): static runs meet the other launchers
            at ``nodes.master_addr`` first and take their ranks from the
            layout; elastic runs need ``elastic.coordinator`` and label their
            workers ``local * nnodes + node_rank``. gloo (and NCCL, with
            ``advertise_addr``) use the interface of the advertised address.

    Ctrl-C or SIGTERM to the launcher (main thread) stops every worker,
    removes the emulated cluster and returns ``128 + signal``.

    Example::

        res = launch([sys.executable, "-c", "import os; print(os.environ['RANK'])"], nprocs=2)
        assert res.returncode == 0      # prints "[0] 0" and "[1] 1"
    """
    world = _validate(cmd, nprocs, cluster, kill, grace_s)
    if nodes is not None and elastic is None:
        return _launch_node(cmd, nprocs, nodes, kill, env, prefix_output, stdout, quiet, tolerate_kills, grace_s)
    output = _Output(stdout, prefix_output)
    sup = _Supervisor(kill, tolerate_kills, grace_s, output, quiet)
    base_env = {**os.environ, **(env or {})}
    if nodes is not None:
        if cluster is not None:
            raise ConfigError("--hosts emulates every machine of a run on this one; a run across machines "
                              "(--nnodes/--node-rank) starts one launcher on each machine instead: use one or the other")
        base_env = _elastic_node_env(base_env, nodes, elastic)
    host_bytes: list[dict[str, int]] | None = None
    if elastic is not None and cluster is not None and elastic.coordinator is not None:
        raise ConfigError(
            f"a coordinator address ({elastic.coordinator}) cannot be used on an emulated cluster: its hosts "
            "reach only addresses inside the run's own namespaces; leave the coordinator out and shoal run "
            "starts one inside host 0's namespace"
        )
    with ExitStack() as stack:
        if elastic is not None:
            sup = ElasticSupervisor(elastic, list(kill), grace_s, output, quiet)
            stack.callback(sup.remove_state_cache)   # after the workers were stopped (the finally below)
            if nodes is not None:  # RANK labels a worker in elastic runs: unique across machines
                sup.label = _interleave(nodes)
                sup.across_machines = True
        stack.enter_context(_trap_signals(sup.signals))
        emu = stack.enter_context(EmulatedCluster(cluster)) if cluster is not None else None
        ready: Callable[[], None] = lambda: None
        if elastic is not None:
            env_add, ready = _elastic_env(stack, elastic, world, emu, base_env, sup)
            base_env.update(env_add)
        t0 = time.monotonic()
        try:
            _start_all(sup, list(cmd), world, emu, base_env, nodes)
            ready()  # a coordinator in a namespace starts alongside the workers
            sup.supervise()
        finally:
            sup.stop()  # no-op after a normal supervise(); kills all after an exception
        duration = time.monotonic() - t0
        if emu is not None:
            host_bytes = emu.host_bytes()
    return LaunchResult(sup.result_code, duration, host_bytes, sup.failed_rank, interrupted=bool(sup.signals))


def _elastic_env(stack: ExitStack, spec: ElasticLaunch, world: int, emu: EmulatedCluster | None,
                 base_env: dict[str, str], sup: _Supervisor) -> tuple[dict[str, str], Callable[[], None]]:
    """The workers' elastic variables, and a check that the coordinator serves (raises if not).

    Unemulated, the coordinator is a thread of the launcher on 127.0.0.1. On an
    emulated cluster it is a ``shoal coordinator`` process inside host 0's
    namespace, on host 0's address, the only place every host can reach.
    """
    import uuid

    from shoal.membership.coordinator import Coordinator

    address, ready = spec.coordinator, (lambda: None)
    token = spec.resolve_token(base_env)
    if address is None and emu is not None:
        nc = NamespacedCoordinator(emu, host=0, initial_workers=world, env=base_env,
                                   on_line=lambda line: sup.note(f"coordinator: {line}"), token=token)
        stack.callback(nc.close)
        nc.start(wait=False)  # its start-up (a torch import) overlaps the workers'
        address, ready = nc.address, nc.wait_ready
    elif address is None:
        coord = Coordinator(port=0, initial_workers=world, token=token).start()
        stack.callback(coord.stop)
        address = coord.address
    env = {"SHOAL_COORDINATOR": address, "SHOAL_MIN_WORKERS": str(spec.min_workers), "SHOAL_TOKEN": token,
           "SHOAL_RUN_ID": base_env.get("SHOAL_RUN_ID") or uuid.uuid4().hex[:12]}
    # This launcher's own id in the workers' run marks: a machine's launcher started again in the same run
    # (a re-created pod, a spot machine back) counts lives from 0 again, and must not read the old ones' marks.
    env["SHOAL_LAUNCH_ID"] = uuid.uuid4().hex[:8]
    if emu is None and isinstance(sup, ElasticSupervisor):   # (a namespace's address is out of our reach)
        try:
            sup.end = RunEnd(address, env["SHOAL_RUN_ID"], env["SHOAL_LAUNCH_ID"])
        except Exception as e:  # noqa: BLE001 - the run still works; only its end is not seen
            sup.note(f"cannot read the run's end from the coordinator at {address} ({e}); a worker that "
                     "crashes after finishing will be restarted")
    return env, ready


def _start_all(sup: _Supervisor, cmd: list[str], world: int, emu: EmulatedCluster | None,
               base_env: dict[str, str], nodes: NodeSpec | None = None) -> None:
    """Start the workers of this launch (an elastic machine of a run across machines: labels offset by node)."""
    hosts = emu.spec.hosts if emu else (nodes.nnodes if nodes else 1)
    per_host = emu.spec.procs_per_host if emu else world
    addr = emu.address(0) if emu else "127.0.0.1"
    port = 29500 if emu else _free_port()  # a fresh namespace has every port free
    host_id = base_env.get("SHOAL_HOST_ID") or socket.gethostname() if nodes else socket.gethostname()
    for rank in range(world):
        if sup.signals:
            return
        host, local = divmod(rank, per_host)
        env = _worker_env(base_env, rank, host, local, world, hosts, per_host, addr, port,
                          emu.namespace(host) if emu else host_id, emu.interface(host) if emu else None)
        if nodes is not None:  # RANK labels a worker in elastic runs: unique across machines
            env.update(RANK=str(_interleave(nodes)(rank)), GROUP_RANK=str(nodes.node_rank),
                       NODE_RANK=str(nodes.node_rank), SHOAL_SLOTS_INTERLEAVED=str(nodes.nnodes))
        argv = (emu.exec_prefix(host) if emu else []) + cmd
        sup.start(argv, env, rank, host, local)


class _NodeSupervisor(_Supervisor):
    """The static failure policy across machines: a failure anywhere stops every machine's workers."""

    def __init__(self, rdzv: NodeRendezvous, kill: Sequence[tuple[int, float]], tolerate_kills: bool,
                 grace_s: float, output: _Output, quiet: bool) -> None:
        super().__init__(kill, tolerate_kills, grace_s, output, quiet)
        self.rdzv = rdzv
        self._next_poll = 0.0

    def on_exit(self, w: _Worker) -> bool:
        stop = super().on_exit(w)
        if stop:
            self.rdzv.fail(f"{self.result_code}:node {self.rdzv.spec.node_rank} rank {w.rank} exited with code "
                           f"{w.code}")
        return stop

    def on_tick(self, elapsed: float) -> None:
        if elapsed < self._next_poll:
            return
        self._next_poll = elapsed + 0.5
        self.rdzv.beat()
        why = self.rdzv.failure()
        if why is not None and self.failed_rank is None:
            code, _, msg = why.partition(":")
            self.failed_rank, self.result_code = -1, int(code) if code.isdigit() else 1
            self.rdzv.acknowledge()
            self.note(f"{msg or code}; stopping this machine's workers")
            self.stop()


def _interleave(spec: NodeSpec) -> Callable[[int], int]:
    """Worker ``i`` of node ``r`` is labelled ``i * nnodes + r``: unique however many workers a machine starts."""
    return lambda i: i * spec.nnodes + spec.node_rank


def _node_env(base: Mapping[str, str], layout: NodeLayout, nccl: bool) -> dict[str, str]:
    """The variables every worker of this machine shares in a run across machines.

    gloo is pointed at the advertised address's interface (it would otherwise use the hostname's address,
    often 127.0.1.1); NCCL only when ``--advertise-addr`` chose it (NCCL's own choice of interface already
    avoids lo and docker, and may pick a faster network than the route to the master).
    """
    env = dict(base)
    env.setdefault("SHOAL_HOST_ID", socket.gethostname())
    if layout.interface is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", layout.interface)
        if nccl:
            env.setdefault("NCCL_SOCKET_IFNAME", layout.interface)
    env["SHOAL_ADVERTISE_ADDR"] = layout.address
    return env


def _elastic_node_env(base: dict[str, str], spec: NodeSpec, elastic: ElasticLaunch | None) -> dict[str, str]:
    """An elastic machine of a run across machines: no launcher rendezvous (machines come and go), the
    coordinator every machine reaches, and the interface of the route towards it."""
    if elastic is None or elastic.coordinator is None:
        raise ConfigError("an elastic run across machines needs a coordinator every machine reaches: start "
                          "`shoal coordinator` on one of them and pass --coordinator HOST:PORT to every launcher")
    host, _, port = elastic.coordinator.rpartition(":")
    addr = socket.gethostbyname(spec.advertise_addr) if spec.advertise_addr else route_address(host, int(port))
    env = _node_env(base, NodeLayout(0, 0, addr, interface_of(addr)), nccl=spec.advertise_addr is not None)
    env.setdefault("SHOAL_RUN_ID", spec.run_id)  # every machine's launcher must name the same run
    return env


def _launch_node(cmd: list[str], nprocs: int, spec: NodeSpec, kill: Sequence[tuple[int, float]],
                 env: Mapping[str, str] | None, prefix_output: bool, stdout: TextIO | None, quiet: bool,
                 tolerate_kills: bool, grace_s: float) -> LaunchResult:
    """One machine's share of a run launched on several machines (see :mod:`shoal.cli.nodes`)."""
    output = _Output(stdout, prefix_output)
    base_env = {**os.environ, **(env or {})}
    signals: list[int] = []
    rdzv = NodeRendezvous(spec, nprocs, interrupted=lambda: bool(signals))
    sup = _NodeSupervisor(rdzv, kill, tolerate_kills, grace_s, output, quiet)
    sup.signals = signals
    t0 = time.monotonic()
    with ExitStack() as stack:
        stack.enter_context(_trap_signals(sup.signals))
        try:
            layout = rdzv.join()
        except ShoalError:
            if signals:  # interrupted while meeting the others: the signal decides the exit code
                sup.note(f"got signal {signals[0]} while waiting for the other machines")
                return LaunchResult(128 + signals[0], time.monotonic() - t0, None, None, interrupted=True)
            raise
        if not quiet:
            sup.note(f"node {spec.node_rank}/{spec.nnodes}: ranks {layout.rank_offset}.."
                     f"{layout.rank_offset + nprocs - 1} of {layout.world_size}, advertising {layout.address}"
                     + (f" on {layout.interface}" if layout.interface else ""))
        base = _node_env(base_env, layout, nccl=spec.advertise_addr is not None)
        base["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the workers meet on this launcher's store, as under torchrun
        try:
            for local in range(nprocs):
                if sup.signals:
                    break
                rank = layout.rank_offset + local
                wenv = _worker_env(base, rank, spec.node_rank, local, layout.world_size, spec.nnodes, nprocs,
                                   spec.master_addr, spec.master_port, base["SHOAL_HOST_ID"], None)
                sup.start(list(cmd), wenv, rank, spec.node_rank, local)
            sup.supervise()
        finally:
            sup.stop()
            if signals and sup.failed_rank is None:  # Ctrl-C here stops every machine, not only this one
                rdzv.fail(f"{128 + signals[0]}:node {spec.node_rank}'s launcher got signal {signals[0]}")
            rdzv.finish(sup.result_code, sup.note)
    return LaunchResult(sup.result_code, time.monotonic() - t0, None, sup.failed_rank, interrupted=bool(sup.signals))
