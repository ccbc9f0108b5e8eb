"""shoal: data-parallel training for PyTorch on slow and unreliable networks.

The shortest use::

    import shoal
    shoal.init()                                   # from the launcher's env
    model = shoal.DistributedDataParallel(model)   # drop-in for torch DDP
"""

from shoal import errors
from shoal.comm import CommCounters, CommStats, Group, Meter, init
from shoal.parallel import DistributedDataParallel
from shoal.strategies import DASO, NonBlocking

__version__ = "0.1.0"

__all__ = [
    "init",
    "DistributedDataParallel",
    "NonBlocking",
    "DASO",
    "Group",
    "Meter",
    "CommCounters",
    "CommStats",
    "errors",
    "__version__",
]
