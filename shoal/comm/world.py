"""Starting the default process group from the launcher's environment."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from shoal.comm.group import Group
from shoal.errors import ConfigError, ShoalError

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# srun's own names for what torchrun calls RANK, WORLD_SIZE and LOCAL_RANK (MASTER_* the batch script exports).
_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def _adopt_slurm() -> None:
    """A task started by ``srun`` (no launcher of ours): take RANK/WORLD_SIZE/LOCAL_RANK from SLURM's variables."""
    # SLURM_STEP_ID is a number in srun's tasks only: the batch script itself (SLURM_PROCID=0 there too)
    # is no task of a parallel step and must not wait for SLURM_NTASKS ranks.
    if not os.environ.get("RANK") and os.environ.get("SLURM_PROCID") and os.environ.get("SLURM_STEP_ID", "").isdigit():
        for ours, theirs in _SLURM.items():
            if os.environ.get(theirs):
                os.environ.setdefault(ours, os.environ[theirs])


def init(backend: str | None = None, timeout: float = 300.0, op_timeout: float | None = None) -> Group:
    """Initialise the default process group from the torchrun environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set
    by ``shoal run``, ``torchrun`` and most cluster launchers; under a bare
    ``srun``, ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` stand in for
    the first three, and the batch script exports ``MASTER_ADDR`` and
    ``MASTER_PORT``, see docs/multinode.md). The backend is
    NCCL when CUDA is available, gloo otherwise; on CUDA the current device
    becomes ``LOCAL_RANK``. Calling it again returns the existing world.

    Args:
        backend: force ``"gloo"`` or ``"nccl"``.
        timeout: seconds the backend waits for peers at start-up and per op.
        op_timeout: default per-operation timeout of the returned group's handles.

    Returns:
        The world as a metered :class:`~shoal.comm.group.Group`.

    Example::

        group = shoal.init()
        print(group.rank, group.size)
    """
    if timeout <= 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
    if dist.is_initialized():
        return Group(timeout=op_timeout)
    _adopt_slurm()
    missing = [k for k in _REQUIRED if not os.environ.get(k)]
    if missing:
        raise ShoalError(
            f"cannot start the process group: environment variable(s) {', '.join(missing)} not set. "
            "Start workers with `shoal run -n N script.py` or `torchrun --nproc-per-node N script.py`, "
            "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself (under srun: export MASTER_ADDR and "
            "MASTER_PORT in the batch script; srun gives the rest)."
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as e:
        raise ShoalError(f"RANK and WORLD_SIZE must be integers: {e}") from e
    if not 0 <= rank < world:
        raise ShoalError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    return Group(timeout=op_timeout)
