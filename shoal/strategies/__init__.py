"""When to synchronise what.

Example::

    model, opt = shoal.NonBlocking().wrap(model, opt)
"""

from shoal.strategies.daso import DASO, DASOConfig, DASOOptimizer, DASOSchedule
from shoal.strategies.nonblocking import NonBlocking, NonBlockingModule, NonBlockingOptimizer

__all__ = ["DASO", "DASOConfig", "DASOOptimizer", "DASOSchedule", "NonBlocking", "NonBlockingModule", "NonBlockingOptimizer"]
