"""Elastic runs require the run token; healed state is checked before it is loaded (issue #14 item 6).

- a worker with a wrong token gets AuthError from the coordinator's verdict
  (not a timeout), is never in a quorum, and the honest workers train on
  with equal state;
- a join record that does not verify (written by someone without the token)
  is ignored by the coordinator and by the members;
- a heal that delivers a tensor of the wrong shape or dtype, or NaN, is
  refused: nothing of it is loaded, the receiver leaves and raises, and the
  healing peer goes on alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
import uuid
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from cli_forked import shoal_forked  # noqa: E402
from cli_inprocess import shoal_cli  # noqa: E402

from shoal.membership import auth  # noqa: E402
from shoal.membership.client import MemberClient  # noqa: E402
from shoal.membership.coordinator import connect  # noqa: E402
from shoal.membership.records import RecordBook  # noqa: E402
from shoal.elastic import Coordinator, ElasticGroup, Timeouts  # noqa: E402
from shoal.errors import AuthError, ConfigError, ShoalError  # noqa: E402
from shoal.testing import run_workers  # noqa: E402

TOKEN = "elastic-auth-token"
_T = Timeouts(op=5.0, heartbeat_interval=0.05, probe=0.3, heartbeat_timeout=2.0, quorum=30.0, join=40.0)


def _quorum_members(address: str, run_id: str) -> list[int]:
    st = connect(address, 10.0)
    latest = int(st.add(f"{run_id}/q/latest", 0))
    return [m for q in range(1, latest + 1) for m in json.loads(st.get(f"{run_id}/q/{q}"))["members"]]


def _intrude(address: str, run_id: str) -> tuple[AuthError, int]:
    g = ElasticGroup(run_id, coordinator=address, timeouts=_T, min_workers=1, token="not-the-run-token")
    try:
        with pytest.raises(AuthError, match="refused this worker") as err:
            g.start_step()
        return err.value, g.client.member_id
    finally:
        g.leave()


@pytest.mark.timeout(90)
def test_a_wrong_token_is_refused_and_the_run_goes_on_with_equal_state(tmp_path: Any) -> None:
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    try:
        # Before the run: a stranger counted among the first quorum's two workers would be in it.
        _, early = _intrude(coord.address, run_id)
        outcome: dict[str, Any] = {}
        t = threading.Thread(target=lambda: outcome.update(out=harness.run(
            str(tmp_path), 2, ["--steps", "30", "--pace", "0.05"], hard_limit=70, restarts=0,
            coordinator=coord, token=TOKEN, run_id=run_id)))
        t.start()
        st = connect(coord.address, 10.0)
        while t.is_alive() and st.add(f"{run_id}/q/latest", 0) < 1:
            time.sleep(0.02)
        _, during = _intrude(coord.address, run_id)   # and while it trains
        t.join()
        out = outcome["out"]
        members = _quorum_members(coord.address, run_id)
    finally:
        coord.stop()
    final = out.final()
    assert [r["rank"] for r in final] == [0, 1], out.logs
    assert early not in members and during not in members, (early, during, members)
    for r in final:
        assert r["stats"]["discards"] == 0 and all(e["size"] == 2 and e["committed"] for e in r["log"]), out.logs
    for k, v in final[0]["model"].items():
        assert torch.equal(v, final[1]["model"][k]), k


def test_no_token_is_a_config_error_and_an_argument_wins_over_the_environment(monkeypatch: Any) -> None:
    coord = Coordinator(port=0, token=TOKEN).start()
    try:
        monkeypatch.delenv("SHOAL_TOKEN", raising=False)
        with pytest.raises(ConfigError, match=r"needs the run token.*SHOAL_TOKEN"):
            ElasticGroup("no-token", coordinator=coord.address, timeouts=_T)
        monkeypatch.setenv("SHOAL_TOKEN", "a-wrong-token-in-the-env")
        g = ElasticGroup("arg-wins", coordinator=coord.address, timeouts=_T, token=TOKEN)
        try:
            g.start_step()                     # the argument's token is the one proved
            assert g.should_commit() and g.size == 1
        finally:
            g.leave()
        g = ElasticGroup("env-used", coordinator=coord.address, timeouts=_T)
        with pytest.raises(AuthError, match="refused this worker"):
            g.start_step()                     # no argument: $SHOAL_TOKEN is used (and is wrong here)
        g.leave()
    finally:
        coord.stop()


def test_a_forged_join_record_is_ignored() -> None:
    # The coordinator is ticked by hand, so the forgery lands at a known point: after the member
    # proved the token, before its own record is written.
    coord = Coordinator(port=0, token=TOKEN, join_grace=0.0)
    try:
        run_id, st = "forged-join", connect(coord.address, 10.0)
        st.set(f"runs/{st.add('runs/n', 1)}", run_id)
        member = int(st.add(f"{run_id}/next_id", 1))
        coord.tick(time.monotonic())
        nonce = st.get(f"{run_id}/auth/{member}/nonce").decode()
        st.set(f"{run_id}/auth/{member}/proof", auth.answer(TOKEN, f"{run_id}/{member}", nonce))
        st.add(f"{run_id}/hb/{member}", 1)
        coord.tick(time.monotonic())
        assert st.get(f"{run_id}/auth/{member}/verdict") == b"ok"
        # A stranger (no token) writes the member's join record: min_workers 99 would stall the run.
        forged = json.dumps({"timeouts": {}, "min_workers": 99, "by": member})
        st.set(f"{run_id}/join/{member}", forged)
        for _ in range(3):
            coord.tick(time.monotonic())
        assert st.add(f"{run_id}/q/latest", 0) == 0
        reader = MemberClient(coord.address, run_id, _T, token=TOKEN)
        assert reader.join_infos([member]) == [None]      # members ignore it too (host, launch slot)
        # The member's own signed record replaces it: admitted, with its own min_workers.
        book = RecordBook(st, run_id, member, TOKEN)
        st.set(f"{run_id}/join/{member}", book.seal({"timeouts": vars(_T), "min_workers": 1, "host": "h0"}))
        coord.tick(time.monotonic())
        assert st.add(f"{run_id}/q/latest", 0) == 1
        assert json.loads(st.get(f"{run_id}/q/1"))["members"] == [member]
        assert reader.join_infos([member])[0]["host"] == "h0"
    finally:
        coord.stop()


def _vote_worker(rank: int, world: int, address: str, run_id: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = ElasticGroup(run_id, coordinator=address, timeouts=_T, min_workers=2, token=TOKEN)
    g.start_step()
    if rank == 1:
        g.report_error(ShoalError("this member's step failed"))
    g.all_reduce(torch.ones(1), tag="step").wait()
    first = g.should_commit()
    qid = g.quorum.qid if g.quorum is not None else -1
    g.leave()
    return {"commit": first, "qid": qid, "discards": g.stats.discards}


@pytest.mark.timeout(60)
def test_a_forged_commit_decision_reads_as_discard() -> None:
    # A stranger writes "commit" as the decision of the first step before anyone votes; one member's
    # step fails, so the step must be discarded on both (a forged commit would make them apply it).
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    run_id = uuid.uuid4().hex[:8]
    try:
        connect(coord.address, 10.0).set(f"{run_id}/q1/d/0", "commit:1")
        results = run_workers(_vote_worker, 2, coord.address, run_id, timeout=50, init_group=False)
    finally:
        coord.stop()
    assert [r["qid"] for r in results] == [1, 1], results
    assert [r["commit"] for r in results] == [False, False], results


# --- heals --------------------------------------------------------------------------------------

def _corrupt(kind: str) -> torch.Tensor:
    if kind == "nan":
        return torch.tensor([1.0, math.nan, 2.0, 3.0])
    if kind == "shape":
        return torch.ones(5)
    return torch.ones(4, dtype=torch.float64)


def _heal_worker(rank: int, world: int, address: str, run_id: str, kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    st = connect(address, 10.0)
    if rank == 1:      # the newcomer: joins once the healing peer is training
        while st.add(f"{run_id}/q/latest", 0) < 1:
            time.sleep(0.01)
    g = ElasticGroup(run_id, coordinator=address, timeouts=_T, min_workers=1, token=TOKEN)
    ok = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
    w = torch.zeros(4)
    served = _corrupt(kind) if rank == 0 else w
    g.register_state("ok", lambda: {"t": ok.clone()}, lambda s: ok.copy_(s["t"]))   # registered first
    g.register_state("w", lambda: {"t": served.clone()}, lambda s: w.copy_(s["t"]))
    if rank == 1:
        try:
            g.start_step()
        except ShoalError as e:
            return {"error": str(e), "ok": ok.clone(), "w": w.clone(), "commits": g.stats.commits,
                    "heals": g.stats.heals_received}
        return {"error": None}
    joined, after = False, 0    # a quorum of two formed; commits alone after it
    deadline = time.monotonic() + 40
    while after < 3 and time.monotonic() < deadline:
        g.start_step()
        joined |= g.size == 2
        g.all_reduce(torch.ones(1), tag="step").wait()
        if g.should_commit() and joined and g.size == 1:
            after += 1
        time.sleep(0.01)
    g.leave()
    return {"joined": joined, "after": after, "commits": g.stats.commits}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["nan", "shape", "dtype"])
def test_a_heal_with_a_bad_tensor_is_refused_and_never_loaded(kind: str, caplog: Any) -> None:
    coord = Coordinator(port=0, token=TOKEN).start()
    try:
        peer, newcomer = run_workers(_heal_worker, 2, coord.address, uuid.uuid4().hex[:8], kind,
                                     timeout=80, init_group=False)
    finally:
        coord.stop()
    want = {"nan": r"holds NaN or Inf in state\.w\.t", "shape": r"state\.w\.t: shape \(5,\) differs",
            "dtype": r"state\.w\.t: dtype torch\.float64 differs"}[kind]
    assert newcomer["error"] is not None, "the newcomer loaded a bad heal without complaint"
    assert "refused the run's state healed from rank 0" in newcomer["error"], newcomer["error"]
    assert re.search(want, newcomer["error"]), newcomer["error"]
    # Nothing was loaded (not even the state that was fine), and it never trained.
    assert torch.equal(newcomer["ok"], torch.zeros(3)) and torch.equal(newcomer["w"], torch.zeros(4))
    assert newcomer["commits"] == 0 and newcomer["heals"] == 0
    # The healing peer went on alone after the newcomer left.
    assert peer["joined"] and peer["after"] == 3, peer


@pytest.mark.timeout(30)
def test_shoal_coordinator_refuses_to_start_without_a_token(monkeypatch: Any, capsys: Any) -> None:
    # In this process: the refusal comes before the coordinator serves (no interpreter start-up to wait for).
    monkeypatch.delenv("SHOAL_TOKEN", raising=False)
    code, _, err = shoal_cli(["coordinator", "--port", "0"], capsys)
    assert code == 2 and "no run token: pass --token or set $SHOAL_TOKEN" in err, err


# --- shoal run --elastic -----------------------------------------------------------------------

_SCRIPT = """
import os, sys
from shoal.elastic import ElasticGroup, Timeouts
g = ElasticGroup(timeouts=Timeouts(op=5.0, quorum=30.0, join=60.0))
g.start_step()
ok = g.should_commit() and g.size == 2
g.leave()
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
    f.write(os.environ["SHOAL_TOKEN"] + " " + str(ok))
"""


def _shoal_run(tmp_path: Any, launcher: list[str], env_token: str | None) -> tuple[int, str, list[str]]:
    script = tmp_path / "worker.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_TOKEN"}
    env["PYTHONPATH"] = harness.ROOT
    if env_token is not None:
        env["SHOAL_TOKEN"] = env_token
    # The launcher forked from the fork server (no torch import of its own); its workers are fresh interpreters.
    code, out = shoal_forked(["run", *launcher, str(script), str(tmp_path)], env, tmp_path / "launcher.log", 100)
    found = sorted(f.read_text() for f in tmp_path.iterdir() if f.name in ("0", "1"))
    return code, out, found


@pytest.mark.timeout(120)
def test_shoal_run_token_argument_wins_over_the_environment(tmp_path: Any) -> None:
    code, out, found = _shoal_run(tmp_path, ["-n", "2", "--elastic", "--token", "cli-token-123"], "env-token-456")
    assert code == 0 and found == ["cli-token-123 True"] * 2, out


@pytest.mark.timeout(120)
def test_shoal_run_without_a_token_gives_its_workers_a_fresh_one(tmp_path: Any) -> None:
    code, out, found = _shoal_run(tmp_path, ["-n", "2", "--elastic"], None)
    assert code == 0 and len(found) == 2 and found[0] == found[1] and found[0].endswith(" True"), out
    assert len(found[0].split()[0]) >= 16, found


@pytest.mark.timeout(30)
def test_shoal_run_token_needs_elastic_and_a_standalone_coordinator_needs_a_token(tmp_path: Any, monkeypatch: Any,
                                                                                 capsys: Any) -> None:
    # In this process: both refusals come before the launcher starts a worker.
    monkeypatch.delenv("SHOAL_TOKEN", raising=False)
    script = tmp_path / "worker.py"
    script.write_text(_SCRIPT)
    code, out, err = shoal_cli(["run", "-n", "1", "--token", "cli-token-123", str(script), str(tmp_path)], capsys)
    assert code == 2 and "--token and --state-cache need --elastic" in err, out + err
    code, out, err = shoal_cli(["run", "-n", "1", "--elastic", "--coordinator", "127.0.0.1:9", str(script),
                                str(tmp_path)], capsys)
    assert code == 2 and "needs the run's token" in err, out + err
    assert not [f for f in tmp_path.iterdir() if f.name in ("0", "1")], "a worker started"
