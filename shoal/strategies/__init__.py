"""When to synchronise what: DDP, local SGD, post-local SGD, hierarchical SGD, DiLoCo, streaming DiLoCo,
non-blocking per-layer exchange, DASO.

Every strategy is used the same way, through :func:`shoal.wrap`::

    model, opt = shoal.wrap(model, opt, shoal.DiLoCo(inner_steps=100))
"""

from shoal.strategies.base import Strategy, StrategyOptimizer
from shoal.strategies.daso import DASO, DASOConfig, DASOSchedule
from shoal.strategies.diloco import DiLoCo, DiLoCoConfig, default_outer_optimizer
from shoal.strategies.hierarchical import Hierarchical
from shoal.strategies.localsgd import AveragingStrategy, LocalSGD, PostLocalSGD
from shoal.strategies.nonblocking import NonBlocking, NonBlockingModule
from shoal.strategies.outer import OuterSGD
from shoal.strategies.streaming import StreamingDiLoCo
from shoal.strategies.sync import Sync

__all__ = [
    "Strategy",
    "StrategyOptimizer",
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
