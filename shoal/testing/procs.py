"""Run a function on N local worker processes joined by a gloo group.

Example::

    def work(rank, world):
        t = torch.ones(1) * rank
        torch.distributed.all_reduce(t)
        return t.item()

    assert run_workers(work, 2) == [1.0, 1.0]

``fn`` must be importable by the children (defined at module level). Each
child sets ``torch.set_num_threads(1)``, joins a gloo group on loopback with a
fresh port, runs ``fn(rank, world_size, *args)`` and sends back its result
(anything ``torch.save`` can write). An exception in any child, or the
``timeout`` passing, kills every child and raises :class:`WorkerError` with
each failed rank's traceback: a test never hangs.

Workers are forked from a fork server (spawned where there is none), so, as
in any forked process, ``atexit`` handlers do not run when a worker ends:
``fn`` must release what it holds (leave a swarm, stop a server) itself.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from shoal.comm.ports import pick_port


class WorkerError(RuntimeError):
    """One or more worker processes failed or timed out."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago, below the ephemeral range (shoal.comm.ports): no
    connection another test opens meanwhile can be given it."""
    return pick_port("127.0.0.1")


# What the fork server imports once, so that no worker forked from it imports it again. torch._dynamo:
# torch imports it lazily at a process's first optimizer step (torch.optim.Optimizer asks whether it is
# compiling), some 800 modules (sympy, mpmath, ...) and about 1.1 s of CPU, as much as torch itself.
# A module that fails to import is skipped by the fork server.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "shoal"]


def _context() -> Any:
    """Workers fork from a server that has imported torch, torch._dynamo and shoal once (about 2.3 s of
    CPU saved per worker over a fresh interpreter); plain spawn where fork servers do not exist."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    out_dir: str,
    env: dict[str, str],
    init_group: bool,
    op_timeout: float,
    backend: str,
    own_env: dict[str, str],
) -> None:
    # Forked from the fork server, this process has the server's environment: take the caller's.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(own_env)
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{rank}.pt")
    try:
        if init_group:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            try:
                torch.distributed.init_process_group(
                    backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=op_timeout)
                )
            except torch.distributed.DistNetworkError as e:
                if not _address_in_use(e):
                    raise
                # Another process took the port between free_port() and now: no rank has run fn yet
                # (none passes init without rank 0's store), so the parent may start all over.
                with open(os.path.join(out_dir, f"{rank}.{_ADDR_IN_USE}"), "w") as f:
                    f.write(str(e))
                return
        result = fn(rank, world_size, *args)
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)
    except BaseException:  # report everything, including SystemExit from user code
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        if init_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


_ADDR_IN_USE = "addrinuse"
# How often run_workers picks a new port when the one free_port() gave was taken before rank 0 bound it.
PORT_TRIES = 4


def _address_in_use(e: BaseException) -> bool:
    return "EADDRINUSE" in str(e) or "address already in use" in str(e).lower()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    op_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    init_group: bool = True,
    rank_env: Sequence[dict[str, str]] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    Args:
        timeout: hard limit in seconds for the whole run.
        op_timeout: the gloo group's timeout, so a lost peer fails a
            collective instead of blocking it forever.
        env: extra environment variables for the children.
        init_group: set False when ``fn`` builds its own group.
        rank_env: per rank, more variables (applied last: they may override
            ``LOCAL_RANK``), e.g. a distinct ``NCCL_HOSTID`` per rank so that
            several NCCL ranks share one GPU.
        backend: the group's backend, ``"gloo"`` or ``"nccl"`` (NCCL: each
            child first selects ``cuda:LOCAL_RANK``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if rank_env is not None and len(rank_env) != world_size:
        raise ValueError(f"rank_env has {len(rank_env)} entries, expected one per rank ({world_size})")
    ctx = _context()
    deadline = time.monotonic() + timeout
    for attempt in range(PORT_TRIES):
        results, errors, port_taken = _run_once(
            ctx, fn, world_size, args, timeout, deadline, op_timeout, env, init_group, rank_env, backend
        )
        if not port_taken or attempt == PORT_TRIES - 1:
            break
    if errors:
        raise WorkerError("\n".join(errors))
    return results


def _run_once(
    ctx: Any,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    timeout: float,
    deadline: float,
    op_timeout: float,
    env: dict[str, str] | None,
    init_group: bool,
    rank_env: Sequence[dict[str, str]] | None,
    backend: str,
) -> tuple[list[Any], list[str], bool]:
    """One try on a fresh port: (results by rank, errors, whether rank 0 found the port taken)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shoal-workers-") as out_dir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, port, args, out_dir, {**os.environ, **(env or {})}, init_group,
                      op_timeout, backend, dict(rank_env[r]) if rank_env else {}),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()

        def taken() -> bool:
            return any(os.path.exists(os.path.join(out_dir, f"{r}.{_ADDR_IN_USE}")) for r in range(world_size))

        failed_early = False
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if taken():
                break
            # A rank that died or failed makes the others wait on it: stop early.
            if any(p.exitcode not in (None, 0) for p in procs) or any(
                os.path.exists(os.path.join(out_dir, f"{r}.err")) for r in range(world_size)
            ):
                failed_early = True
                time.sleep(1.0)  # let the others write their own errors
                break
            time.sleep(0.02)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        if taken():
            return [], [f"--- the master port {port} was taken by another process on each of {PORT_TRIES} tries"], True
        results: list[Any] = []
        errors: list[str] = []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"{r}.pt")
            err_path = os.path.join(out_dir, f"{r}.err")
            if os.path.exists(err_path):
                with open(err_path) as f:
                    errors.append(f"--- rank {r} raised:\n{f.read()}")
            elif os.path.exists(path):
                results.append(torch.load(path, weights_only=False))
                continue
            elif r in alive and not failed_early:
                errors.append(f"--- rank {r} still running after {timeout:.0f} s (killed)")
            else:
                errors.append(f"--- rank {r} exited with code {p.exitcode} and no result")
            results.append(None)
        return results, errors, False

