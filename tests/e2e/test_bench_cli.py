"""A real, tiny `shoal bench`: every built-in strategy through the launcher, 2 workers."""

import json
import os
from typing import Any

import pytest

from shoal.bench import report
from shoal.bench.command import main
from emulated import NEEDS_CLUSTER

TINY = ["--width", "64", "--layers", "1", "--val-windows", "8", "--batch", "8", "--no-progress", "--seed", "3"]


def _load(root: Any, run: str) -> dict[str, Any]:
    with open(os.path.join(root, run, "results.json")) as f:
        return json.load(f)


@pytest.mark.timeout(120)
def test_loopback_bench_all_builtin_strategies(tmp_path: Any, capsys: Any) -> None:
    rc = main(["--strategies", "ddp,torch-ddp,local,nosync", "--hosts", "2", "--loopback", "--steps", "4",
               "--eval-every", "2", "--out", str(tmp_path), "--run", "e2e", *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out
    results = _load(tmp_path, "e2e")
    report.validate_results(results)
    s = results["strategies"]
    assert [p["step"] for p in s["ddp"]["points"]] == [0, 2, 4]
    # Same seed, same global batch, averaged gradients: DDP, torch DDP and one worker agree.
    finals = {n: s[n]["final_val_loss"] for n in s}
    assert finals["ddp"] == pytest.approx(finals["torch-ddp"], abs=1e-4)
    assert finals["ddp"] == pytest.approx(finals["local"], abs=1e-3)
    assert finals["nosync"] != pytest.approx(finals["ddp"], abs=1e-4)  # replicas drift apart
    assert s["ddp"]["points"][0]["val_loss"] == s["local"]["points"][0]["val_loss"]  # same init
    assert s["ddp"]["mb_sent_per_worker"] > 0 and s["local"]["mb_sent_per_worker"] == 0
    assert s["nosync"]["mb_sent_per_worker"] == 0
    assert results["ideal"] is not None and results["ideal"]["points"]
    assert os.path.getsize(tmp_path / "e2e" / "report.png") > 1000
    for name in s:
        assert name in out
    assert "time to target" in out


@NEEDS_CLUSTER[0]
@NEEDS_CLUSTER[1]
@pytest.mark.timeout(120)
def test_emulated_bench_interface_bytes_match_the_meter(tmp_path: Any) -> None:
    rc = main(["--strategies", "torch-ddp,nosync", "--hosts", "2", "--bandwidth", "100mbit", "--steps", "4",
               "--eval-every", "4", "--out", str(tmp_path), "--run", "emu", *TINY])
    assert rc == 0
    results = _load(tmp_path, "emu")
    report.validate_results(results)
    ddp = results["strategies"]["torch-ddp"]
    last = ddp["points"][-1]
    for meter, iface in zip(last["meter_sent"], last["iface_sent"]):
        # the interface also carries TCP/IP headers, the store and the eval barriers
        assert meter <= iface < 1.3 * meter + 200_000
    nosync = results["strategies"]["nosync"]["points"][-1]
    assert max(nosync["iface_sent"]) < 200_000  # control messages only: no gradients
    assert len(ddp["host_bytes"]) == 2
