"""shoal.bench.chaos's data: a function of the run's position only, so a restart reads what the worker it
replaces would have read and the chaos half trains on the fault-free half's samples."""

from __future__ import annotations

import argparse

import torch

from shoal.bench.chaos import _Task


def _args(task: str, data_seed: int = 0) -> argparse.Namespace:
    return argparse.Namespace(task=task, data_seed=data_seed, width=32, layers=1)


def test_the_stream_loss_depends_on_the_positions_not_on_the_worker() -> None:
    for kind in ("lm", "markov"):
        a = _args(kind)
        t0, t2 = _Task(a, 0), _Task(a, 2)
        model = t0.model(a)
        with torch.no_grad():
            # Positions 8..18 read by rank 0 (a survivor's share) or rank 2: the same samples, the same loss.
            same = float(t0.stream_loss(model, list(range(8, 19))))
            assert same == float(t2.stream_loss(model, list(range(8, 19))))
            # The mean over a 32-sample step is the mean of its shares, however the step was cut.
            whole = float(t0.stream_loss(model, list(range(32))))
            shares = [t0.stream_loss(model, list(range(i, i + 8))) for i in range(0, 32, 8)]
            assert abs(whole - float(torch.stack(shares).mean())) < 1e-5
            assert float(_Task(_args(kind, 1), 0).stream_loss(model, list(range(8, 19)))) != same


def test_a_workers_own_batches_depend_on_its_rank_and_step_only() -> None:
    for kind in ("lm", "markov"):
        a = _args(kind)
        model = _Task(a, 0).model(a)
        with torch.no_grad():
            first_life, restart = _Task(a, 1), _Task(a, 1)   # a restart builds its task anew
            before = float(first_life.own_loss(model, 7, 8))
            first_life.own_loss(model, 8, 8)   # what a life read before does not move the stream
            assert float(restart.own_loss(model, 7, 8)) == float(first_life.own_loss(model, 7, 8)) == before
            assert float(_Task(a, 2).own_loss(model, 7, 8)) != before
            assert float(first_life.own_loss(model, 6, 8)) != before


def test_the_streams_markov_rows_follow_the_chain_and_each_depends_on_its_own_seed_only() -> None:
    from shoal.bench.chaos import VOCAB, _chain, sample_rows
    p = _chain()
    x, y = sample_rows(p, list(range(3000)))
    counts = torch.zeros(VOCAB, VOCAB).index_put_((x.reshape(-1), y.reshape(-1)), torch.ones(x.numel()),
                                                   accumulate=True)
    # ~1,500 transitions out of each symbol: the empirical rows are the chain's within sampling noise.
    assert float((counts / counts.sum(1, keepdim=True) - p).abs().max()) < 0.06
    assert int(x[:, 0].min()) == 0 and int(x[:, 0].max()) == VOCAB - 1   # uniform start over all symbols
    together, alone = sample_rows(p, [5, 6, 7]), sample_rows(p, [6])
    assert torch.equal(together[0][1], alone[0][0]) and torch.equal(together[1][1], alone[1][0])
