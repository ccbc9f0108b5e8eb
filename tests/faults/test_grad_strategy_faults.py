"""NonBlocking and ZeRO on elastic groups under real faults: real processes, gloo, world 3.

The oracle is serial: plain torch (the same optimizer, unsharded, one process)
replaying the run's committed steps, each on the global batch its quorum read
(``ElasticSampler`` without shuffling: ``size * 8`` samples, or ``global_batch``, from the step's
cursor), the mean loss over that batch being what data-parallel averaging of
the members' gradients computes. A discarded step must leave no trace, so the
survivors' final parameters and optimizer state equal that replay; where a
ZeRO shard's state was lost with its member (no replica), the replay resets
that state at the step the run re-initialised it. Invariants besides: every
member ends with equal parameters; a restarted worker heals and equals them.
Every run has a hard limit below its pytest timeout; the harness kills
whatever it started.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import grad_worker  # noqa: E402
import harness  # noqa: E402

from shoal.testing import FaultPlan, run_workers  # noqa: E402

OP = 5.0
WORKER = "grad_worker.py"


def replay(result: dict[str, Any], optim: str, resets: list[tuple[int, list[int]]] = ()) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Serial torch training over ``result``'s committed steps: final parameters and optimizer state."""
    x, y = grad_worker.data()
    net = grad_worker.make_net(0)
    params = list(net.parameters())
    with torch.no_grad():   # where the run started: one member's model, healed into all at the first step
        for p, v in zip(params, result["init"]):
            p.copy_(v)
    cls, kw = grad_worker.optim_args(optim)
    opt = cls(params, **kw)
    reset_at = {step: idx for step, idx in resets}
    batches = result["batches"]
    assert sorted(batches) == list(range(result["step"])), "a committed step has no recorded batch"
    for step in range(result["step"]):
        cursor, size, samples = batches[step]
        idx = torch.arange(cursor, cursor + samples) % grad_worker.N
        for i in reset_at.get(step, []):
            opt.state.pop(params[i], None)
        opt.zero_grad()
        F.mse_loss(net(x[idx]), y[idx]).backward()
        opt.step()
    state = {i: {k: v.detach().clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for i, p in enumerate(params) if opt.state.get(p)}
    return [p.detach().clone() for p in params], state


def assert_close_state(got: dict[int, dict[str, torch.Tensor]], want: dict[int, dict[str, torch.Tensor]],
                       why: str, tol: float = 2e-4) -> None:
    for i, st in got.items():
        for k, v in st.items():
            w = want[i][k]
            assert torch.allclose(v.to(w.dtype), w, atol=tol, rtol=tol), f"state {i}/{k}: max diff " \
                f"{(v - w).abs().max().item():.3g} {why}"


def assert_close_params(got: list[torch.Tensor], want: list[torch.Tensor], why: str, tol: float = 2e-4) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, atol=tol, rtol=tol), f"param {i}: max diff {(a - b).abs().max().item():.3g} {why}"


def launch(tmp_path: Any, args: list[str], plan: FaultPlan | None, world: int = 3,
           hard_limit: float = 95, env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], str]:
    env = {**(env or {}), **({"SHOAL_FAULT_PLAN": plan.to_json()} if plan is not None else {})}
    launcher = ["--min-workers", "2", "--max-restarts", "1"]
    code, out = harness.run_launcher(str(tmp_path), world, launcher, args, env=env, hard_limit=hard_limit,
                                     script=WORKER)
    assert code == 0, out.logs
    return out.final(), out.logs


# --- NonBlocking ------------------------------------------------------------------------------

# The hang guard covers both runs' own limits, the elastic run's (95 s) and the static one's (90 s), and the
# replay. It was 110 s, less than their sum: on a loaded machine the two start-ups (seven interpreters importing
# torch) could run past it while both runs were within their limits (168 s seen, passing, at load 33 on 2 cores).
@pytest.mark.timeout(230)
def test_nonblocking_fault_free_equals_serial_torch(tmp_path: Any) -> None:
    final, logs = launch(tmp_path, ["--kind", "nonblocking", "--steps", "12", "--op", str(OP)], None, hard_limit=95)
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], logs
    for r in final:
        assert r["stats"]["discards"] == 0 and r["exchange"]["commits"] == r["step"], logs
        assert torch.equal(torch.cat([p.reshape(-1) for p in r["params"]]),
                           torch.cat([p.reshape(-1) for p in final[0]["params"]])), logs
    assert all(torch.equal(a, b) for r in final for a, b in zip(r["init"], final[0]["init"])), logs
    params, state = replay(final[0], "adam")
    assert_close_params(final[0]["params"], params, logs)
    assert_close_state(final[0]["state"], state, logs)
    # And static NonBlocking (a world group, same start, same batches) lands on the same parameters,
    # bitwise: the same gloo sums of the same gradients, the same optimizer calls.
    # 90 s: three spawned interpreters' start-up and 12 steps; 60 s ran out at load 33 on 2 cores.
    static = run_workers(grad_worker.static_nonblocking, 3, final[0]["init"], final[0]["batches"], timeout=90)
    assert all(torch.equal(torch.cat([p.reshape(-1) for p in s]), torch.cat([p.reshape(-1) for p in static[0]]))
               for s in static), "static ranks disagree"
    for i, (a, b) in enumerate(zip(final[0]["params"], static[0])):
        assert torch.equal(a, b), f"param {i}: elastic and static differ by {(a - b).abs().max().item():.3g}"


@pytest.mark.timeout(110)
@pytest.mark.parametrize("codec", ["none", "powersgd"])
def test_nonblocking_sigkill_survivors_equal_serial_replay_and_restart_heals(codec: str, tmp_path: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Three layers: three all-reduces per step; PowerSGD's (on a thread) issues more: any of the first three.
    step, nth = rng.randrange(3, 8), rng.randrange(3)
    plan = FaultPlan().crash(rank=2, step=step, nth=nth)
    args = ["--kind", "nonblocking", "--steps", "14", "--op", str(OP), "--want-size", "3", "--pace", "0.05",
            "--codec", codec]
    final, logs = launch(tmp_path, args, plan)
    why = f"(seed {seed}: crash at step {step}, all-reduce #{nth})\n{logs}"
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    survivors, reborn = final[:2], final[2]
    assert survivors[0]["batches"] == survivors[1]["batches"], why
    for s in survivors:
        assert s["stats"]["discards"] >= 1 and s["exchange"]["discards"] >= 1, why
    assert reborn["stats"]["heals_received"] >= 1 and reborn["exchange"]["commits"] >= 3, why
    flat = [torch.cat([p.reshape(-1) for p in r["params"]]) for r in final]
    assert all(torch.equal(flat[0], f) for f in flat[1:]), why
    for r in final[1:]:
        for i, st in final[0]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, r["state"][i][k]), f"optimizer state {i}/{k} differs {why}"
    if codec != "none":
        return   # lossy: no serial oracle; the codec's state was rolled back, parameters stayed equal
    # The crashed step left no trace: the run equals serial Adam over the committed steps' batches.
    assert all(torch.equal(a, b) for a, b in zip(survivors[0]["init"], survivors[1]["init"])), why
    params, state = replay(survivors[0], "adam")
    assert_close_params(survivors[0]["params"], params, why)
    assert_close_state(survivors[0]["state"], state, why)


# --- ZeRO ----------------------------------------------------------------------------------------

def union_state(results: list[dict[str, Any]], why: str) -> dict[int, dict[str, torch.Tensor]]:
    """The members' shards put together; a parameter's state held twice (shard, replica) must be equal."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for r in results:
        for i, st in list(r["state"].items()) + list(r["replica"].items()):
            if i in out:
                for k, v in st.items():
                    assert torch.equal(v, out[i][k]), f"two copies of state {i}/{k} differ {why}"
            else:
                out[i] = st
    return out


def zero_args(optim: str, *extra: str) -> list[str]:
    return ["--kind", "zero", "--optim", optim, "--op", str(OP), *extra]


def assert_params_equal(results: list[dict[str, Any]], why: str) -> None:
    flat = [torch.cat([p.reshape(-1) for p in r["params"]]) for r in results]
    assert all(torch.equal(flat[0], f) for f in flat[1:]), f"members' parameters differ {why}"


@pytest.mark.timeout(110)
@pytest.mark.parametrize("optim", ["adam", "sgdm"])
def test_zero_fault_free_equals_unsharded_serial_torch(optim: str, tmp_path: Any) -> None:
    final, logs = launch(tmp_path, zero_args(optim, "--steps", "12", "--consolidate"), None)
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], logs
    assert_params_equal(final, logs)
    for r in final:
        z = r["zero"]
        assert z["size"] == 3 and z["reshards"] == 1 and z["discards"] == 0 and z["lost_params"] == 0, logs
        assert r["state"], f"rank {r['rank']} holds no shard {logs}"
    state = union_state(final, logs)
    assert sum(len(r["state"]) for r in final) == len(state) == len(final[0]["params"]), logs  # disjoint shards
    want_params, want_state = replay(final[0], optim)
    assert_close_params(final[0]["params"], want_params, logs)
    assert_close_state(state, want_state, logs)
    # consolidate_state_dict after a committed step: the whole state on quorum rank 0, as the shards hold it.
    (holder,) = [r for r in final if "consolidated" in r]
    assert holder["consolidated"].keys() == state.keys(), logs
    for i, st in state.items():
        assert all(torch.equal(v, holder["consolidated"][i][k]) for k, v in st.items()), logs


def _check_zero_after_a_kill(final: list[dict[str, Any]], replicate: bool, why: str) -> None:
    """Survivors discarded, re-sharded and agree; the restarted rank 2 healed; the dead member's
    shard state was lost once (kept with replicas); and the run equals serial unsharded Adam over
    the committed steps' batches, resetting the lost state where the run re-initialised it."""
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 1)], why
    survivors, reborn = final[:2], final[2]
    assert survivors[0]["batches"] == survivors[1]["batches"], why
    for s in survivors:
        assert s["stats"]["discards"] >= 1 and s["zero"]["discards"] >= 1, why
        assert s["zero"]["reshards"] >= 3, why   # first quorum, survivors alone, restarted worker back
    assert reborn["stats"]["heals_received"] >= 1 and reborn["state"], why
    assert_params_equal(final, why)
    assert survivors[0]["zero"]["lost"] == survivors[1]["zero"]["lost"], why
    lost = survivors[0]["zero"]["lost"]
    if replicate:
        assert lost == [] and all(r["zero"]["replica_drift"] == 0 for r in final), why
        assert all(r["zero"]["replica_bytes"] > 0 for r in final), why
    else:
        assert len(lost) == 1 and lost[0][1], why   # the dead member's shard, re-initialised once
    state = union_state(final, why)
    assert len(state) == len(final[0]["params"]), why
    want_params, want_state = replay(survivors[0], "adam", resets=lost)
    assert_close_params(survivors[0]["params"], want_params, why)
    assert_close_state(state, want_state, why)


@pytest.mark.timeout(110)
@pytest.mark.parametrize("replicate,phase", [(False, "params"), (True, "grads")],
                         ids=["state-lost-in-param-exchange", "replicated-in-grad-reduce"])
def test_zero_sigkill_survivors_equal_serial_replay_and_restart_heals(replicate: bool, phase: str,
                                                                      tmp_path: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Collectives of a step: the gradient all-reduce (one bucket, #0), then one parameter broadcast per
    # member (#1-#3): a crash there hits the exchange that precedes the vote.
    step, nth = rng.randrange(3, 8), (rng.randrange(1, 4) if phase == "params" else 0)
    plan = FaultPlan().crash(rank=2, step=step, nth=nth)
    extra = ["--steps", "14", "--want-size", "3", "--pace", "0.05"] + (["--replicate"] if replicate else [])
    final, logs = launch(tmp_path, zero_args("adam", *extra), plan)
    why = f"(seed {seed}: crash at step {step}, collective #{nth})\n{logs}"
    _check_zero_after_a_kill(final, replicate, why)


# --- ZeRO overlapped with DDP (bucket by bucket during backward) ----------------------------------

def _no_lost_state(r: dict[str, Any]) -> bool:
    z = r["zero"]
    return z["lost_params"] == 0 and z["lost"] == []


@pytest.mark.timeout(90)
def test_zero_overlapped_fault_free_equals_static_overlap_and_serial_torch(tmp_path: Any) -> None:
    final, logs = launch(tmp_path, zero_args("adam", "--overlap", "--steps", "8", "--consolidate"), None,
                         hard_limit=60)
    assert [(r["rank"], r["life"]) for r in final] == [(0, 0), (1, 0), (2, 0)], logs
    assert_params_equal(final, logs)
    for r in final:
        z = r["zero"]
        assert z["size"] == 3 and z["reshards"] == 1 and z["discards"] == 0 and _no_lost_state(r), logs
        assert z["commits"] == r["step"] == r["stats"]["commits"], logs   # every step voted once, in zero.step()
        assert r["state"], f"rank {r['rank']} owns no gradient bucket {logs}"
    state = union_state(final, logs)
    assert sum(len(r["state"]) for r in final) == len(state) == len(final[0]["params"]), logs  # disjoint shards
    want_params, want_state = replay(final[0], "adam")
    assert_close_params(final[0]["params"], want_params, logs)
    assert_close_state(state, want_state, logs)
    (holder,) = [r for r in final if "consolidated" in r]
    assert holder["consolidated"].keys() == state.keys(), logs
    # Static overlapped ZeRO (a world group, same start, same batches, same buckets and owners) lands on the
    # same parameters, bitwise: the same gloo sums of the same gradients, the same per-bucket optimizer calls.
    static = run_workers(grad_worker.static_zero_overlap, 3, final[0]["init"], final[0]["batches"], timeout=45)
    for i, (a, b) in enumerate(zip(final[0]["params"], static[0])):
        assert torch.equal(a, b), \
            f"param {i}: elastic and static overlap differ by {(a - b).abs().max().item():.3g}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("replicate,phase", [(False, "params"), (True, "grads")],
                         ids=["state-lost-in-param-broadcast", "replicated-in-grad-reduce"])
def test_zero_overlapped_sigkill_discards_everywhere_and_restart_heals(replicate: bool, phase: str,
                                                                       tmp_path: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Per step: three gradient all-reduces (buckets 0-2) on the group, then as each completes, that bucket's
    # parameter broadcast on the overlap subgroup. "grads": the kill lands in bucket nth's all-reduce (the
    # group's collective #nth: earlier buckets are stepped and broadcast by then); "params": in bucket nth's
    # broadcast (its broadcast #nth: the last one may even complete, then the vote finds the member gone).
    step, nth = rng.randrange(3, 7), rng.randrange(3)
    plan = FaultPlan().crash(rank=2, step=step, nth=nth, op="broadcast" if phase == "params" else "")
    extra = ["--overlap", "--steps", "12", "--want-size", "3", "--pace", "0.05"]
    extra += ["--replicate"] if replicate else []
    final, logs = launch(tmp_path, zero_args("adam", *extra), plan, hard_limit=70)
    why = f"(seed {seed}: crash at step {step}, {phase} collective #{nth})\n{logs}"
    # Nothing of the killed step survives anywhere (buckets stepped before the kill were restored).
    _check_zero_after_a_kill(final, replicate, why)
