"""The layers of shoal/ depend downward only: no import circle (typing-only imports included), and the
transport (shoal.comm) never imports the membership package above it. An AST scan of the source, so a
circle hidden behind ``if TYPE_CHECKING:`` or inside a function counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "shoal"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every shoal module ``path`` imports, anywhere in the file (a package import names its __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:     # ``from shoal.comm import Group`` names shoal.comm
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(p, m, known) for m, p in mods.items()}
    # A package's own __init__ importing its submodules is how packages re-export: not a layer edge.
    return {m: {t for t in deps if not t.startswith(m + ".")} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_scan_sees_typing_only_and_function_level_imports(tmp_path: Path) -> None:
    """The checker itself: a circle through a TYPE_CHECKING import is found."""
    graph = {"a": {"b"}, "b": {"a"}}
    assert _cycle(graph) == ["a", "b", "a"]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shoal.comm.group import Group\n"
    (tmp_path / "m.py").write_text(src)
    assert _imports(tmp_path / "m.py", "shoal.comm.x", {"shoal.comm.group", "shoal.comm"}) == {"shoal.comm.group"}


def test_shoal_has_no_import_circle_at_all() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("lower,upper", [("shoal.comm", "shoal.membership")])
def test_the_transport_never_imports_membership(lower: str, upper: str) -> None:
    bad = {m: sorted(t for t in deps if t == upper or t.startswith(upper + "."))
           for m, deps in _graph().items() if m == lower or m.startswith(lower + ".")}
    assert not {m: d for m, d in bad.items() if d}, bad
