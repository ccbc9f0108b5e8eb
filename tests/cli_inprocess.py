"""`shoal ...` called in the test process, for the checks that end before any process starts.

A CLI refusal (exit 2 and a message) happens in argument checks, before the launcher starts a worker or a
coordinator: running it in-process tests the same code (``shoal.cli.main.main``, which ``python -m shoal``
calls) without the start-up of a fresh interpreter and its torch import (seconds each on a loaded machine).
"""

from __future__ import annotations

from typing import Any

from shoal.cli.main import main


def shoal_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    """Run ``shoal ARGV`` here; its exit code (an argparse ``SystemExit`` included), stdout and stderr."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err
