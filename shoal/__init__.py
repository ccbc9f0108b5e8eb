"""shoal: data-parallel training for PyTorch on slow and unreliable networks.

The shortest use::

    import shoal
    shoal.init()                                   # from the launcher's env
    model = shoal.DistributedDataParallel(model)   # drop-in for torch DDP

or, for any strategy (DDP, local SGD, hierarchical, DiLoCo, ...)::

    model, opt = shoal.wrap(model, opt, shoal.DiLoCo(inner_steps=100))
"""

from shoal import errors
from shoal.collaborative import CollaborativeConfig, CollaborativeOptimizer
from shoal.averagers import HierarchicalModelAverager, PeriodicModelAverager
from shoal.comm import CommCounters, CommStats, Group, Meter, init
from shoal.optim import ZeroRedundancyOptimizer
from shoal.parallel import DistributedDataParallel
from shoal.strategies import (
    DASO,
    DiLoCo,
    Hierarchical,
    LocalSGD,
    NonBlocking,
    OuterSGD,
    PostLocalSGD,
    Round,
    Rounds,
    Strategy,
    StreamingDiLoCo,
    Sync,
)
from shoal.wrap import wrap

__version__ = "0.1.0"

__all__ = [
    "init",
    "DistributedDataParallel",
    "wrap",
    "Strategy",
    "Round",
    "Rounds",
    "Sync",
    "LocalSGD",
    "PostLocalSGD",
    "Hierarchical",
    "DiLoCo",
    "StreamingDiLoCo",
    "OuterSGD",
    "NonBlocking",
    "DASO",
    "CollaborativeOptimizer",
    "CollaborativeConfig",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "ZeroRedundancyOptimizer",
    "Group",
    "Meter",
    "CommCounters",
    "CommStats",
    "errors",
    "__version__",
]
