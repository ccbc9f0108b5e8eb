"""Optimizers that know about the group they train in.

Example::

    zero = shoal.optim.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
"""

from shoal.optim.zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
