"""CollaborativeOptimizer options in a 3-peer swarm (peers in threads, see collab_peer.py).

Single-peer checks of the same options (each against a plain run) are in
tests/unit/test_collaborative_options.py; here: peers with different
options train together and end every epoch equal, and state averaging
repairs exactly the drift it is meant to repair, on exactly its epochs.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterator

import pytest
import torch

from collab_peer import Spec, assert_equal_after_each_round, by_epoch, finished, run_threads

TOKEN = "run-token-123"
TARGET = 96
EPOCH_LINE = re.compile(r"^epoch (\d+): (\d+) peers, (\d+)/96 samples, (\d+) samples/s, averaged with 3 peers in "
                        r"(\d+\.\d) s$")


@pytest.fixture
def log_level() -> Iterator[None]:
    """A verbose peer lowers shoal.collaborative's level to INFO; put it back for the other tests."""
    logger = logging.getLogger("shoal.collaborative")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.timeout(60)
def test_peers_with_delayed_offloaded_and_reused_buffers_agree_every_epoch(caplog: Any, log_level: None) -> None:
    # Batch sizes 8, 16, 24. Peer 0: reuse_grad_buffers, verbose. Peer 1: client mode, delayed optimizer
    # step on host copies. Peer 2: delayed gradient averaging too. All: lr halves every epoch.
    common: dict[str, Any] = {"target": TARGET, "epochs": 5, "lr_gamma": 0.5}
    delayed = {"delay_optimizer_step": True, "offload_optimizer": True}
    res = finished(run_threads([
        Spec(rank=0, batch=8, options={"reuse_grad_buffers": True, "verbose": True}, **common),
        Spec(rank=1, batch=16, role="client", options=delayed, **common),
        Spec(rank=2, batch=24, options={**delayed, "delay_grad_averaging": True}, **common)], TOKEN, hard_limit=45))
    assert assert_equal_after_each_round(res) == set(range(5))
    for r in res:
        assert r["epoch"] == 5 and r["state_dict"]["local_epoch"] == 5
        for rec in r["log"]:
            assert rec["outcome"] == "averaged" and rec["peers"] == 3 and rec["samples"] >= TARGET, rec
            # the scheduler stepped once per epoch, on every peer alike (in the background for 1 and 2)
            assert rec["lr"] == pytest.approx(1e-2 * 0.5 ** (rec["epoch"] + 1))
        assert any(rec["own"] > 0 for rec in r["log"]), f"peer {r['rank']} never contributed"
        # the model holds the optimizer's last result (copied back from the host copies)
        assert all(torch.equal(p, q) for p, q in zip(r["params"], r["opt_params"]))
    # an epoch of the peer that averages in the background ends at the target, not past it
    assert all(rec["own"] <= TARGET + 24 for rec in res[2]["log"]), res[2]["log"]
    sources = {rec["source"] for r in res for rec in r["log"]} - {None}
    assert res[1]["member"] not in sources, "a client-mode peer never serves state"
    lines = [m for m in (EPOCH_LINE.match(r.getMessage()) for r in caplog.records) if m is not None]
    assert [int(m.group(1)) for m in lines] == [0, 1, 2, 3, 4], "one line per epoch, from the verbose peer only"


@pytest.mark.timeout(60)
def test_state_averaging_repairs_drift_exactly_on_its_epochs() -> None:
    # average_state_every=3: parameters, exp_avg_sq and the extra tensor are averaged in the rounds that
    # end epochs 2 and 5 (0-based). Two sources of drift between the peers:
    # - at epoch 0 two peers load the third's state through state_loading_codec=fp16 (rounded parameters);
    # - after epoch 3 each peer shifts its parameters, exp_avg_sq and extra tensor (by rank).
    common: dict[str, Any] = {"target": TARGET, "epochs": 7, "extra": True, "loading_codec": "fp16",
                              "drift_after": [3],
                              "options": {"average_state_every": 3, "average_opt_statistics": ("exp_avg_sq",)}}
    res = finished(run_threads([Spec(rank=r, batch=8 * (r + 1), **common) for r in range(3)], TOKEN, hard_limit=45))
    logs = [by_epoch(r) for r in res]
    assert all(set(b) == set(range(7)) and all(rec["peers"] == 3 for rec in b.values()) for b in logs), \
        "every epoch must be a 3-peer round for the schedule below"

    def agree(e: int, key: str) -> bool:
        return len({repr(b[e][key]) for b in logs}) == 1
    for e in range(7):
        averaged = (e + 1) % 3 == 0
        expect_equal = averaged or e in (3, 6)      # after an averaged epoch, gradient averaging keeps them equal
        assert agree(e, "digest") == expect_equal, f"epoch {e}: parameters {'differ' if expect_equal else 'agree'}"
    # the named statistic and the extra tensor only drifted after epoch 3: apart at 4, averaged at 5
    assert agree(3, "stats") and not agree(4, "stats") and agree(5, "stats")
    assert [b[4]["extra"] for b in logs] == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
    assert all(b[5]["extra"] == [2.0] * 3 for b in logs), "the extra tensor is averaged with equal weights"
    # epoch 0: the loaders hold the source's parameters rounded to fp16, then the same update
    source = logs[0][0]["source"]
    src = next(b for r, b in zip(res, logs) if r["member"] == source)
    for r, b in zip(res, logs):
        if r["member"] != source:
            for p, q in zip(b[0]["params"], src[0]["params"]):
                assert float((p - q).abs().max()) <= 2e-3 * float(q.abs().max()) + 1e-6
            assert any(not torch.equal(p, q) for p, q in zip(b[0]["params"], src[0]["params"]))
