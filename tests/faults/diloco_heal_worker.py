"""One worker of DiLoCo's background-heal fault test: shoal.wrap(net, Adam, DiLoCo) on an ElasticGroup.

Rank ``--crash-rank`` is SIGKILLed in its first collective of round
``--crash-round`` (a FaultPlan); the harness restarts it, and its second life
is the joiner. With ``SHOAL_HEAL=background`` it is admitted at once as a
zero-weight member of the outer rounds; its download is parked
deterministically (``before_chunk``): it asks for no byte before the run has
committed ``--park`` rounds after its admission, so the survivors' commits
during the download are there whatever the machine's speed.

With ``--early`` the crashed rank instead SIGKILLs itself right after a
round (between two rounds: no collective of it fails), and the survivors
hold their next round until its restart is in a published quorum and they
have sent it bytes of the snapshot they offered it from their inner steps.

A survivor that committed a round without it waits once, between two
rounds, until the restarted worker is in a published quorum (else it could
finish first); with ``--served-before-round`` the restart asks to join
only then, and the survivor holds its next round until it has sent the
restart bytes of the snapshot it offered early (its quorum lost no member
since: the survivors dissolve it for the join). Every member logs every committed round (an ``on_commit`` hook: the round's
kind, quorum size, and this step's newcomers, i.e. the members that counted
zero). Everyone stops right after a round once ``--steps`` inner steps ran and
four rounds in a row had all ``--world`` members contributing (a count that
every member computes from the same commits). Writes
``<out>/<rank>-<life>.pt``: the log, the catch-up stats, and what every
member must hold equal (parameters, global copies, outer optimizer state).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, Timeouts
from shoal.membership.catchup import EARLY_PEEK_S
from shoal.testing import FaultPlan
from harness import parked_striped, save_and_leave
from forked import run_and_end

PERIOD = 4


def synced_state(strategy: Any, model: nn.Module) -> list[torch.Tensor]:
    """Parameters (one fragment, right after its round: the global copies), global copies, outer state."""
    out = [p.detach().clone() for p in model.parameters()] if len(strategy.fragments) == 1 else []
    for f in strategy.fragments:
        out.append(f.snapshot.clone())
        for st in f.outer.state_dict()["state"].values():
            out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def hold_for_early(group: ElasticGroup, strategy: Any, early: dict[str, Any]) -> None:
    """A survivor before an inner step after the crash (--early), in the quorum it dissolves: first until
    the coordinator raised that quorum's abort flag (the next round then leaves it) and published a quorum
    with a newcomer (the restart); then on through the inner steps, whose ends offer the newcomer the
    snapshot (CatchUp.offer_early, at most every EARLY_PEEK_S), and before the step that runs the next round
    until this member has sent it bytes. Bounded: a member that never offers early fails the test's checks."""
    q, t0 = group.quorum, time.monotonic()
    while not group.client.abort.raised(q.prefix) and time.monotonic() < t0 + 60:
        time.sleep(0.02)
    while not early["newcomer"] and time.monotonic() < t0 + 60:
        latest = group.client.latest()
        early["newcomer"] = latest > q.qid and any(m not in q.members for m in group.client.quorum(latest).members)
        time.sleep(0.02)
    while group.client.latest_seen <= q.qid and time.monotonic() < t0 + 60:
        time.sleep(0.02)   # its heartbeat thread read the newer quorum id (what offer_early looks at)
    time.sleep(EARLY_PEEK_S)   # the next inner step's end reads that quorum
    early["served"] = hold_until_served(group, strategy, t0 + 30, early.get("seeded", ""), early.get("trained", ""))


def hold_until_served(group: ElasticGroup, strategy: Any, deadline: float, seeded: str = "", trained: str = "") -> bool:
    """Before the inner step whose end runs a round (True), until this member has sent its snapshot's bytes to
    a joiner, or the joiner said it took all of them from its host's copy (the file ``seeded``: --state-cache)
    (bounded: a member that never offers early fails the test's checks); with ``trained``
    (--train-before-admission), until the joiner said it trained that many steps before its admission
    instead; else nothing (False)."""
    if (strategy.step + 1) % PERIOD not in {f.offset for f in strategy.fragments}:
        return False
    server = group.catchup.server
    while time.monotonic() < deadline:
        if trained:
            if os.path.exists(trained) or _waits_at_barrier(group):
                break   # (a restart that trained a whole period waits at the barrier: diloco_heal.admission_due)
        elif (server is not None and server.served > 0) or (seeded and os.path.exists(seeded)):
            break
        time.sleep(0.02)
        server = group.catchup.server
    return True


def _waits_at_barrier(group: ElasticGroup) -> bool:
    """Whether a member (the restart) already waits at the newest quorum's barrier (one store read or three)."""
    try:
        client = group.client
        q = client.quorum(client.latest())
        return int(client.store.add(q.prefix + "arrive", 0)) > 0
    except Exception:  # noqa: BLE001 - no quorum record readable yet: not there
        return False


def tell_when_seeded(group: ElasticGroup, path: str) -> None:
    """A restart (--state-cache): write ``path`` once a download of it has ended with bytes from its host's copy
    (its early one ends while it waits for the survivors' round: they hold that round for its word)."""
    def watch() -> None:
        t0 = time.monotonic()
        while time.monotonic() < t0 + 60:
            cu = group.catchup
            for f in (cu.early, cu.fetch):
                dl = f.download if f is not None else None
                if dl is not None and f.done.is_set() and dl.seeded > 0:
                    open(path, "w").close()
                    return
            time.sleep(0.02)
    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--crash-rank", type=int, default=2)
    ap.add_argument("--crash-round", type=int, default=3)
    ap.add_argument("--park", type=int, default=2)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--overlap", type=int, default=0)
    ap.add_argument("--powersgd", action="store_true", help="a codec with state of each worker's own (heals blocking)")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--early", action="store_true",
                    help="rank --crash-rank SIGKILLs itself between two rounds instead; the survivors hold their "
                         "next round until the restart is in a published quorum and they have served it bytes "
                         "before that round (its download begins before its admission)")
    ap.add_argument("--served-before-round", action="store_true",
                    help="a survivor that waited for the restart to be in a published quorum then holds the step "
                         "that runs its next round until it has sent the restart bytes (it was offered early)")
    ap.add_argument("--hidden", type=int, default=32, help="the width of the model's two hidden layers")
    ap.add_argument("--kill-phase", type=int, default=0,
                    help="--early: the crashed rank kills itself this many inner steps after the round (its model "
                         "and inner optimizer then go to <out>/at-kill.keep; a restart that resumed them from its "
                         "host's progress file writes what it resumed to <out>/resumed.keep)")
    ap.add_argument("--state-cache", default="",
                    help="a folder: each rank keeps its copy of the state in a file there for its restart "
                         "(SHOAL_STATE_CACHE)")
    ap.add_argument("--train-before-admission", type=int, default=0,
                    help="with --early: the survivors hold their next round until the restart has trained this many "
                         "inner steps from the state it loaded before its admission (file <out>/trained)")
    ap.add_argument("--stale-copy", action="store_true",
                    help="with --state-cache: the crashed rank stops writing its copy after the first round, so "
                         "its restart's copy is a round behind")
    ap.add_argument("--load-at-phase", type=int, default=-1,
                    help="the joiner, once its download may run, waits for it before the inner step at this "
                         "phase of the period (so it loads between two rounds, at a known step); -1: never waits")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    t0 = time.monotonic()
    while a.served_before_round and life > 0 and not os.path.exists(os.path.join(a.out, "alone")) \
            and time.monotonic() < t0 + 60:
        time.sleep(0.02)   # asks to join only once the survivors committed a round without it
    seeded = os.path.join(a.out, "seeded") if a.state_cache else ""
    if a.state_cache:
        os.environ["SHOAL_STATE_CACHE"] = os.path.join(a.state_cache, f"slot-{rank}.state")
    plan = FaultPlan() if a.early else FaultPlan().crash(rank=a.crash_rank, step=a.crash_round, nth=0)
    # op 15 s, not 5: on a loaded 2-core box (the suite under xdist, or several of these runs at once) a
    # subgroup's gloo build or a 48-byte all-gather was seen to take over 5 s on all three members, which
    # failed a round after the admission (the test checks that the catch-up costs no retry). A kill
    # is seen at once (its sockets reset) or by the peer watch, never by waiting out op.
    timeouts = Timeouts(op=15.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0, quorum=30.0, join=60.0)
    group = ElasticGroup(timeouts=timeouts, min_workers=2, backend_factory=plan.backend_factory())
    group.heal_chunk = 2048   # a small model still takes many ranges

    group.catchup.before_chunk = parked_striped(group, a.park)   # the download waits for --park commits
    if seeded and life > 0:
        tell_when_seeded(group, seeded)
    torch.manual_seed(100 + 10 * rank + life)   # different on purpose: the heal must equalise
    h = a.hidden
    net = nn.Sequential(nn.Linear(16, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 4))
    if a.powersgd:
        strategy: Any = shoal.DiLoCo(inner_steps=PERIOD, codec=shoal.codecs.PowerSGD(rank=2, min_compression_rate=1.0,
                                                                                  start_iter=0))
    elif a.fragments == 1 and a.overlap == 0:
        strategy = shoal.DiLoCo(inner_steps=PERIOD)
    else:
        strategy = shoal.StreamingDiLoCo(inner_steps=PERIOD, fragments=a.fragments, overlap_steps=a.overlap,
                                         mixing=0.0)
    full = {"rounds": 0}   # consecutive committed rounds with every member contributing
    alone = {"seen": False, "waited": False}   # a survivor committed a round without the crashed worker
    log: list[dict[str, Any]] = []
    discarded: list[int] = []   # the steps of discarded rounds

    def committed() -> None:   # in commit(): newcomers are still this step's
        kind = strategy.rounds.current if strategy.rounds is not None else "adopt"
        counted = group.size - len(group.newcomers)
        full["rounds"] = full["rounds"] + 1 if group.size == a.world and counted == a.world else 0
        alone["seen"] = alone["seen"] or group.size < a.world
        log.append({"t": time.time(), "step": group.step - 1, "kind": kind, "size": group.size,
                    "counted": counted, "mine": group.rank not in group.newcomers,
                    "short": group.catchup.shortfall() if group.catchup.pending else 0.0})
    group.on_commit(committed)
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    model, opt = shoal.wrap(net, inner, strategy, process_group=group)
    if group.catchup.stats.resumed_steps:   # went on from its last life's progress (before any step of its own)
        _keep(os.path.join(a.out, "resumed.keep"), net, inner)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    pick = torch.Generator().manual_seed(1000 * rank + life)   # each worker its own stream of samples
    trained = os.path.join(a.out, "trained") if a.train_before_admission else ""
    early: dict[str, Any] = {"newcomer": False, "served": False, "seeded": seeded, "trained": trained}
    while group.catchup.pre is not None or not (strategy.step >= a.steps and strategy.step % PERIOD == 0
                                                and (full["rounds"] >= 4 or strategy.step >= a.max_steps)):
        # (a restart training before its admission counts its own steps: it ends only once admitted)
        if rank == a.crash_rank and life == 0 and group.catchup.seed is not None:
            group.catchup.seed.flush(30)   # what it asked to keep on its host is there before any kill
        if a.early and rank == a.crash_rank and life == 0 and strategy.step == 2 * PERIOD + a.kill_phase:
            if group.catchup.seed is not None:   # --state-cache: killed once its copy of that round is written
                group.catchup.seed.flush(30)     # (and its progress since, SHOAL_STATE_CACHE_EVERY)
            if a.kill_phase:
                _keep(os.path.join(a.out, "at-kill.keep"), net, inner)
            os.kill(os.getpid(), signal.SIGKILL)   # between two rounds: no collective of it fails
        if a.stale_copy and rank == a.crash_rank and life == 0 and strategy.step == PERIOD + 1:
            group.catchup.seed.flush(30)   # its copy stays at the first round's state: a round behind at the kill
            group.catchup.seed = None
        if a.early and life == 0 and rank != a.crash_rank and not early["served"] and strategy.step >= 2 * PERIOD:
            hold_for_early(group, strategy, early)
        if alone["seen"] and not alone["waited"]:   # once, between two rounds: until the restart is in a quorum
            alone["waited"] = True
            open(os.path.join(a.out, "alone"), "w").close()   # --served-before-round: the restart asks now
            q, t0 = group.quorum, time.monotonic()
            while q is not None and group.client.latest() <= q.qid and time.monotonic() < t0 + 60:
                time.sleep(0.02)
            while (a.served_before_round and q is not None and group.client.latest_seen <= q.qid
                   and time.monotonic() < t0 + 60):
                time.sleep(0.02)   # its heartbeat thread has read it too (what offer_early looks at)
        if a.served_before_round and alone["waited"] and life == 0 and not early["served"]:
            early["served"] = hold_until_served(group, strategy, time.monotonic() + 30, seeded, trained)
        cu = group.catchup
        if (a.load_at_phase >= 0 and cu.hid >= 0 and not cu.loaded and cu.fetch is not None
                and group.step >= cu.stats.admitted_step + a.park and strategy.step % PERIOD == a.load_at_phase):
            cu.fetch.done.wait(60)   # unparked: it finishes now, and this inner step's end loads it
        idx = torch.randint(0, 512, (16,), generator=pick)
        F.mse_loss(model(x[idx]), y[idx]).backward()
        discards, step = group.stats.discards, group.step
        opt.step()
        opt.zero_grad()
        if group.stats.discards > discards:
            discarded.append(step)   # the round begun at this step was discarded (then retried)
        pre = group.catchup.pre   # trained N steps since it loaded the state it checked (downloaded, or its copy
        #                           matched the download's bytes; with --stale-copy: its copy, unchecked)
        if (trained and pre is not None and (a.stale_copy or not pre.from_seed) and not os.path.exists(trained)
                and group.catchup.trained() >= a.train_before_admission):
            open(trained, "w").close()   # the survivors may go to their round now
            t1 = time.monotonic()   # ... and it trains one more step once they wait at its barrier: k = N + 1
            while not group.catchup.admission_due() and time.monotonic() < t1 + 60:
                time.sleep(0.02)
    strategy.close()   # a reduction still in flight is merged (a round every member runs at the same step)
    result = {"log": log, "discarded": discarded, "synced": synced_state(strategy, model), "stats": vars(group.stats),
              "catchup": asdict(group.catchup.stats), "contributed": strategy.rounds.contributed,
              "rank": rank, "life": life, "step": strategy.step,
              "seed_writes": group.catchup.seed.writes if group.catchup.seed is not None else 0,
              # its inner Adam's step count, and the inner step it counts its progress from (its last load)
              "inner_step": int(inner.state[next(iter(net.parameters()))]["step"]),
              "entered": group.catchup.replayers[0].entered}
    save_and_leave(a.out, rank, life, result, group)


def _keep(path: str, net: torch.nn.Module, inner: torch.optim.Optimizer) -> None:
    torch.save({"params": [p.detach().clone() for p in net.parameters()], "inner": inner.state_dict()["state"]},
               path)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
