"""One worker of the background-heal fault tests: shoal DDP + ElasticOptimizer with SHOAL_HEAL=background.

The last rank (``--joiner``) is the joiner: it waits until rank 0 has committed
``--go`` steps (rank 0 writes ``<out>/go``), then joins (the survivors wait
for it to start, ``<out>/joining``, between two steps). Its download is parked
deterministically (``before_chunk``): it asks for no byte before the run has
committed ``--park`` steps after its admission, so the survivors' commits
during the download are there whatever the machine's speed. With
``--midway``, after the first chunk it writes ``<out>/midway`` and waits for
``<out>/killed`` (the test SIGKILLs a source in between).

Everyone stops at the same step: once ``--steps`` were committed and a step
ran with every member contributing (the contributor count is the same on
every member). Writes ``<out>/<rank>-<life>.pt`` (log, final state, stats).
"""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal import codecs
from shoal.elastic import ElasticGroup, ElasticOptimizer, ElasticSampler, Timeouts
from harness import parked_striped, save_and_leave
from elastic_worker import digest
from forked import run_and_end


def _wait_file(path: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _wait_newer_quorum(group: ElasticGroup, limit: float = 60.0) -> None:
    """Outside a step: until the coordinator published a quorum newer than the group's (the joiner's join).
    Without it, survivors on a loaded machine could run to --max-steps before the slow joiner got in."""
    qid, deadline = group.quorum.qid if group.quorum is not None else 0, time.monotonic() + limit
    while group.client.latest() <= qid:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no quorum after {qid} within {limit} s: the joiner never joined")
        time.sleep(0.01)


PACED: list[int] = []   # the joiner: per chunk request, the pace's slots opened so far
LOOP_DONE = threading.Event()   # set when the training loop has ended (before leave())


def _park(group: ElasticGroup, out: str, park: int, midway: bool, until_leave: bool = False) -> None:
    """Install the joiner's download hook: wait for ``park`` commits (``until_leave``: for the loop's end
    instead), then (``midway``) for a kill."""
    parked = parked_striped(group, park)

    def before_chunk(source: int, received: int) -> None:
        pace = group.catchup.pace   # SHOAL_HEAL_PACE: which slot let this request through (-1: no pace)
        PACED.append(pace.slots if pace is not None else -1)
        if until_leave:
            LOOP_DONE.wait(90.0)
        parked(source, received)
        if midway and received > 0:
            if not os.path.exists(os.path.join(out, "midway")):
                with open(os.path.join(out, "midway"), "w") as f:
                    f.write(str(source))
            _wait_file(os.path.join(out, "killed"))
    group.catchup.before_chunk = before_chunk


def _flat_grad(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).clone()


def _local_grad(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This worker's gradient of the step, without DDP (a copy of the model, the same batch)."""
    own = copy.deepcopy(net)
    F.mse_loss(own(x), y).backward()
    return _flat_grad(own)


def _drop_all(group: ElasticGroup, out: str, rank: int) -> None:
    """Stop serving every snapshot held (once): a joiner fetching from here finds no source left."""
    flag = os.path.join(out, f"dropped-{rank}")
    server = group.catchup.server
    if os.path.exists(flag) or server is None:
        return
    for hid in server.holding():
        server.drop(hid)
    open(flag, "w").close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--joiner", type=int, required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--go", type=int, default=3)
    ap.add_argument("--park", type=int, default=3)
    ap.add_argument("--midway", action="store_true")
    ap.add_argument("--wrap", action="store_true", help="DDP through shoal.wrap(net, opt, Sync())")
    ap.add_argument("--end-at-admission", action="store_true",
                    help="stop once --steps ran and a step ran with every worker in the quorum (the joiner's "
                         "download is parked until then), leave, then save: leave() does the joiner's catch-up")
    ap.add_argument("--drop-on", action="store_true",
                    help="survivors stop serving every snapshot once <out>/dropall exists (writes dropped-<rank>)")
    ap.add_argument("--powersgd", action="store_true", help="DDP with a PowerSGD codec (refuses the background heal)")
    ap.add_argument("--max-steps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    with open(os.path.join(a.out, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == a.joiner:
        _wait_file(os.path.join(a.out, "go"))
    timeouts = Timeouts(op=5.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0, quorum=30.0, join=60.0)
    group = ElasticGroup(timeouts=timeouts, min_workers=2)
    group.heal_chunk = 2048   # a small model still takes many ranges
    if rank == a.joiner:
        _park(group, a.out, a.park, a.midway, until_leave=a.end_at_admission)
    torch.manual_seed(100 + 10 * rank + life)   # different on purpose: the heal must equalise
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)
    opt: Any
    if a.wrap:   # the strategy path: shoal.wrap(net, opt, Sync()) registers the same replay
        model, opt = shoal.wrap(net, inner, shoal.strategies.Sync(bucket_cap_mb=0.002), process_group=group)
    else:
        codec = codecs.PowerSGD(rank=2, min_compression_rate=1.0, start_iter=0) if a.powersgd else None
        model = shoal.DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.002, codec=codec)
        opt = ElasticOptimizer(inner, group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g))
    data = ElasticSampler(512, group, batch_size=16)
    log, everyone, grads = [], 0, []
    if rank == a.joiner:
        open(os.path.join(a.out, "joining"), "w").close()
    def going() -> bool:
        if a.end_at_admission:
            return group.step < a.steps or group.size < a.joiner + 1
        return (group.step < a.steps or everyone < 2) and group.step < a.max_steps

    try:
        while going():
            if a.drop_on and rank != a.joiner and os.path.exists(os.path.join(a.out, "dropall")):
                _drop_all(group, a.out, rank)
            idx = data.next_batch()
            mine, contributors = group.contribution()   # the same count on every member of the step
            check = mine and contributors < group.size and len(grads) < 30
            local = _local_grad(net, x[idx], y[idx]) if check else None   # this worker's own, unaveraged
            opt.zero_grad()
            F.mse_loss(model(x[idx]), y[idx]).backward()
            if check:
                grads.append({"step": group.step, "contributors": contributors, "local": local, "mean": _flat_grad(net)})
            commits = group.stats.commits
            opt.step()   # ElasticOptimizer says whether it committed; wrap's optimizer returns the loss
            committed = group.stats.commits > commits
            everyone = everyone + 1 if committed and contributors == group.size == a.joiner + 1 else 0
            log.append({"t": time.time(), "step": group.step, "committed": committed, "size": group.size,
                        "contributes": mine, "contributors": contributors, "digest": digest(net, inner)})
            if rank != a.joiner and group.step == a.go and committed:   # every survivor, after the same commit
                if rank == 0:
                    open(os.path.join(a.out, "go"), "w").close()
                _wait_file(os.path.join(a.out, "joining"))   # outside any step: nobody's collective waits
                _wait_newer_quorum(group)
    finally:
        LOOP_DONE.set()   # the joiner's download waits for it (--end-at-admission), whatever ended the loop
    result = {"log": log, "model": net.state_dict(), "opt": inner.state_dict(), "stats": vars(group.stats),
              "catchup": asdict(group.catchup.stats), "grads": grads, "cursor": data.cursor, "rank": rank, "life": life,
              "paced": PACED}
    if a.end_at_admission:   # leave first: the joiner's model is the run's only once leave() caught it up
        group.leave()
        result.update(model=net.state_dict(), opt=inner.state_dict(), caught_up=group.catchup.caught_up,
                      catchup=asdict(group.catchup.stats), stats=vars(group.stats))
        path = os.path.join(a.out, f"{rank}-{life}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)
        return
    save_and_leave(a.out, rank, life, result, group)


if __name__ == "__main__":
    run_and_end(main)   # the interpreter's ending without its finalization (forked.py)
