"""Helpers for testing distributed training code (shipped for users' tests too)."""

from shoal.testing.faults import Fault, FaultPlan, FaultyBackend
from shoal.testing.procs import WorkerError, free_port, run_workers

__all__ = ["run_workers", "free_port", "WorkerError", "Fault", "FaultPlan", "FaultyBackend"]
