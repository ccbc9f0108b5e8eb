"""shoal: data-parallel training for PyTorch on slow and unreliable networks.

The shortest use::

    import shoal
    shoal.init()                                   # from the launcher's env
    model = shoal.DistributedDataParallel(model)   # drop-in for torch DDP
"""

from shoal import errors
from shoal.comm import CommCounters, CommStats, Group, Meter, init
from shoal.parallel import DistributedDataParallel

__version__ = "0.1.0"

__all__ = [
    "init",
    "DistributedDataParallel",
    "Group",
    "Meter",
    "CommCounters",
    "CommStats",
    "errors",
    "__version__",
]
