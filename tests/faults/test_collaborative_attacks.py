"""CollaborativeOptimizer against peers that hold the token and lie, and processes that lack it.

- an authenticated peer (a real process, collab_worker.py) claiming an epoch a
  million ahead in its round headers and in its signed progress record: the
  honest peers exclude it from every round, never load its state, and their
  view of the swarm's epoch stays theirs;
- a peer caught sending NaN in gradient averaging brings parameters shifted
  by +1000 to state averaging in the same round: it is left out of it;
- a process without the token (collab_forger.py) rewriting the progress
  records in the store: its records are dropped.

Honest peers run in threads (collab_peer.py). Every run has a hard limit below its pytest timeout.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
import torch

from collab_peer import EPOCH_LIE, Spec, assert_equal_after_each_round, by_epoch, finished, run_threads
from harness import run
from shoal.membership.coordinator import Coordinator

TOKEN = "run-token-123"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.timeout(110)
def test_a_peer_lying_about_its_epoch_is_excluded_and_never_loaded_from(tmp_path: Any, caplog: Any) -> None:
    # Without the header rule the liar is the only member at the round's (claimed) epoch, hence the
    # source every honest peer loads its +100-shifted parameters from; without the majority rule
    # the honest peers' view of the swarm's epoch is a million.
    # The liar trains on until the honest peers are done (their threads returned: the stop file), not for a
    # fixed 12 s; 45 s only bounds it. Left behind after epoch 1, it tries to load the state nobody serves it,
    # for its load_state_timeout (2 s, not 10: the stop file is read between its steps). 13 s -> ~5 s.
    common = {"target": 96, "epochs": 4, "max_seconds": 40, "start_peers": 3}
    coord = Coordinator(port=0, initial_workers=3, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    done = tmp_path / "honest-done"
    spec = json.dumps({"common": common, "ranks": {"2": {"batch": 16, "role": "epochlie", "max_seconds": 45,
                                                         "epochs": 1000, "linger": 0.0, "stop_file": str(done),
                                                         "load_timeout": 2.0}}})
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            procs = pool.submit(run, str(tmp_path), 3, ["--spec", spec, "--token", TOKEN], script="collab_worker.py",
                                hard_limit=90, restarts=0, ranks=[2], coordinator=coord, run_id=run_id)
            try:
                threads = run_threads([Spec(rank=0, batch=16, **common), Spec(rank=1, batch=24, **common)], TOKEN,
                                      hard_limit=90, coordinator=coord, run_id=run_id)
            finally:
                done.touch()
            out = procs.result()
    finally:
        coord.stop()
    honest = finished(threads)
    assert (2, 0) in out.results, f"the lying peer did not run to the end\n{out.logs}"
    liar = out.results[(2, 0)]["member"]
    assert_equal_after_each_round(honest, out.logs)
    for r in honest:
        epochs = by_epoch(r)
        assert r["epoch"] == 4 and set(epochs) == {0, 1, 2, 3}, r["log"]
        assert all(rec["outcome"] == "averaged" and rec["peers"] == 2 for rec in epochs.values()), r["log"]
        assert liar not in {rec["source"] for rec in r["log"]}, "an honest peer loaded the liar's state"
        assert liar in {m for rec in r["log"] for m in rec["excluded"]}
        assert max(float(p.abs().max()) for p in r["params"]) < 50, "the liar's shifted parameters got in"
        assert r["progress"].epoch <= r["epoch"] < EPOCH_LIE, "the swarm's epoch followed the liar's claim"
    assert "ahead of the round's epoch" in caplog.text


@pytest.mark.timeout(60)
def test_a_peer_caught_sending_nan_is_left_out_of_state_averaging(caplog: Any) -> None:
    # average_state_every=1: every round also averages parameters. The NaN peer shifts its parameters by
    # +1000 before each state averaging; had it taken part (equal weights, 3 members) the honest
    # parameters would move by ~333.
    opts = {"average_state_every": 1}
    specs = [Spec(rank=0, batch=8, epochs=4, max_seconds=30, options=opts),
             Spec(rank=1, batch=16, epochs=4, max_seconds=30, options=opts),
             Spec(rank=2, batch=24, epochs=4, max_seconds=30, role="nan", state_shift=1000.0, options=opts)]
    out = run_threads(specs, TOKEN, hard_limit=45)
    honest = finished(out[:2])
    bad = finished(out[2:])[0]["member"]
    assert_equal_after_each_round(honest)
    for r in honest:
        assert r["epoch"] == 4
        assert max(float(p.abs().max()) for p in r["params"]) < 50, "the NaN peer's state was averaged in"
        caught = [rec for rec in r["log"] if bad in rec["excluded"]]
        assert caught and all(rec["peers"] == 3 for rec in caught), "the NaN peer was caught inside 3-peer rounds"
        assert all(rec["outcome"] == "averaged" for rec in r["log"]), r["log"]
    assert "sent non-finite" in caplog.text


@pytest.mark.timeout(60)
def test_progress_records_forged_without_the_token_are_ignored(caplog: Any) -> None:
    # The forger rewrites every member's progress record (epoch 10**6, 10**9 samples/s) while the peers
    # train; the verbose peer reads the records at every epoch, and both read them at the end.
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    forger = subprocess.Popen([sys.executable, os.path.join(HERE, "collab_forger.py"), "--coordinator",
                               coord.address, "--run", run_id, "--token", "wrong-token-456", "--seconds", "30"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    logger = logging.getLogger("shoal.collaborative")
    level = logger.level
    try:
        assert forger.stdout is not None and forger.stdout.readline().strip() == b"ready"
        specs = [Spec(rank=0, batch=16, epochs=4, max_seconds=30, pace=0.02, options={"verbose": True}),
                 Spec(rank=1, batch=24, epochs=4, max_seconds=30, pace=0.02)]
        res = finished(run_threads(specs, TOKEN, hard_limit=45, coordinator=coord, run_id=run_id))
        alive = forger.poll() is None
    finally:
        logger.setLevel(level)
        forger.kill()
        text = forger.communicate(timeout=10)[0].decode(errors="replace")
        coord.stop()
    assert alive, f"the forger stopped before the peers finished\n{text}"
    assert_equal_after_each_round(res)
    for r in res:
        assert r["epoch"] == 4
        view = r["progress"]
        assert view.epoch <= r["epoch"] and view.samples_per_second < 1e8, view
    assert "dropping a progress record" in caplog.text and "does not verify" in caplog.text


@pytest.mark.timeout(60)
def test_a_nan_peer_behind_in_a_round_brings_no_state_to_its_averaging() -> None:
    # The NaN peer reaches epoch 1's round only after the honest peers closed it, so it is behind in
    # epoch 2's round: weight 0, it sends zeros (nothing to catch) and loads the source's state. Its
    # +1000-shifted parameters must still stay out of that round's state averaging (before: +333).
    opts = {"average_state_every": 1}
    specs = [Spec(rank=0, batch=8, epochs=4, max_seconds=30, options=opts),
             Spec(rank=1, batch=16, epochs=4, max_seconds=30, options=opts),
             Spec(rank=2, batch=24, epochs=4, max_seconds=30, role="nan", state_shift=1000.0, wait_for_list=1,
                  options=opts)]
    out = run_threads(specs, TOKEN, hard_limit=45)
    honest = finished(out[:2])
    bad = finished(out[2:])[0]
    assert_equal_after_each_round(honest)
    assert any(rec["outcome"] in ("behind", "loaded") for rec in bad["log"]), bad["log"]   # the case is there
    for r in honest:
        assert r["epoch"] == 4, r["log"]
        assert max(float(p.abs().max()) for p in r["params"]) < 50, "the state of a peer behind was averaged in"
