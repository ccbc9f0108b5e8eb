"""No code above the membership package opens or votes a step by hand: every ``begin_step()`` /
``commit()`` goes through the round runner's two primitives (:mod:`shoal.steps`), which the runner
(:mod:`shoal.strategies.rounds`) and the steps that are no round (DDP's forward, ZeRO, the elastic
sampler) call. An AST scan of the source, so a call in any form (``g.commit()``, ``self.group.commit()``,
the older names ``start_step`` / ``should_commit``) counts."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "shoal"

# Where a step may be opened or voted by hand: the groups themselves and the runner's primitives.
ALLOWED = ("shoal/comm/", "shoal/membership/", "shoal/steps.py")
STEP_CALLS = {"begin_step", "commit", "start_step", "should_commit"}
# Calls of the same name that are no group's: DASO's global sync object commits its own exchange.
NOT_A_GROUP = {("shoal/strategies/daso.py", "sync"), ("shoal/strategies/daso.py", "self._ready()")}


def vote_sites(root: Path) -> list[str]:
    """``path:line: receiver.method()`` for every hand-written step call outside :data:`ALLOWED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in STEP_CALLS):
                continue
            receiver = ast.unparse(node.func.value)
            if (rel, receiver) not in NOT_A_GROUP:
                found.append(f"{rel}:{node.lineno}: {receiver}.{node.func.attr}()")
    return found


def test_the_scan_finds_a_hand_written_vote(tmp_path: Path) -> None:
    """The checker itself: each form of a hand-written step call is found; the primitives' file is not."""
    pkg = tmp_path / "shoal"
    (pkg / "optim").mkdir(parents=True)
    (pkg / "optim" / "x.py").write_text("def f(self, g):\n    g.begin_step()\n    if self.group.commit():\n"
                                        "        pass\n    g.should_commit()\n")
    (pkg / "steps.py").write_text("def vote_step(group):\n    return group.commit()\n")
    assert vote_sites(pkg) == ["shoal/optim/x.py:2: g.begin_step()", "shoal/optim/x.py:3: self.group.commit()",
                               "shoal/optim/x.py:5: g.should_commit()"]


def test_no_hand_written_vote_site_outside_the_runner() -> None:
    sites = vote_sites(ROOT)
    assert sites == [], ("open and vote steps with shoal.steps.open_step / vote_step (or a Round run by "
                         "shoal.strategies.rounds), not by hand:\n" + "\n".join(sites))
