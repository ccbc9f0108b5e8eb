"""Trainer-style scripts run unchanged under torchrun and ``shoal run`` with shoal's wrappers (issue 23).

``gpt_trainer.py`` trains the same nanoGPT-style loop with torch's DDP, shoal's
DDP, shoal's DDP through a codec, LocalSGD and DiLoCo (one process pair per
launcher runs them all). shoal's DDP must give torch's DDP's losses and
parameters (fp16 autocast with GradScaler, bf16 autocast, ``Join`` over
uneven shards); the codec a bf16 rounding away; the local strategies must
train (finite, and equal on every rank after their last synchronisation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli_forked import shoal_forked

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
BIN = Path(sys.executable).parent
LAUNCHERS = {
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
    "shoal run": [sys.executable, "-m", "shoal", "run", "-n", "2"],   # its launcher forked: _launch
}


def _launch(launcher: str, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / f"{launcher.replace(' ', '_')}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    if launcher == "shoal run":   # forked from the fork server (no torch import of its own); same command line
        code, log = shoal_forked([*LAUNCHERS[launcher][3:], str(HERE / "gpt_trainer.py"), str(out)], env,
                                 tmp / "shoal_run.log", 500)
        assert code == 0, log[-6000:]
    else:
        proc = subprocess.run([*LAUNCHERS[launcher], str(HERE / "gpt_trainer.py"), str(out)], env=env,
                              capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=list(LAUNCHERS))
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(request.param, tmp_path_factory.mktemp("compat"))


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(600)
def test_shoal_ddp_gives_torch_ddp_losses(results: list[dict[str, Any]]) -> None:
    for r in results:
        for mode in ("fp16", "bf16"):
            ours, theirs = r[f"shoal/{mode}"], r[f"torch/{mode}"]
            assert _close(ours["losses"], theirs["losses"], 1e-5), (mode, ours["losses"], theirs["losses"])
            assert _close(ours["join"], theirs["join"], 1e-5), mode       # after Join over uneven shards
        codec, theirs = r["codec/fp16"], r["torch/fp16"]
        assert _close(codec["losses"], theirs["losses"], 1e-2), (codec["losses"], theirs["losses"])
        # Per-parameter sums after 7 AdamW steps on bf16-rounded gradients: Adam turns a rounding into a
        # step of up to lr (3e-3) per element, so a sum over a few dozen elements may move by some 0.05.
        assert max(abs(a - b) for a, b in zip(codec["join"], theirs["join"], strict=True)) < 0.2


@pytest.mark.timeout(600)
def test_every_backend_keeps_ddp_conventions_and_trains(results: list[dict[str, Any]]) -> None:
    for r in results:
        for name, s in r.items():
            assert s["prefixed"] and s["checkpoint"], name      # module.* keys; model.module checkpoint
            assert len(s["losses"]) == 4 and all(abs(x) < 10 for x in s["losses"]), (name, s["losses"])
    # DiLoCo (inner_steps=2, 4 steps) ends on an outer step: ranks equal. LocalSGD (period 2) averaged
    # after its third step and took one local step since, so ranks differ; torch/shoal ranks equal.
    for name in ("torch/fp16", "shoal/fp16", "codec/fp16", "diloco/fp16"):
        assert results[0][name]["final"] == results[1][name]["final"], name
    assert results[0]["localsgd/fp16"]["final"] != results[1]["localsgd/fp16"]["final"]
