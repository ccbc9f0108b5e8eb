"""shoal.bench sits above shoal.cli: the bench uses the launcher, the CLI never imports the bench."""

from __future__ import annotations

import ast
import pathlib

import shoal


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_cli_never_imports_the_bench() -> None:
    cli = pathlib.Path(shoal.__file__).parent / "cli"
    offenders = {p.name: sorted(n for n in _imports(p) if n == "shoal.bench" or n.startswith("shoal.bench."))
                 for p in cli.glob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_bench_command_is_found_by_name() -> None:
    from shoal.cli.main import COMMANDS

    assert COMMANDS["bench"][0] == "shoal.bench.command"
