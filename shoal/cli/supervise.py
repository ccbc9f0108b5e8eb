"""Worker processes of a launch: their output pumps and the supervisor that stops them all.

:class:`_Supervisor` implements the static failure policy of
:func:`shoal.cli.launcher.launch` (the first worker to fail decides the exit
code and the others are stopped); :mod:`shoal.cli.elastic_launch` extends its
:meth:`_Supervisor.on_exit` with the elastic one (restart, keep going).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Iterator, TextIO

from shoal.comm.ports import pick_port

_POLL_S = 0.05


@dataclass
class _Worker:
    rank: int
    host: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread] = field(default_factory=list)
    injected_kill: bool = False
    code: int | None = None


def _free_port() -> int:
    """MASTER_PORT of a launch on this machine: below the ephemeral range (shoal.comm.ports), so that no
    connection opened meanwhile takes it before rank 0's store binds it."""
    return pick_port("127.0.0.1")


def _exit_code(raw: int) -> int:
    """Popen's -N (killed by signal N) as the shell's 128 + N."""
    return 128 - raw if raw < 0 else raw


class _Output:
    """Copies worker pipes line by line to the chosen streams, with a rank prefix."""

    def __init__(self, stdout: TextIO | None, prefix: bool) -> None:
        self.lock = threading.Lock()
        self.stdout = stdout
        self.prefix = prefix

    def pump(self, pipe: IO[bytes], rank: int, is_err: bool) -> threading.Thread:
        def run() -> None:
            tag = f"[{rank}] " if self.prefix else ""
            with pipe:
                for raw in iter(pipe.readline, b""):
                    line = raw.decode("utf-8", errors="replace")
                    if not line.endswith("\n"):
                        line += "\n"
                    self.write(tag + line, is_err)

        t = threading.Thread(target=run, name=f"shoal-out-{rank}", daemon=True)
        t.start()
        return t

    def write(self, text: str, is_err: bool = False) -> None:
        stream = self.stdout or (sys.stderr if is_err else sys.stdout)
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (ValueError, OSError):  # stream closed under us: drop, keep draining
                pass


@contextmanager
def _trap_signals(on_signal: "list[int]") -> Iterator[None]:
    """While inside, SIGINT/SIGTERM are recorded in ``on_signal`` instead of killing us.

    Only the main thread may install handlers; elsewhere this does nothing
    (the caller's own handling applies).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum: int, _frame: object) -> None:
        on_signal.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _Supervisor:
    """Runs the workers of one launch and applies the failure policy."""

    def __init__(self, kill: Sequence[tuple[int, float]], tolerate_kills: bool, grace_s: float,
                 output: _Output, quiet: bool) -> None:
        self.kills = sorted(kill, key=lambda k: k[1])
        self.tolerate_kills = tolerate_kills
        self.grace_s = grace_s
        self.output = output
        self.quiet = quiet
        self.workers: list[_Worker] = []
        self.signals: list[int] = []
        self.result_code = 0
        self.failed_rank: int | None = None

    def note(self, msg: str) -> None:
        if not self.quiet:
            self.output.write(f"[shoal run] {msg}\n", is_err=True)

    def start(self, argv: list[str], env: dict[str, str], rank: int, host: int, local_rank: int) -> None:
        pipe = subprocess.PIPE if (self.output.prefix or self.output.stdout) else None
        # Own session: a terminal's Ctrl-C reaches only the launcher, which
        # then stops each worker's whole process group (its children too).
        proc = subprocess.Popen(argv, env=env, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        w = _Worker(rank, host, local_rank, proc)
        if pipe is not None:
            assert proc.stdout is not None and proc.stderr is not None  # set by PIPE
            w.pumps = [self.output.pump(proc.stdout, rank, False), self.output.pump(proc.stderr, rank, True)]
        self.workers.append(w)

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.code is None:
                try:
                    os.killpg(w.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def on_exit(self, w: _Worker) -> bool:
        """Record ``w``'s exit; True when the run must stop (the failure policy)."""
        if w.code == 0:
            return False
        if w.injected_kill and self.tolerate_kills:
            self.note(f"rank {w.rank} killed as scheduled; the others go on (tolerate_kills)")
            return False
        assert w.code is not None  # on_exit is called after reaping
        if self.failed_rank is None:
            self.failed_rank, self.result_code = w.rank, w.code
        self.note(f"rank {w.rank} exited with code {w.code}; stopping the other workers")
        return True

    def on_tick(self, elapsed: float) -> None:
        """Called every poll with the seconds since the start (elastic mode starts joiners here)."""

    def supervise(self) -> None:
        """Wait for every worker, injecting kills and stopping all on failure or signal."""
        t0 = time.monotonic()
        pending = list(self.kills)
        while any(w.code is None for w in self.workers):
            self.on_tick(time.monotonic() - t0)
            if self.signals:
                self.result_code = 128 + self.signals[0]
                self.note(f"got signal {self.signals[0]}; stopping the workers")
                break
            while pending and time.monotonic() - t0 >= pending[0][1]:
                rank, at = pending.pop(0)
                w = self.workers[rank]
                if w.code is None:
                    self.note(f"killing rank {rank} at {at:g} s as asked (--kill)")
                    w.injected_kill = True
                    try:
                        os.killpg(w.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:  # exited in the meantime; reaped below
                        pass
            if self._reap_any():
                break
            time.sleep(_POLL_S)
        if self.signals and self.failed_rank is None:
            self.result_code = 128 + self.signals[0]
        self.stop()

    def _reap_any(self) -> bool:
        stop = False
        for w in self.workers:
            if w.code is None and w.proc.poll() is not None:
                w.code = _exit_code(w.proc.returncode)
                stop = self.on_exit(w) or stop
        return stop

    def stop(self) -> None:
        """SIGTERM the live workers, SIGKILL after the grace period, reap everything."""
        if any(w.code is None for w in self.workers):
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
                time.sleep(_POLL_S)
            self.signal_all(signal.SIGKILL)
        for w in self.workers:
            raw = w.proc.wait()
            if w.code is None:
                w.code = _exit_code(raw)
            try:  # children left in the group (e.g. data loaders) must not outlive the run
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for w in self.workers:
            for t in w.pumps:
                t.join(timeout=5)
