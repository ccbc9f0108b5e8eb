"""When to synchronise what: DDP, local SGD, post-local SGD, hierarchical SGD, DiLoCo, streaming DiLoCo,
non-blocking per-layer exchange, DASO.

Every strategy is used the same way, through :func:`shoal.wrap`::

    model, opt = shoal.wrap(model, opt, shoal.DiLoCo(inner_steps=100))

A new strategy subclasses :class:`Strategy` and synchronises only through
typed rounds: a :class:`Round` (name, ``reduce``, ``apply``, failure policy)
run by its :class:`Rounds`, which begins the step, votes and applies or
retries, so that the same code runs on a static and an elastic group (see
:mod:`shoal.strategies.base` for a complete template)::

    from shoal.strategies import FailurePolicy, Round, Rounds

    rounds = Rounds(group, "every-step")
    params = rounds.add(Round("params", reduce=average_into_scratch, apply=copy_scratch_into_params,
                              policy=FailurePolicy.AVERAGE_SURVIVORS))
    rounds.register(model, optimizer)    # what a newcomer heals
    rounds.join()                        # static: rank 0's model everywhere; elastic: the first heal
    rounds.run(params)                   # after each optimizer step: True once committed and applied
"""

from shoal.strategies.base import Strategy, StrategyOptimizer
from shoal.strategies.daso import DASO, DASOConfig, DASOSchedule
from shoal.strategies.diloco import DiLoCo, DiLoCoConfig, default_outer_optimizer
from shoal.strategies.hierarchical import Hierarchical
from shoal.strategies.localsgd import AveragingStrategy, LocalSGD, PostLocalSGD
from shoal.strategies.nonblocking import NonBlocking, NonBlockingModule
from shoal.strategies.outer import OuterSGD
from shoal.strategies.rounds import FailurePolicy, Round, Rounds, run_round
from shoal.strategies.streaming import StreamingDiLoCo
from shoal.strategies.sync import Sync

__all__ = [
    "Strategy",
    "StrategyOptimizer",
    "Round",
    "Rounds",
    "FailurePolicy",
    "run_round",
    "AveragingStrategy",
    "Sync",
    "LocalSGD",
    "PostLocalSGD",
    "Hierarchical",
    "DiLoCo",
    "DiLoCoConfig",
    "StreamingDiLoCo",
    "default_outer_optimizer",
    "OuterSGD",
    "NonBlocking",
    "NonBlockingModule",
    "DASO",
    "DASOConfig",
    "DASOSchedule",
]
