"""The house rule "mypy clean on shoal/" is checked, not hoped for; shoal.comm and shoal.membership are held
to what `mypy --strict` checks (issue 19), in the same run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every flag of `mypy --strict` that mypy takes per module (the two it takes only globally,
# warn_redundant_casts and warn_unused_configs, are set for all of shoal).
STRICT = {"disallow_any_generics": True, "disallow_subclassing_any": True, "disallow_untyped_calls": True,
          "disallow_untyped_defs": True, "disallow_incomplete_defs": True, "check_untyped_defs": True,
          "disallow_untyped_decorators": True, "warn_unused_ignores": True, "warn_return_any": True,
          "implicit_reexport": False, "strict_equality": True, "extra_checks": True}


def test_the_transport_and_membership_are_configured_strict() -> None:
    """One `mypy shoal` run checks both rules (a second `mypy --strict` run cost ~25 s of the suite). So the
    configuration must keep every strict flag on both packages; torch's untyped API is allowed per module
    in pyproject.toml, never by a blanket ignore. Checked against the separate run it replaces (`mypy --strict
    --follow-imports=silent shoal/comm shoal/membership`): an untyped def, a bare dict, an Any returned and
    an untyped call put into shoal.membership gave the same four errors in both."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["mypy"]
    assert cfg.get("warn_redundant_casts") is True and cfg.get("warn_unused_configs") is True, cfg
    strict = [o for o in cfg["overrides"] if {"shoal.comm.*", "shoal.membership.*"} <= set(o["module"])]
    assert len(strict) == 1, "one override holds shoal.comm and shoal.membership to the strict flags"
    assert {"shoal.comm", "shoal.membership"} <= set(strict[0]["module"]), strict[0]   # the packages' __init__
    assert {k: strict[0].get(k) for k in STRICT} == STRICT, strict[0]
    torch_exports = [o for o in cfg["overrides"] if "torch.*" in o["module"]]
    assert torch_exports and torch_exports[0].get("implicit_reexport") is False   # --strict's, for imports from torch


@pytest.mark.timeout(240)
def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "shoal"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
