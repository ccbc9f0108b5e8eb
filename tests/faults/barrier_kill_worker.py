"""One worker of the kill-at-the-barrier tests: shoal DDP on an ElasticGroup, gloo on loopback.

Ranks 0 and 1 train from the start (the coordinator's first quorum waits for
two). In step ``--park`` both park after backward, before the commit; rank 0
writes ``<out>/ready``. Rank 2, the joiner, starts only then: it joins, the
coordinator admits it in a new quorum, and it arrives at that quorum's store
barrier. Then the ``--victim`` SIGKILLs itself (a thread of its own watches
for the joiner's arrival), and the other survivors park until it is dead:

- ``--victim 2``, the joiner, killed at the barrier with its arrival
  counted (run F of docs/BENCHMARKS.md: a restarted worker killed while it
  waited there for the survivors to finish their step). The survivors commit
  the parked step; its vote tells them of the new quorum, which the next
  step adopts. They pass its barrier (the dead joiner's arrival counts), and
  the quorum's gloo group can never form.
- ``--victim 1``, a survivor, killed inside the parked step. Rank 0's vote
  discards it; the coordinator has already published the joiner's quorum,
  so it serves no request about the old one, and rank 0 and the joiner wait
  at the new quorum's barrier for the dead member.

Each worker writes ``<out>/<rank>-0.pt``: the wall time of its release (the
parked survivors) and of every commit (with the committed step's quorum
size), and its final state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.elastic import ElasticGroup, ElasticOptimizer, Timeouts
from shoal.membership.coordinator import connect
from forked import run_and_end

# A hang shows up as hitting a long timeout: op (the gloo constructor's wait) and heartbeat_timeout (the
# coordinator's own verdict) are far above probe, by which a lost member must be judged (the test's bound,
# heartbeat_timeout / 2 = 5 s, 10 probe windows, against 0.2-0.6 s seen on a loaded 2-core box, ~1 s before).
# op also sets how long a worker waits at exit for the abandoned constructor of the dead member's quorum
# (the joiner case), which is most of that test's time: 12 s, not 24, took it from ~26-33 s to ~14-21 s. It
# stays above heartbeat_timeout, so a wait on either timeout fails the bound.
TIMEOUTS = Timeouts(op=12.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=10.0, quorum=90.0, join=120.0)


def dead(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def die_at_the_barrier(group: ElasticGroup) -> None:
    """The victim's thread: SIGKILL this process once the joiner arrived at the barrier of its quorum."""
    st = connect(group.client.address, 30.0)   # its own store client: the training thread uses the group's
    while True:
        latest = int(st.add(group.client.key("q/latest"), 0))
        if latest:
            rec = json.loads(st.get(group.client.key(f"q/{latest}")))
            if len(rec["members"]) == 3 and st.add(rec["prefix"] + "arrive", 0) >= 1:   # the survivors are parked
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.002)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--park", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--victim", type=int, choices=[1, 2], default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    pidfile, ready = os.path.join(a.out, "victim.pid"), os.path.join(a.out, "ready")
    if rank == a.victim:
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pidfile + ".tmp", pidfile)
    if rank == 2:
        while not os.path.exists(ready):
            time.sleep(0.01)
    group = ElasticGroup(timeouts=TIMEOUTS, min_workers=2)
    torch.manual_seed(100 + 10 * rank)   # different on purpose: the first heal equalises
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model = shoal.DistributedDataParallel(net, process_group=group)
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    opt = ElasticOptimizer(inner, group)
    commits: list[tuple[float, int, int]] = []   # (wall time, committed step, its quorum's size)
    group.on_commit(lambda: commits.append((time.time(), group.step, group.size)))
    if rank == a.victim:
        threading.Thread(target=die_at_the_barrier, args=(group,), daemon=True).start()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    released: float | None = None
    while group.step < a.steps:
        idx = torch.arange(8) + 8 * (group.step % 8)
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        if group.step == a.park and released is None and rank < 2:
            if rank == 0:
                open(ready, "w").close()
            while not (os.path.exists(pidfile) and dead(int(open(pidfile).read()))):
                time.sleep(0.01)
            released = time.time()
        opt.step()
    # Leave first: a joiner admitted with the background heal may still be downloading after the last step (on
    # a loaded machine); its parameters are the run's only once leave() has caught it up (docs/elastic.md).
    group.leave()
    result = {"rank": rank, "life": 0, "released": released, "commits": commits, "stats": vars(group.stats),
              "model": net.state_dict(), "opt": inner.state_dict(), "cursor": 0,
              "caught_up": group.catchup.caught_up}
    path = os.path.join(a.out, f"{rank}-0.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
