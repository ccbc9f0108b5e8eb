"""Code above the transport asks a group's steps, never what kind of group it is (issue 19's figures).

An AST scan of ``shoal/`` outside ``comm/`` and ``membership/``:

- ``.traits`` is read only in the functions that refuse a kind of group
  (each listed here with the refusal it makes); behaviour asks
  :mod:`shoal.comm.asks` instead;
- no function writes its own vote (``begin_step()`` and ``commit()`` in one
  function) except the round runner: a strategy synchronises through typed
  rounds (:mod:`shoal.strategies.rounds`).
"""

from __future__ import annotations

import ast
from pathlib import Path

SHOAL = Path(__file__).resolve().parents[2] / "shoal"
BELOW = ("comm", "membership")

# (module, function): the refusal that reads the traits
REFUSALS = {
    ("optim/zero.py", "__init__"): "replicate=True needs an elastic group",
    ("optim/zero.py", "add_param_group"): "no add_param_group on an elastic group",
    ("parallel.py", "__init__"): "DDP's join() refused on an elastic group (read by ddp_join.py)",
    ("parallel.py", "register_comm_hook"): "no comm hook on an elastic group",
    ("codecs/hierarchical.py", "setup"): "an elastic group's layout is per quorum: attach instead",
    ("strategies/localsgd.py", "setup"): "slot groups refused across machines (check_slot)",
}


def _functions(path: Path) -> list[tuple[str, ast.AST]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(n.name, n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SHOAL.rglob("*.py")):
        rel = path.relative_to(SHOAL).as_posix()
        if not rel.startswith(tuple(f"{b}/" for b in BELOW)):
            out.append((rel, path))
    return out


def _reads_traits(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "traits" for n in ast.walk(fn))


def _calls(fn: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
               for n in ast.walk(fn))


def _innermost(path: Path) -> list[tuple[str, ast.AST]]:
    """Functions with their own bodies only (a nested function is scanned as itself, not in its parent)."""
    out = []
    for name, fn in _functions(path):
        body = ast.Module(body=[s for s in getattr(fn, "body", [])
                                if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))], type_ignores=[])
        out.append((name, body))
    return out


def test_traits_are_read_above_the_transport_only_where_a_feature_refuses() -> None:
    found = {(rel, name) for rel, path in _modules() for name, fn in _innermost(path) if _reads_traits(fn)}
    assert found <= set(REFUSALS), f"traits read outside a refusal (ask shoal.comm.asks): {sorted(found - set(REFUSALS))}"
    assert len(found) <= 6


def test_no_hand_written_vote_outside_the_round_runner() -> None:
    votes = [(rel, name) for rel, path in _modules() if rel != "strategies/rounds.py"
             for name, fn in _innermost(path) if _calls(fn, "begin_step") and _calls(fn, "commit")]
    assert votes == [], f"begin_step(); ... commit() written by hand (use Rounds / run_round): {votes}"


def _group_calls(fn: ast.AST, names: tuple[str, ...]) -> list[str]:
    """``<...group>.begin_step()`` / ``<...group>.commit()`` calls in ``fn`` (a group's step, by hand)."""
    found = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names:
            receiver = ast.unparse(n.func.value)
            if receiver.rstrip("_").endswith("group"):
                found.append(f"{receiver}.{n.func.attr}()")
    return found


def test_no_strategy_begins_or_votes_a_step_by_hand() -> None:
    # Stricter than a vote in one function: a step begun in one method and voted in another (NonBlocking's
    # forward and its exchange, its blocking fall-back) is a hand-written vote too; the runner does both.
    found = [(rel, name, call) for rel, path in _modules()
             if rel.startswith(("strategies/", "collaborative/")) and rel != "strategies/rounds.py"
             for name, fn in _innermost(path) for call in _group_calls(fn, ("begin_step", "commit"))]
    assert found == [], f"a strategy begins or votes a group's step by hand (use Rounds.run/launch/land): {found}"
