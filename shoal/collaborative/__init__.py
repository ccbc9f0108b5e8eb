"""Collaborative training across unreliable peers (hivemind.Optimizer's model); see docs/collaborative.md.

Example::

    import shoal, torch
    cfg = shoal.CollaborativeConfig(run_id="mlp", target_batch_size=4096, batch_size_per_step=64,
                                    coordinator="127.0.0.1:29400", token="s3cret-token")
    opt = shoal.CollaborativeOptimizer(lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                       params=model.named_parameters(), config=cfg)
"""

from shoal.collaborative.config import CollaborativeConfig
from shoal.collaborative.optimizer import CollaborativeOptimizer
from shoal.collaborative.rounds import RoundReport
from shoal.collaborative.progress import SwarmProgress
from shoal.membership.coordinator import Coordinator

__all__ = ["CollaborativeConfig", "CollaborativeOptimizer", "RoundReport", "SwarmProgress", "Coordinator"]
