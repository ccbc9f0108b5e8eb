"""How far an inner optimizer that restarts empty moves the model, against one that kept its state.

A DiLoCo joiner healed in the background restarts its inner optimizer empty
(docs/elastic.md, "DiLoCo and streaming DiLoCo", item 2): its state is each
worker's own and is not sent. This measures what that does to the joiner's
pseudo-gradient on the chaos bench's task (``lm``, AdamW lr 1e-3, batch 8):
train ``--warm`` steps, then from the same parameters run ``n`` more steps
twice, with the optimizer's state kept and with a fresh optimizer, and print
the norm of each displacement (what the round averages) and their cosine.

    PYTHONPATH=. python scripts/fresh_inner_optimizer.py --warm 160 --steps 8,16,32
"""

from __future__ import annotations

import argparse
import copy

import torch

from shoal.bench.tasks import LMConfig, LMTask


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", type=int, default=160, help="steps trained before the comparison")
    ap.add_argument("--steps", default="8,16,32", help="inner steps compared, comma-separated")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    task = LMTask(LMConfig())
    torch.manual_seed(0)
    net = task.build_model()
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr)

    def step(model: torch.nn.Module, o: torch.optim.Optimizer, i: int) -> None:
        task.loss(model, task.corpus.train_batch(i, a.seed, 8, 0, 1)).backward()
        o.step()
        o.zero_grad()

    for i in range(1, a.warm + 1):
        step(net, opt, i)
        if i % 40 == 0:
            print(f"warm-up: {i}/{a.warm} steps", flush=True)

    def flat(m: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    start = flat(net)

    def displacement(fresh: bool, n: int) -> torch.Tensor:
        m = copy.deepcopy(net)
        o = torch.optim.AdamW(m.parameters(), lr=a.lr)
        if not fresh:
            o.load_state_dict(copy.deepcopy(opt.state_dict()))
        for k in range(n):
            step(m, o, a.warm + 1 + k)   # the same batches for both
        return flat(m) - start

    print(f"{'steps':>5} {'kept |d|':>9} {'fresh |d|':>9} {'ratio':>6} {'cosine':>7}")
    for n in (int(v) for v in a.steps.split(",")):
        kept, fresh = displacement(False, n), displacement(True, n)
        cos = torch.nn.functional.cosine_similarity(kept, fresh, dim=0)
        print(f"{n:5d} {kept.norm():9.4f} {fresh.norm():9.4f} {fresh.norm() / kept.norm():6.2f} {cos:7.3f}")


if __name__ == "__main__":
    main()
