"""`shoal run`: a torchrun-compatible launcher, optionally on an emulated cluster.

Examples::

    shoal run -n 4 train.py --lr 0.1
    shoal run -m mypkg.train --epochs 3
    shoal run --hosts 4 --procs-per-host 2 --bandwidth 100mbit train.py
    shoal run --hosts 3 --bandwidth 1gbit,100mbit,20mbit train.py
    shoal run -n 2 --kill 1@5 train.py
    shoal run --cleanup
"""

from __future__ import annotations

import argparse
import sys

from shoal.cli.cluster import ClusterSpec, cleanup_stale
from shoal.cli.launcher import LaunchResult, launch
from shoal.errors import ShoalError

_EPILOG = """\
environment of each worker (as torchrun): RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK/NODE_RANK (host index), GROUP_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; plus SHOAL_HOST_ID (names the host) and, on an
emulated cluster, GLOO_SOCKET_IFNAME.

emulated cluster (root, `ip` and `tc` needed): --hosts H network namespaces
joined by a bridge; each host's link is shaped to its --bandwidth in both
directions (tc tbf). Ranks of one host talk over loopback. Bandwidth: one
value for all hosts, or one per host as a comma-separated list or by
repeating the flag; tc units (bit, kbit, mbit, gbit; bps, kbps, mbps = bytes/s).

failures: when a worker exits non-zero the others get SIGTERM (SIGKILL after
--grace seconds) and shoal run exits with that worker's code (128+N for a
worker killed by signal N). --kill RANK@SECONDS SIGKILLs a rank at that time;
it fails the run like any crash unless --tolerate-kills is given.
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
    p.add_argument("--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL (default 5)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]")
    p.add_argument("--quiet", action="store_true", help="silence shoal run's own messages")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces and links left by crashed runs, then exit")
    p.add_argument("-m", dest="module", default=None, help="run a module as `python -m` does")
    p.add_argument("script", nargs="?", help="the Python script each worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _parse_kill(item: str) -> tuple[int, float]:
    rank, sep, at = item.partition("@")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(at)
    except ValueError:
        raise ShoalError(f"--kill expects RANK@SECONDS such as 1@5.0, got {item!r}") from None


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


def _report_bytes(res: LaunchResult, spec: ClusterSpec) -> None:
    if res.host_bytes is None:
        return
    print(f"[shoal run] bytes on each emulated host's link ({res.duration_s:.1f} s):", file=sys.stderr)
    for h, b in enumerate(res.host_bytes):
        rate = f" @ {spec.bandwidth[h]}" if spec.bandwidth else ""
        print(f"[shoal run]   host {h}{rate}: sent {b['sent']:,} B, received {b['received']:,} B", file=sys.stderr)


def main(argv: list[str]) -> int:
    """Entry point of `shoal run`; returns the exit code (see --help)."""
    ns = _parser().parse_args(argv)
    try:
        if ns.cleanup:
            removed = cleanup_stale()
            print(f"removed {len(removed)} namespace(s){': ' + ', '.join(removed) if removed else ''}")
            return 0
        if ns.module is not None:
            cmd = [sys.executable, "-m", ns.module] + ([ns.script] if ns.script else []) + ns.args
        elif ns.script is not None:
            cmd = [sys.executable, ns.script] + ns.args
        else:
            raise ShoalError("nothing to run: give a script (shoal run -n 2 train.py) or -m module")
        spec = _cluster(ns)
        res = launch(cmd, nprocs=ns.nprocs or 1, cluster=spec, kill=[_parse_kill(k) for k in ns.kill],
                     prefix_output=not ns.no_prefix, quiet=ns.quiet, tolerate_kills=ns.tolerate_kills,
                     grace_s=ns.grace)
    except ShoalError as e:
        print(f"shoal run: error: {e}", file=sys.stderr)
        return 2
    if spec is not None and not ns.quiet:
        _report_bytes(res, spec)
    return res.returncode
