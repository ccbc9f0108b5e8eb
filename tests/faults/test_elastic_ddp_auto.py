"""DDP's automatic two-level choice (``hierarchical=None``) on an elastic group, under a SIGKILL.

World 4 as 2 pretend hosts x 2 (``ddphier_worker.py --auto``). The choice is
made at each quorum from its members' host identities: with 2 hosts it is the
two-level reduction (host stages, then the leaders' all-reduce), also in the
quorum of 3 left when host h1's leader is SIGKILLed mid-backward. The
survivors discard that step, go on, and end (with the restarted worker,
healed) holding bitwise equal parameters and optimizer state.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

WORKER = "ddphier_worker.py"
OP = 5.0


@pytest.mark.timeout(120)
def test_automatic_two_level_per_quorum_survives_sigkill_bitwise_equal(tmp_path: Any) -> None:
    kill = 4
    args = ["--steps", "10", "--kill-step", str(kill), "--want-full", "3", "--op", str(OP), "--pace", "0.05",
            "--auto"]
    out = harness.run(str(tmp_path), 4, args, script=WORKER, hard_limit=100, restarts=1)
    final = out.final()
    dead = [r for r, _ in out.deaths]
    assert len(dead) == 1 and dead[0] in (2, 3), out.logs          # the leader of host h1 (chosen two-level)
    assert [(r["rank"], r["life"]) for r in final] == [(r, int(r == dead[0])) for r in range(4)], out.logs
    survivors = [r for r in final if r["rank"] != dead[0]]
    for s in survivors:
        hit = [e for e in s["log"] if e["step"] == kill]
        assert hit and not hit[0]["committed"] and hit[-1]["committed"], out.logs   # dropped, then re-run
        committed = [e["step"] for e in s["log"] if e["committed"]]
        assert committed == list(range(len(committed))), out.logs                  # no step lost or doubled
        assert all(e["hosts"] == 2 for e in s["log"]), out.logs
    # Automatic, and two-level: the host stages ran on every worker, the leaders' stage on leaders only.
    assert all(r["tags"].get("ddp/grad/intra", 0) > 0 for r in final), out.logs
    assert any(r["tags"].get("ddp/grad/identity", 0) > 0 for r in survivors), out.logs
    assert all(r["tags"].get("ddp/grad", 0) == 0 for r in final), out.logs        # never the flat all-reduce
    seqs = [[(e["step"], e["committed"]) for e in s["log"]] for s in survivors]
    assert seqs[0] == seqs[1] == seqs[2], out.logs                                  # one verdict everywhere
    reborn = final[dead[0]]
    assert reborn["stats"]["heals_received"] >= 1, out.logs
    assert reborn["log"][-1]["size"] == 4 and reborn["log"][-1]["hosts"] == 2, out.logs
    for r in final[1:]:
        assert all(torch.equal(a, b) for a, b in zip(final[0]["params"], r["params"])), out.logs
        assert all(torch.equal(a, b) for a, b in zip(final[0]["momentum"], r["momentum"])), out.logs
