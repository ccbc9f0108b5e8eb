"""`shoal run --run-id`: an explicit flag wins over an exported SHOAL_RUN_ID, on one machine and across machines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_forked import shoal_forked

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "run-id-flag-token"


def _run(tmp: Path, opts: list[str]) -> tuple[int, str]:
    script = tmp / "show.py"
    script.write_text("import os\nprint('RUN_ID=' + os.environ['SHOAL_RUN_ID'])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONWARNINGS": "ignore", "SHOAL_RUN_ID": "exported-id", "SHOAL_TOKEN": TOKEN}
    # The launcher forked from the fork server (its whole cost here was a fresh interpreter's torch import).
    return shoal_forked(["run", "--elastic", *opts, "-n", "1", str(script)], env, tmp / "launcher.log", 60)


@pytest.mark.timeout(90)
def test_one_machine_elastic_run_takes_run_id_and_the_flag_wins(tmp_path: Path) -> None:
    code, log = _run(tmp_path, ["--run-id", "flagged-id"])
    assert code == 0, log
    assert "RUN_ID=flagged-id" in log, log


@pytest.mark.timeout(90)
def test_run_id_flag_wins_over_the_environment_across_machines(tmp_path: Path) -> None:
    from shoal.membership.coordinator import Coordinator

    coord = Coordinator(port=0, token=TOKEN).start()
    try:
        code, log = _run(tmp_path, ["--coordinator", coord.address, "--nnodes", "2", "--node-rank", "1",
                                    "--run-id", "flagged-id"])
    finally:
        coord.stop()
    assert code == 0, log
    assert "RUN_ID=flagged-id" in log, log
