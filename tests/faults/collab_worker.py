"""One peer of the collaborative tests: an MLP on a synthetic regression task.

Started by harness.py (``script="collab_worker.py"``). Its role comes from
``--role RANK:ROLE`` options (aux, client, nan, shape, stall, late); it trains
until ``--epochs`` epochs and writes ``<out>/<rank>-<life>.pt``: every round's
report, a digest of the parameters after each epoch, the final parameters.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.collaborative import CollaborativeOptimizer


def digest(params: list[torch.Tensor]) -> float:
    total = 0.0
    for t in params:
        flat = t.detach().double().reshape(-1)
        total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--target", type=int, default=96)
    ap.add_argument("--batch", default="8,16,24", help="batch size per rank")
    ap.add_argument("--role", action="append", default=[], help="RANK:ROLE")
    ap.add_argument("--matchmaking", type=float, default=3.0)
    ap.add_argument("--averaging-timeout", type=float, default=20.0)
    ap.add_argument("--token", default="run-token-123")
    ap.add_argument("--load-timeout", type=float, default=10.0)
    ap.add_argument("--state-every", type=int, default=0)
    ap.add_argument("--delay", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=40.0)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds of pretend compute per step")
    ap.add_argument("--until-peers", type=int, default=0,
                    help="stop 3 epochs after the swarm is back to this many peers after a round with fewer")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("SHOAL_COLLAB_DEBUG"):
        import logging
        logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)d %(message)s")
    rank, life = int(os.environ["RANK"]), int(os.environ.get("SHOAL_RESTART", "0"))
    roles = {int(r.split(":")[0]): r.split(":")[1] for r in a.role}
    role = roles.get(rank, "peer")
    if life > 0:
        role = "late"       # a restarted peer joins a running swarm
    if role == "late" and life == 0:
        time.sleep(4.0)
    torch.manual_seed(0)
    width = 33 if role == "shape" else 32
    net = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))
    bs = int(a.batch.split(",")[rank % len(a.batch.split(","))])
    cfg = shoal.CollaborativeConfig(
        run_id=os.environ["SHOAL_RUN_ID"], target_batch_size=a.target, batch_size_per_step=bs,
        coordinator=os.environ["SHOAL_COORDINATOR"], token=a.token, matchmaking_time=a.matchmaking,
        averaging_timeout=a.averaging_timeout, load_state_timeout=a.load_timeout, auxiliary=role == "aux",
        client_mode=role == "client", average_state_every=a.state_every, heartbeat_timeout=3.0,
        delay_optimizer_step=a.delay, delay_grad_averaging=a.delay, offload_optimizer=a.delay,
        average_opt_statistics=("exp_avg_sq",) if a.state_every else ())
    opt = CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=1e-2), net.named_parameters(), config=cfg)
    if role == "nan":   # lies: declares finite gradients, then sends NaN into the sum
        real = opt._contribution

        def poisoned() -> tuple[torch.Tensor, int, bool]:
            c, w, _ = real()
            return torch.full_like(c, float("nan")), max(w, 1), True
        opt._contribution = poisoned  # type: ignore[method-assign]
    if role == "die":   # SIGKILLed in the middle of epoch 2's averaging
        real_mean = opt._robust_mean

        def die(*args, **kw):  # type: ignore[no-untyped-def]
            if opt.local_epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_mean(*args, **kw)
        opt._robust_mean = die  # type: ignore[method-assign]
    if role == "stall":  # hangs inside the round for longer than the averaging timeout, heartbeat alive
        real_attempt = opt._attempt

        def slow(*args, **kw):  # type: ignore[no-untyped-def]
            if opt.local_epoch == 2:
                time.sleep(a.averaging_timeout + 3)
            return real_attempt(*args, **kw)
        opt._attempt = slow  # type: ignore[method-assign]
    if role != "late":
        # A start barrier for the test only: the harness's coordinator publishes its first quorum once
        # all initial peers joined, so no peer races through epochs alone while the others import torch.
        opt.group.client.wait_quorum(after=0, timeout=30.0)
    g = torch.Generator().manual_seed(1000 + rank)
    w_true = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    log: list[dict[str, object]] = []
    t_end = time.monotonic() + a.max_seconds
    stop_at = a.epochs
    seen_fewer = life > 0   # --until-peers counts only a full round after one with fewer peers
    while opt.local_epoch < stop_at and time.monotonic() < t_end:
        if role != "aux":
            x = torch.randn(bs, 16, generator=g)
            loss = F.mse_loss(net(x), torch.tanh(x @ w_true))
            loss.backward()
        report = opt.step()
        if role != "aux":
            opt.zero_grad()
        if a.pace:
            time.sleep(a.pace)
        if report is not None:
            opt.wait_pending()
            if report.outcome == "averaged" and report.peers < a.until_peers:
                seen_fewer = True
            if a.until_peers and seen_fewer and report.outcome in ("averaged", "loaded") \
                    and report.peers >= a.until_peers \
                    and stop_at == a.epochs:
                stop_at = report.epoch + 3
            log.append({"epoch": report.epoch, "outcome": report.outcome, "peers": report.peers,
                        "samples": report.samples, "own": report.own_samples, "excluded": report.excluded, "source": report.source,
                        "local_epoch": opt.local_epoch, "digest": digest(list(net.parameters())),
                        "finite": all(bool(torch.isfinite(p).all()) for p in net.parameters()), "t": time.time(),
                        "took": report.seconds})
    opt.wait_pending()
    sd = opt.state_dict()
    result = {"rank": rank, "role": role, "member": opt.member_id, "log": log, "epoch": opt.local_epoch,
              "params": [p.detach().clone() for p in net.parameters()], "state_dict": sd,
              "progress": opt.swarm_progress()}
    path = os.path.join(a.out, f"{rank}-{life}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    # Stay in the swarm until the others finished their last round, then leave.
    time.sleep(1.5)
    opt.shutdown()


if __name__ == "__main__":
    main()
