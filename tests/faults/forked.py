"""``python ARGV`` forked from the fork server that has imported torch and shoal once (:class:`Forked`).

Test code, not shipped (:mod:`harness` starts its workers and launchers
this way). A forked child is not left behind by a test process that ends:
the forked processes still running at its exit are killed with their
process groups (:func:`_kill_leftovers`, before multiprocessing would join
them, which hangs the exit until they end by themselves), and one whose
test process crashed kills its own process group (:func:`_watch_owner`; the
fork server does not end with the test process while a child lives: each
child holds the write end of its "alive" pipe). Its stdout and stderr are
made anew on its log, as the interpreter makes them (unbuffered with
``PYTHONUNBUFFERED``), so what a worker printed before it was SIGKILLed is
in its log. No torch import here: a test of this module starts cheaply.
A process group is not a launcher's workers: ``shoal run`` starts each in a
session of its own, so a launcher killed so leaves them to end by
themselves; the harness's launcher paths send the launcher SIGTERM first
(it stops its workers), then SIGKILL.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - registers its exit handler (joins children) before ours below
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

# What the fork server imports once. The same list as shoal.testing.procs.FORKSERVER_PRELOAD (a process has one
# fork server; whoever starts it first sets its list), written out here because this module imports no torch.
# torch._dynamo: what a process's first optimizer step imports (about 1.1 s of CPU; see FORKSERVER_PRELOAD).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shoal")


def _forked_main(argv: list[str], env: dict[str, str], log: str, append: bool, owner: int) -> None:
    """In the forked child: what ``python ARGV`` does, with ``env``, stdout and stderr to ``log`` (appended
    to or truncated), in a new session (``start_new_session``); exits with the interpreter's exit code,
    or is SIGKILLed with its process group once ``owner`` (the test process) is gone."""
    os.setsid()
    _watch_owner(owner)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    _fresh_streams(bool(env.get("PYTHONUNBUFFERED")))
    if "torch" in sys.modules:   # preloaded: OMP_NUM_THREADS=1 is read when torch is imported, in the fork server
        sys.modules["torch"].set_num_threads(1)
    def entry() -> Any:   # a script's globals (what run_path returns) are no exit code: None
        if argv[:2] == ["-m", "shoal"]:
            from shoal.cli.main import main
            sys.argv = ["shoal", *argv[2:]]
            return main(argv[2:])
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))   # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")
        return None
    run_and_end(entry)


def run_and_end(main: Callable[[], Any]) -> NoReturn:
    """Run ``main`` as the interpreter runs a script (its return value or ``SystemExit`` is the exit code, an
    uncaught exception prints its traceback and gives 1), then end as the interpreter does, without its
    finalization: non-daemon threads joined, the ``atexit`` handlers run (shoal.comm.lifetime's among them),
    the streams flushed, then ``os._exit``.

    Test code: the workers of the fault tests end this way (``if __name__ == "__main__": run_and_end(main)``).
    The finalization skipped (module teardown and the garbage collector over torch's objects) cost 0.5 to
    1.4 s of CPU per worker on the 2-core box, each time a launcher waited for its workers' exit. What it
    would catch, a group destroyed while the interpreter finalizes, is tested where processes end on their
    own: tests/dist/test_exit_after_give_up.py, test_example (torchrun) and the e2e host workers."""
    code = 0
    try:
        value = main()
        if value is not None:
            raise SystemExit(value)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback on stderr, exit code 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe or stream: nothing more can be said on it
            pass
    os._exit(code)


def _watch_owner(owner: int) -> None:
    """SIGKILL this child's process group (it, and a launcher's workers) once process ``owner`` ended, even
    by a crash (no exit handler ran), from a daemon thread: a pidfd where there is one, else a poll."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(owner)
        except (AttributeError, OSError):   # no pidfd here, or the owner is gone already
            while _alive(owner):
                time.sleep(0.5)
        else:
            select.select([fd], [], [])     # readable once the owner ended
        os.killpg(0, signal.SIGKILL)
    threading.Thread(target=watch, name="harness-owner-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _fresh_streams(unbuffered: bool) -> None:
    """``sys.stdout`` and ``sys.stderr`` made anew on fds 1 and 2 (now the log), as the interpreter makes
    them at start-up: the inherited ones were made in the fork server, before ``PYTHONUNBUFFERED`` was
    in this environment, and buffer what a SIGKILLed worker printed last. Unbuffered with it (as
    ``python -u``); else stdout block-buffered and stderr line-buffered."""
    def stream(fd: int, old: Any, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding,
                                errors=old.errors, line_buffering=line and not unbuffered,
                                write_through=unbuffered)
    sys.stdout = stream(1, sys.stdout, line=False)
    sys.stderr = stream(2, sys.stderr, line=True)


def _killpg(pid: int, sig: int) -> None:
    """Signal the process group ``pid`` leads; one that is already gone is no error (the process ended
    between a poll and this call), so a cleanup never masks the failure that led to it."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class Forked:
    """A ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``) on ``python ARGV`` forked from the
    fork server; its ``pid`` leads its own process group, as with ``start_new_session=True``.

    Example (what ``subprocess.Popen([sys.executable, "worker.py", "--out", d], env=env, stdout=log_file,
    stderr=subprocess.STDOUT, start_new_session=True)`` does, without the interpreter's start-up)::

        p = Forked(["worker.py", "--out", d], env, os.path.join(d, "log.txt"))
        assert p.wait(timeout=60) == 0

    ``owner``: the process whose end kills this one (default: this process). ``preload``: what the fork
    server imports when it starts (this process's first ``Forked`` starts it; later ones reuse it).
    """

    def __init__(self, argv: list[str], env: dict[str, str], log: str, append: bool = False,
                 owner: int | None = None, preload: tuple[str, ...] = PRELOAD) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))   # read when the fork server starts (once per process)
        self.args = argv
        # Not a daemon: a daemonic process may not have children, and a launcher has workers. So the exit
        # handler below kills what is left at the test process's exit, before multiprocessing joins it.
        self._p = ctx.Process(target=_forked_main, args=(argv, env, log, append, owner or os.getpid()),
                              daemon=False)
        self._p.start()
        self.pid = int(self._p.pid or 0)
        _LIVE[:] = [p for p in _LIVE if p.poll() is None] + [self]
        # Its session must exist before anyone signals the group: the child calls setsid() first thing.
        deadline = time.monotonic() + 10.0
        while self._p.exitcode is None and time.monotonic() < deadline:
            try:
                if os.getpgid(self.pid) == self.pid:
                    break
            except ProcessLookupError:
                break
            time.sleep(0.001)

    def poll(self) -> int | None:
        return self._p.exitcode

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._p.exitcode


_LIVE: list[Forked] = []


@atexit.register
def _kill_leftovers() -> None:
    """At the test process's exit: SIGKILL every forked process still running, with its process group,
    and reap it. Registered after multiprocessing's own exit handler, so it runs first: that one joins
    every non-daemon child, which would hang the exit until a leftover worker ends by itself."""
    for p in _LIVE:
        if p.poll() is None:
            _killpg(p.pid, signal.SIGKILL)
    for p in _LIVE:
        p._p.join(10.0)
    _LIVE.clear()


