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


def _interface_members() -> set[str]:
    """The names of the step interface (``StepInterface``'s members)."""
    tree = ast.parse((SHOAL / "comm" / "stepping.py").read_text())
    proto = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepInterface")
    return {n.name for n in proto.body if isinstance(n, ast.FunctionDef)}


def _body(fn: ast.FunctionDef) -> str:
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and \
        isinstance(fn.body[0].value, ast.Constant) and isinstance(fn.body[0].value.value, str) else fn.body
    return ast.unparse(ast.Module(body=body, type_ignores=[]))


def test_the_step_interface_answers_are_written_once() -> None:
    # A default answer (e.g. "every member counts") written in two groups drifts apart; each answer is
    # written in one place (Group's static ones, or StepHooks that every group calls; abstract
    # declarations and protocols are not answers).
    names, seen, twice = _interface_members(), {}, []
    for base in BELOW:
        for path in sorted((SHOAL / base).glob("*.py")):
            for cls in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
                if any(isinstance(b, ast.Name) and b.id == "Protocol" for b in cls.bases):
                    continue
                for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names):
                    if any(isinstance(d, ast.Attribute) and d.attr == "abstractmethod" for d in fn.decorator_list):
                        continue
                    if _body(fn).startswith("self.hooks.") and "\n" not in _body(fn):
                        continue   # a call of the one shared registry (StepHooks), where the answer is written
                    where = f"{base}/{path.name}:{cls.name}.{fn.name}"
                    other = seen.setdefault((fn.name, _body(fn)), where)
                    if other != where:
                        twice.append((other, where))
    assert twice == [], f"the same step-interface answer written twice (keep it in one place): {twice}"


def test_no_duck_typed_read_of_the_step_interface() -> None:
    # getattr(group, "step", default) guesses what kind of group it has; every group answers the interface.
    names = _interface_members()
    found = []
    for rel, path in _modules():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value in names \
                    and "group" in ast.unparse(n.args[0]):
                found.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert found == [], f"duck-typed reads of the step interface (use the interface): {found}"


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
