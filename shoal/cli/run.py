"""`shoal run`: a torchrun-compatible launcher, optionally on an emulated cluster.

Examples::

    shoal run -n 4 train.py --lr 0.1
    shoal run -m mypkg.train --epochs 3
    shoal run --hosts 4 --procs-per-host 2 --bandwidth 100mbit train.py
    shoal run --hosts 3 --bandwidth 1gbit,100mbit,20mbit train.py
    shoal run -n 2 --kill 1@5 train.py
    shoal run -n 4 --elastic --min-workers 2 --max-restarts 3 --kill 1@10 --join @30 train.py
    SHOAL_TOKEN=... shoal run -n 2 --elastic --coordinator 10.0.0.1:29400 train.py
    shoal run --hosts 4 --bandwidth 20mbit --elastic --min-workers 2 --kill 1@30 train.py
    shoal run --nnodes 2 --node-rank 0 -n 4 --master-addr 10.0.0.1 train.py    # on each machine
    SHOAL_TOKEN=... shoal run --nnodes 2 --node-rank 1 --run-id run7 -n 2 --elastic --coordinator 10.0.0.1:29400 train.py
    shoal run --cleanup
"""

from __future__ import annotations

import argparse
import sys

from shoal.cli.cluster import ClusterSpec, cleanup_stale
from shoal.cli.elastic_launch import ElasticLaunch
from shoal.cli.launcher import LaunchResult, launch
from shoal.cli.nodes import NodeSpec
from shoal.errors import ShoalError

_EPILOG = """\
environment of each worker (as torchrun): RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK/NODE_RANK (host index), GROUP_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; plus SHOAL_HOST_ID (names the host) and, on an
emulated cluster, GLOO_SOCKET_IFNAME.

several machines (docs/multinode.md): one `shoal run` on each machine with
--nnodes N --node-rank R --master-addr HOST [--master-port PORT] (torchrun's
names). Static runs meet at HOST:PORT (node 0's launcher serves it) before any
worker starts, check that they agree (--nnodes, --run-id, one launcher per node
rank) and that every machine's advertised address (--advertise-addr, else the
local address of the route to HOST) is reachable from the others, then lay
ranks out node by node; a failed worker anywhere stops all machines. Elastic
runs across machines give every launcher --coordinator HOST:PORT (a
`shoal coordinator`) and the token; machines may start at different times and
come and go, and --node-rank keeps their workers' RANK labels apart.

emulated cluster (root, `ip` and `tc` needed): --hosts H network namespaces
joined by a bridge; each host's link is shaped to its --bandwidth in both
directions (tc tbf). Ranks of one host talk over loopback. Bandwidth: one
value for all hosts, or one per host as a comma-separated list or by
repeating the flag; tc units (bit, kbit, mbit, gbit; bps, kbps, mbps = bytes/s).

failures: when a worker exits non-zero the others get SIGTERM (SIGKILL after
--grace seconds) and shoal run exits with that worker's code (128+N for a
worker killed by signal N). --kill RANK@SECONDS SIGKILLs a rank at that time;
it fails the run like any crash unless --tolerate-kills is given.

elastic (--elastic): a coordinator runs inside shoal run (with --hosts: inside
host 0's namespace; else use --coordinator HOST:PORT of `shoal coordinator`); workers get SHOAL_COORDINATOR, SHOAL_RUN_ID
and SHOAL_MIN_WORKERS and build shoal.elastic.ElasticGroup(). Every worker
proves the run token when it joins (SHOAL_TOKEN in its environment): --token,
else $SHOAL_TOKEN, else (embedded coordinator only) a fresh random token; with
--coordinator give the token that coordinator was started with. A crashed or
killed worker is restarted (same RANK, SHOAL_RESTART incremented) up to
--max-restarts times and heals from a live peer; --join @SECONDS starts one
more worker then. The run goes on while --min-workers workers live.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shoal run", description="Start N workers with the torchrun environment.",
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc-per-node", "--nprocs", dest="nprocs", type=int, default=None,
                   help="workers on this machine (with --hosts: the total, must equal H x P)")
    p.add_argument("--hosts", type=int, default=None, help="emulate H hosts (root only)")
    p.add_argument("--procs-per-host", type=int, default=None, help="workers per emulated host (default 1)")
    p.add_argument("--bandwidth", action="append", default=[], metavar="RATE[,RATE...]",
                   help="per-host link rate, e.g. 100mbit (default: unshaped)")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@SECONDS",
                   help="SIGKILL RANK after SECONDS (repeatable)")
    p.add_argument("--tolerate-kills", action="store_true",
                   help="a --kill does not stop the other workers nor fail the run")
    p.add_argument("--elastic", action="store_true",
                   help="elastic run: embedded coordinator, crashed workers restarted and healed")
    p.add_argument("--min-workers", type=int, default=None, help="elastic: fewest live workers (default 1)")
    p.add_argument("--max-restarts", type=int, default=None, help="elastic: restarts per rank (default 3)")
    p.add_argument("--join", action="append", default=[], metavar="@SECONDS",
                   help="elastic: start one more worker after SECONDS (repeatable)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="elastic: use this standalone coordinator (`shoal coordinator`) instead of an embedded one")
    p.add_argument("--token", default=None,
                   help="elastic: the run token (default $SHOAL_TOKEN; else a fresh one for the embedded "
                        "coordinator); visible in `ps`, so prefer $SHOAL_TOKEN on shared machines")
    p.add_argument("--state-cache", default=None, metavar="DIR",
                   help="elastic: each worker slot keeps its copy of the averaged state (DiLoCo, streaming "
                        "DiLoCo) in a file in DIR, e.g. /dev/shm, so that a restart on this machine downloads "
                        "only what changed (SHOAL_STATE_CACHE; needs SHOAL_HEAL=background); removed at the end")
    p.add_argument("--nnodes", type=int, default=None, help="machines in the run, one `shoal run` on each")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's index in [0, nnodes)")
    p.add_argument("--master-addr", default=None, help="node 0's address, reachable from every machine")
    p.add_argument("--master-port", type=int, default=None, help="the rendezvous port on node 0 (default 29500)")
    p.add_argument("--advertise-addr", default=None,
                   help="the address other machines reach this one on (default: the route towards the master "
                        "or coordinator); gloo and NCCL use its interface")
    p.add_argument("--run-id", default=None, help="the same on every machine of one run (default 'shoal')")
    p.add_argument("--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL (default 5)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]")
    p.add_argument("--quiet", action="store_true", help="silence shoal run's own messages")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces and links left by crashed runs, then exit")
    p.add_argument("-m", dest="module", default=None, help="run a module as `python -m` does")
    p.add_argument("script", nargs="?", help="the Python script each worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


_VALUE_OPTS = {"-n", "--nproc-per-node", "--nprocs", "--hosts", "--procs-per-host", "--bandwidth", "--kill", "--grace",
               "--min-workers", "--max-restarts", "--join", "--coordinator", "--token", "--state-cache", "--nnodes", "--node-rank",
               "--master-addr", "--master-port", "--advertise-addr", "--run-id"}


def _split_argv(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """``(launcher options, module, program argv)``: everything after the script
    (or ``-m MODULE``) belongs to the program, even if it looks like our options."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], None, argv[i + 1:]
        if a == "-m":
            if i + 1 >= len(argv):
                raise ShoalError("-m needs a module name")
            return argv[:i], argv[i + 1], argv[i + 2:]
        if a.startswith("-m") and not a.startswith("--"):
            return argv[:i], a[2:], argv[i + 1:]
        if not a.startswith("-"):
            return argv[:i], None, argv[i:]
        i += 2 if a in _VALUE_OPTS else 1
    return argv, None, []


def _parse_kill(item: str) -> tuple[int, float]:
    rank, sep, at = item.partition("@")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(at)
    except ValueError:
        raise ShoalError(f"--kill expects RANK@SECONDS such as 1@5.0, got {item!r}") from None


def _elastic(ns: argparse.Namespace) -> ElasticLaunch | None:
    if not ns.elastic:
        if (ns.min_workers is not None or ns.max_restarts is not None or ns.join or ns.coordinator or ns.token
                or ns.state_cache):
            raise ShoalError("--min-workers, --max-restarts, --join, --coordinator, --token and --state-cache need "
                             "--elastic")
        return None
    joins = []
    for item in ns.join:
        try:
            joins.append(float(item.removeprefix("@")))
        except ValueError:
            raise ShoalError(f"--join expects @SECONDS such as @30, got {item!r}") from None
    if ns.coordinator is not None:
        host, sep, port = ns.coordinator.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ShoalError(f"--coordinator expects HOST:PORT such as 10.0.0.9:29400, got {ns.coordinator!r}")
    return ElasticLaunch(min_workers=1 if ns.min_workers is None else ns.min_workers,
                         max_restarts=3 if ns.max_restarts is None else ns.max_restarts,
                         joins=tuple(joins), coordinator=ns.coordinator, token=ns.token, state_cache=ns.state_cache)


def _cluster(ns: argparse.Namespace) -> ClusterSpec | None:
    rates = tuple(r.strip() for item in ns.bandwidth for r in item.split(",") if r.strip())
    if ns.hosts is None:
        if ns.procs_per_host is not None or rates:
            raise ShoalError("--procs-per-host and --bandwidth describe an emulated cluster: add --hosts H")
        return None
    if ns.hosts < 1:
        raise ShoalError(f"--hosts must be >= 1, got {ns.hosts}")
    per_host = ns.procs_per_host
    if per_host is None:
        if ns.nprocs is not None and ns.nprocs % ns.hosts:
            raise ShoalError(f"-n {ns.nprocs} does not divide over --hosts {ns.hosts}")
        per_host = ns.nprocs // ns.hosts if ns.nprocs else 1
    if ns.nprocs is not None and ns.nprocs != ns.hosts * per_host:
        raise ShoalError(f"-n {ns.nprocs} differs from --hosts {ns.hosts} x --procs-per-host {per_host}")
    return ClusterSpec(ns.hosts, per_host, rates)


def _nodes(ns: argparse.Namespace) -> NodeSpec | None:
    given = [f for f, v in (("--nnodes", ns.nnodes), ("--node-rank", ns.node_rank), ("--master-addr", ns.master_addr),
                            ("--master-port", ns.master_port), ("--advertise-addr", ns.advertise_addr),
                            ("--run-id", ns.run_id)) if v is not None]
    if not given:
        return None
    if ns.elastic:
        if ns.master_addr is not None or ns.master_port is not None:
            raise ShoalError("an elastic run across machines meets at its coordinator: give --coordinator "
                             "HOST:PORT instead of --master-addr/--master-port")
        if ns.nnodes is None and ns.node_rank is None and ns.advertise_addr is None:
            return None   # one machine's elastic run; --run-id reaches its workers through the launch env
        if ns.nnodes is None or ns.node_rank is None:
            raise ShoalError("an elastic run across machines needs both --nnodes (the most machines it will have) "
                             "and --node-rank (this machine's index) on every launcher: they keep the workers' "
                             "RANK labels apart")
        return NodeSpec(ns.nnodes, ns.node_rank, "coordinator", advertise_addr=ns.advertise_addr,
                        run_id=ns.run_id or "shoal")
    missing = [f for f, v in (("--nnodes", ns.nnodes), ("--node-rank", ns.node_rank),
                              ("--master-addr", ns.master_addr)) if v is None]
    if missing:
        raise ShoalError(f"a run across machines needs {', '.join(missing)} as well (given: {', '.join(given)}); "
                         "e.g. --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 on node 0")
    return NodeSpec(ns.nnodes, ns.node_rank, ns.master_addr, 29500 if ns.master_port is None else ns.master_port,
                    advertise_addr=ns.advertise_addr, run_id=ns.run_id or "shoal")


def _run_env(ns: argparse.Namespace) -> dict[str, str] | None:
    """Variables an explicit flag sets for the workers: they win over the exported environment
    (``--run-id X`` over an exported ``SHOAL_RUN_ID``), as a flag on the command line should."""
    return {"SHOAL_RUN_ID": ns.run_id} if ns.run_id is not None else None


def _report_bytes(res: LaunchResult, spec: ClusterSpec) -> None:
    if res.host_bytes is None:
        return
    print(f"[shoal run] bytes on each emulated host's link ({res.duration_s:.1f} s):", file=sys.stderr)
    for h, b in enumerate(res.host_bytes):
        rate = f" @ {spec.bandwidth[h]}" if spec.bandwidth else ""
        print(f"[shoal run]   host {h}{rate}: sent {b['sent']:,} B, received {b['received']:,} B", file=sys.stderr)


def main(argv: list[str]) -> int:
    """Entry point of `shoal run`; returns the exit code (see --help)."""
    try:
        own, module, program = _split_argv(argv)
    except ShoalError as e:
        print(f"shoal run: error: {e}", file=sys.stderr)
        return 2
    ns = _parser().parse_args(own)
    try:
        if ns.cleanup:
            removed = cleanup_stale()
            print(f"removed {len(removed)} namespace(s){': ' + ', '.join(removed) if removed else ''}")
            return 0
        if module is not None:
            cmd = [sys.executable, "-m", module] + program
        elif program:
            cmd = [sys.executable] + program
        else:
            raise ShoalError("nothing to run: give a script (shoal run -n 2 train.py) or -m module")
        spec = _cluster(ns)
        res = launch(cmd, nprocs=ns.nprocs or 1, cluster=spec, kill=[_parse_kill(k) for k in ns.kill],
                     prefix_output=not ns.no_prefix, quiet=ns.quiet, tolerate_kills=ns.tolerate_kills,
                     grace_s=ns.grace, elastic=_elastic(ns), nodes=_nodes(ns), env=_run_env(ns))
    except ShoalError as e:
        print(f"shoal run: error: {e}", file=sys.stderr)
        return 2
    if spec is not None and not ns.quiet:
        _report_bytes(res, spec)
    return res.returncode
