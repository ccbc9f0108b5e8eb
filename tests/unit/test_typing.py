"""The house rule "mypy clean on shoal/" is checked, not hoped for."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(240)
def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "shoal"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]


@pytest.mark.timeout(240)
def test_mypy_strict_on_the_transport_and_membership() -> None:
    """Issue 19: shoal.comm and shoal.membership pass `mypy --strict` (torch's untyped API is allowed per
    module in pyproject.toml, never by a blanket ignore). Imported modules outside the two packages are followed silently: they are held to
    plain `mypy shoal` by the test above."""
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                           "shoal/comm", "shoal/membership"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
