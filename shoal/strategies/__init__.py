"""When to synchronise what.

Example::

    model, opt = shoal.NonBlocking().wrap(model, opt)
"""

from shoal.strategies.nonblocking import NonBlocking, NonBlockingModule, NonBlockingOptimizer

__all__ = ["NonBlocking", "NonBlockingModule", "NonBlockingOptimizer"]
