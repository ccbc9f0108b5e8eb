"""An in-flight collective (:class:`Handle`) and the thread that completes its futures.

Every collective of a group returns a :class:`Handle`; :meth:`Handle.wait`
returns its result or raises :class:`~shoal.errors.CommTimeoutError` past the
op timeout, and :meth:`Handle.future` gives a ``torch.futures.Future[Any]``
for comm hooks.

Example::

    h = group.all_reduce(t, op="avg", tag="grad")
    out = h.wait()
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from typing import Any, Callable

import torch

from shoal.comm.meter import Meter
from shoal.errors import CommTimeoutError


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text



class Handle:
    """An in-flight collective; :meth:`wait` returns its result.

    ``result`` is what the collective produces (the reduced tensor, the list
    of gathered tensors, ...). ``post`` runs once on completion before the
    result is returned (e.g. division for an average on gloo).
    """

    def __init__(
        self,
        work: Any,
        result: Any,
        meter: Meter,
        tag: str,
        timeout: float | None,
        post: Callable[[Any], Any] | None = None,
    ) -> None:
        self._work = work
        self._result = result
        self._meter = meter
        self._tag = tag
        self._timeout = timeout
        self._post = post
        self._done = work is None
        if self._done and post is not None:
            self._result = post(result)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` seconds, else the group's op timeout).

        Raises :class:`~shoal.errors.CommTimeoutError` when the deadline passes.
        """
        return self._wait(self._timeout if timeout is None else timeout, None)

    def _wait(self, limit: float | None, shown: float | None) -> Any:
        """:meth:`wait` for at most ``limit`` s; ``shown``: the timeout an error names (default ``limit``)."""
        if not self._done:
            t0 = time.perf_counter()
            try:
                if limit is None:
                    self._work.wait()
                else:
                    self._work.wait(datetime.timedelta(seconds=limit))
            except RuntimeError as e:
                if _is_timeout(e):
                    raise CommTimeoutError(
                        f"collective tagged {self._tag!r} did not finish within {shown or limit} s; "
                        "a peer is slow, hung or gone (raise the op timeout if the network is just slow)"
                    ) from e
                raise
            finally:
                self._meter.add_wait(self._tag, time.perf_counter() - t0)
            self._done = True
            if self._post is not None:
                self._result = self._post(self._result)
        return self._result

    def future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future[Any]`` of the result, for comm hooks; it fails as :meth:`wait` would.

        The future completes with the result, or with the collective's error
        (the backend's ``RuntimeError`` when a peer failed it), or
        with :class:`~shoal.errors.CommTimeoutError` once the op timeout,
        counted from this call, passes: never with the unreduced local data.
        A torch future of a ``Work`` neither times out nor may safely run
        Python callbacks that raise (gloo runs them on its own threads), so
        the waiting is done by :meth:`wait` on this process's comm watcher
        thread (:func:`_watcher`), which completes the returned future. Use
        either ``future()`` or ``wait()`` on one handle, not both.

        Example::

            fut = group.all_reduce(bucket.buffer(), op="avg", tag="grad").future()
            fut.wait()   # raises CommTimeoutError if a peer never joins the all-reduce
        """
        if self._work is None:
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_result(self._result)
            return fut
        devices: list[int | str | torch.device] = [d for d in _result_devices(self._result) if d.type != "cpu"]
        out: torch.futures.Future[Any] = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        _watcher().submit(self, deadline, out)
        return out

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


def _result_devices(result: Any) -> list[torch.device]:
    """The distinct devices of the tensors in ``result`` (a tensor or a list of them)."""
    items = result if isinstance(result, (list, tuple)) else [result]
    return list(dict.fromkeys(t.device for t in items if isinstance(t, torch.Tensor)))


class _Watcher:
    """A daemon thread that completes the futures of :meth:`Handle.future`.

    It waits for each handle in turn with :meth:`Handle.wait` (what raises
    :class:`~shoal.errors.CommTimeoutError` past the op timeout and the
    backend's error when a peer failed the collective) and sets the result or
    the exception on the future. Deadlines are fixed when the future is made,
    so waiting in turn delays no failure past its own deadline. Waiting in
    this thread, rather than in a callback on the work's own future, keeps
    shoal code off gloo's threads (see :meth:`ElasticGroup._await`), and on
    CUDA the result is published with the stream this thread waited on,
    which the future's consumer then synchronises with.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Handle, float | None, torch.futures.Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="shoal-comm-watcher", daemon=True).start()

    def submit(self, handle: Handle, deadline: float | None, out: torch.futures.Future[Any]) -> None:
        self._queue.put((handle, deadline, out))

    def _run(self) -> None:
        while True:
            handle, deadline, out = self._queue.get()
            try:
                limit = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
                value = handle._wait(limit, handle._timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the future's consumer
                out.set_exception(e)
            else:
                out.set_result(value)


_WATCHER: tuple[int, _Watcher] | None = None
_WATCHER_LOCK = threading.Lock()


def _watcher() -> _Watcher:
    """This process's watcher, started on first use (again in a forked child: threads do not survive a fork)."""
    global _WATCHER
    with _WATCHER_LOCK:
        if _WATCHER is None or _WATCHER[0] != os.getpid():
            _WATCHER = (os.getpid(), _Watcher())
        return _WATCHER[1]
