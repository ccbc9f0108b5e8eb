"""DASO on 4 hosts x 1 worker, faked on loopback (issue #22): replicas vs the mean of the replicas.

Each of 4 gloo processes sets its own SHOAL_HOST_ID. Trains the bench's
``lm`` model (``BIG=1``: the default size) with AdamW lr 1e-3, 8 windows a
worker, DASO with 10-step epochs, one warm-up epoch, max_global_skips 8
(``PLATEAU=1`` reports a flat loss so the skips grow), and prints per step
each rank's (train loss, (val loss of its replica, val loss of the replicas'
mean)) every 5 steps and from step 58 on. DASO now refuses this layout: run
it at a commit before the refusal (e.g. 7df495a), as docs/daso.md did::

    BIG=1 PLATEAU=1 PYTHONPATH=. python docs/benchmarks/daso_lone_hosts.py 70 daso
"""
import os, sys
import torch
import shoal
from shoal.bench.tasks import LMConfig, build_task
from shoal.bench.data import ByteCorpus
from shoal.testing import run_workers

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
MODE = sys.argv[2] if len(sys.argv) > 2 else "daso"

def work(rank, world):
    torch.set_num_threads(1)
    os.environ["SHOAL_HOST_ID"] = f"h{rank}"
    torch.manual_seed(0)
    task = build_task("lm", (LMConfig(d_model=64, n_layers=1, n_heads=2, context=32) if not os.environ.get("BIG") else LMConfig()))
    corpus = ByteCorpus.load(32 if not os.environ.get("BIG") else 128)
    net = task.build_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if MODE == "daso":
        strat = shoal.DASO(total_epochs=10**6, steps_per_epoch=10, warmup_epochs=1, cooldown_epochs=0,
                           max_global_skips=8, stability_level=0.05)
        model, opt = shoal.wrap(net, opt, strat)
    else:
        strat = None
        model = shoal.DistributedDataParallel(net)
    losses = []
    val = corpus.val_windows(32)
    for step in range(STEPS):
        batch = corpus.train_batch(step, 0, 32, rank, world)
        loss = task.loss(model, batch)
        loss.backward(); opt.step(); opt.zero_grad()
        if strat is not None:
            strat.report_loss(1.0 if os.environ.get("PLATEAU") else loss.item())
        vl = 0.0
        if step % 5 == 4 or step >= 58:
          with torch.no_grad():
            vl = float(task.loss(net, val))
            import copy, torch.distributed as dist
            flat = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
            dist.all_reduce(flat); flat /= world
            avg = copy.deepcopy(net); torch.nn.utils.vector_to_parameters(flat, avg.parameters())
            vl = (round(vl, 3), round(float(task.loss(avg, val)), 3))
        losses.append((round(loss.item(), 3), vl))
    ev = list(strat.schedule.events) if strat else []
    return losses, ev

if __name__ == "__main__":
    res = run_workers(work, 4, timeout=900)
    for s in range(STEPS):
        print(s, [r[0][s] for r in res])
    print(res[0][1])
