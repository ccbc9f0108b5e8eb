"""Entry point of the `shoal` command; each subcommand lives in its own module.

Subcommand modules are imported only when used, so `shoal run` does not pay
for importing the benchmark's plotting stack. ``shoal bench`` lives in
:mod:`shoal.bench.command`: the bench is built on this package's launcher
(bench -> cli), so nothing here imports the bench; the table names it.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("shoal.cli.run", "start N workers (optionally on an emulated cluster)"),
    "bench": ("shoal.bench.command", "train real tasks with chosen strategies and compare them"),
    "coordinator": ("shoal.cli.coordinator", "serve membership and quorums for elastic runs"),
}


def _usage() -> str:
    lines = ["usage: shoal <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`shoal <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from shoal import __version__

        print(f"shoal {__version__}")
        return 0
    if args[0] not in COMMANDS:
        print(f"shoal: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)
