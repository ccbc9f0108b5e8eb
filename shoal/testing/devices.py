"""Catch, without a GPU, buffers that shoal creates without saying on which device.

Every buffer shoal allocates must live on the device of the tensors it serves
(or of the group it travels over), never on the default device by accident:
code that leaves ``device=`` out works on the CPU and fails only on CUDA
("Expected all tensors to be on the same device, cuda:0 and cpu"; "No
backend type associated with device type cpu" from NCCL).

:func:`implicit_device_guard` makes such allocations visible on a CPU-only
machine. Inside it, every tensor factory call (``torch.zeros``,
``torch.empty``, ``torch.tensor``, ``torch.arange``, ...) that is made *directly
by shoal's own code* (a file of the ``shoal`` package, this ``testing``
subpackage excepted) without a ``device`` argument is redirected to the
``meta`` device. A meta tensor has no data: the first operation that mixes
it with a real (CPU) tensor, hands it to a gloo collective or reads it on the
host raises, at the line that uses the buffer. Factory calls made by torch
itself (an optimizer's state, for instance) or by the caller's code are left
alone, so the model and its optimizer stay on the CPU.

Background threads that shoal starts through
``concurrent.futures.ThreadPoolExecutor`` (DDP's codec and bucket-done
threads, DiLoCo's, DASO's, a delayed collaborative step) run under the guard
too: torch's function modes are per thread, so the guard wraps what is
submitted to any executor while it is active.

``guard.hits`` lists ``"file:line"`` of every redirected call, so a test can
also assert that none happened.

Example::

    model, opt = build_model_and_optimizer()          # on the CPU, outside the guard
    with implicit_device_guard() as guard:
        model, opt = shoal.wrap(model, opt, shoal.DiLoCo(inner_steps=2))
        train(model, opt, steps=4)                    # raises at a shoal buffer without device=
    assert not guard.hits, guard.hits
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

_SHOAL = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTING = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# Frames between a factory call and __torch_function__: torch's dispatch helpers, and this file.
_PASS_THROUGH = (os.path.join(_TORCH, "overrides.py"), os.path.join(_TORCH, "utils", "_device.py"),
                 os.path.abspath(__file__))


def _called_by_shoal() -> str | None:
    """``file:line`` of the code that made the factory call, if it is shoal's own; else None."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _PASS_THROUGH:
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if name.startswith(_SHOAL) and not name.startswith(_TESTING):
        return f"{os.path.relpath(name, os.path.dirname(_SHOAL))}:{frame.f_lineno}"
    return None


class _Redirect(TorchFunctionMode):
    def __init__(self, device: torch.device, hits: list[str], lock: threading.Lock) -> None:
        super().__init__()
        self.device, self.hits, self.lock = device, hits, lock

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and kwargs.get("device") is None:
            where = _called_by_shoal()
            if where is not None:
                kwargs["device"] = self.device
                with self.lock:
                    self.hits.append(where)
        return func(*args, **kwargs)


class DeviceGuard:
    """What :func:`implicit_device_guard` yields: ``hits``, the redirected calls as ``file:line``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.hits: list[str] = []
        self._lock = threading.Lock()

    def mode(self) -> TorchFunctionMode:
        return _Redirect(self.device, self.hits, self._lock)


_local = threading.local()            # the guard active on this thread, if any
_patch_lock = threading.Lock()
_patch_users = 0
_original_submit = concurrent.futures.ThreadPoolExecutor.submit


def _submit(pool: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    guard: DeviceGuard | None = getattr(_local, "guard", None)
    if guard is None:
        return _original_submit(pool, fn, *args, **kwargs)

    def guarded(*a: Any, **k: Any) -> Any:
        _local.guard = guard
        try:
            with guard.mode():
                return fn(*a, **k)
        finally:
            _local.guard = None

    return _original_submit(pool, guarded, *args, **kwargs)


@contextlib.contextmanager
def implicit_device_guard(device: str | torch.device = "meta") -> Iterator[DeviceGuard]:
    """Redirect shoal's factory calls without ``device=`` to ``device`` (see the module docstring).

    Enter it on each thread that drives training (peers run as threads each
    enter their own); work those threads submit to executors inherits it.

    Example::

        with implicit_device_guard() as guard:
            train_a_few_steps()
        assert not guard.hits
    """
    global _patch_users
    guard = DeviceGuard(torch.device(device))
    with _patch_lock:
        _patch_users += 1
        concurrent.futures.ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign]
    previous = getattr(_local, "guard", None)
    _local.guard = guard
    try:
        with guard.mode():
            yield guard
    finally:
        _local.guard = previous
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                concurrent.futures.ThreadPoolExecutor.submit = _original_submit  # type: ignore[method-assign]
