"""The house rule "mypy clean on shoal/" is checked, not hoped for; shoal.comm and shoal.membership are held
to what `mypy --strict` checks (issue 19), in the same run."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRICT_PACKAGES = ("shoal.comm", "shoal.membership")
GLOBAL_ONLY = {"warn_redundant_casts"}   # of --strict's flags, the one mypy takes for a whole run only


def _strict_flags() -> dict[str, bool]:
    """The options `mypy --strict` enables, read from this mypy's own --help (a flag a later mypy adds to
    --strict is then required here too): ``--no-implicit-reexport`` is ``implicit_reexport = False``."""
    out = subprocess.run([sys.executable, "-m", "mypy", "--help"], capture_output=True, text=True).stdout
    m = re.search(r"--strict\s+Strict mode; enables the following flags:(.*?)\n  --", out, re.S)
    assert m, "mypy --help no longer lists --strict's flags"
    text = re.sub(r"-\n\s+", "-", m.group(1))   # flags wrapped at a hyphen
    flags = re.findall(r"--([a-z][a-z-]*)", text)
    assert len(flags) >= 10, flags
    return {f[3:].replace("-", "_") if f.startswith("no-") else f.replace("-", "_"): not f.startswith("no-")
            for f in flags}


def _imported_shoal_modules() -> set[str]:
    """The shoal modules outside the two packages that their code imports."""
    found = set()
    for pkg in STRICT_PACKAGES:
        for path in (Path(ROOT) / pkg.replace(".", "/")).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                found |= {n for n in names if n == "shoal" or n.startswith("shoal.")}
    return {n for n in found if not n.startswith(STRICT_PACKAGES)}


def test_the_transport_and_membership_are_configured_strict() -> None:
    """One `mypy shoal` run checks both rules (a second `mypy --strict` run cost ~25 s of the suite). So the
    configuration must keep every strict flag on both packages, and --no-implicit-reexport on every module
    they import names from (it binds the exporting module); torch's untyped API is allowed per module in
    pyproject.toml, never by a blanket ignore. Checked against the separate run it replaces (`mypy --strict
    --follow-imports=silent shoal/comm shoal/membership`): an untyped def, a bare dict, an Any returned and
    an untyped call put into shoal.membership gave the same four errors in both."""
    pytest.importorskip("mypy")
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["mypy"]
    strict = _strict_flags()
    for flag in GLOBAL_ONLY & strict.keys():
        assert cfg.get(flag) is strict[flag], (flag, cfg)
    held = [o for o in cfg["overrides"] if {f"{p}.*" for p in STRICT_PACKAGES} <= set(o["module"])]
    assert len(held) == 1, "one override holds shoal.comm and shoal.membership to the strict flags"
    assert set(STRICT_PACKAGES) <= set(held[0]["module"]), held[0]   # the packages' __init__ too
    per_module = {k: v for k, v in strict.items() if k not in GLOBAL_ONLY}
    assert {k: held[0].get(k) for k in per_module} == per_module, held[0]
    exporters = {m for o in cfg["overrides"] if o.get("implicit_reexport") is False for m in o["module"]}
    assert {"torch", "torch.*"} <= exporters, exporters
    assert _imported_shoal_modules() <= exporters, "add these to the implicit_reexport = false override"


@pytest.mark.timeout(240)
def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "shoal"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
