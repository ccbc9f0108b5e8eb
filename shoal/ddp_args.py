"""torch DDP's constructor arguments that shoal's DDP takes only for compatibility.

``torch.nn.parallel.DistributedDataParallel`` has grown arguments that
tune its C++ reducer or select experimental features. A script that passes
one must not meet a bare ``TypeError``: each is accepted with torch's meaning
where shoal has one, or refused with a :class:`~shoal.errors.ConfigError`
that says what to do instead. docs/migrating.md lists every argument and
method with what shoal does.

Example::

    opts = torch_ddp_options(broadcast_buffers=None, forward_sync_buffers=False, init_sync=True,
                             check_reduction=False, static_graph=False, mixed_precision=None,
                             device_mesh=None, process_group=None, bucket_cap_mb=None,
                             bucket_cap_mb_list=None, skip_all_reduce_unused_params=False,
                             delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                             batched_grad_copy=False, codec=None, param_dtypes={torch.float32},
                             buffer_dtypes=set())
    opts.forward_sync_buffers   # False: buffers synced at start only
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shoal.codecs.base import Codec
from shoal.codecs.cast import Cast
from shoal.errors import ConfigError


@dataclass(frozen=True)
class TorchDDPOptions:
    """What torch's compatibility arguments resolve to for shoal's DDP.

    ``forward_sync_buffers``: broadcast buffers from rank 0 before each forward.
    ``init_sync``: check the model and broadcast rank 0's state at construction.
    ``init_sync_buffers``: include buffers in that start broadcast.
    ``static_graph``: the user's promise that the graph is the same every step.
    ``codec``: the codec to reduce through (``mixed_precision.reduce_dtype`` may set one).
    ``process_group``: the group (``device_mesh``'s, if one was given).
    ``bucket_cap_mb``: the cap in MiB (torch's default 25 when ``None``).
    """

    forward_sync_buffers: bool
    init_sync: bool
    init_sync_buffers: bool
    static_graph: bool
    codec: Codec | None
    process_group: Any
    bucket_cap_mb: float


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.13's rule: ``forward_sync_buffers`` wins and never affects the start; else
    ``broadcast_buffers`` (default True) decides both."""
    if forward_sync_buffers is not None:
        return _flag("forward_sync_buffers", forward_sync_buffers), True
    if broadcast_buffers is None:
        return True, True
    both = _flag("broadcast_buffers", broadcast_buffers)
    return both, both


def _group_from_mesh(device_mesh: Any, process_group: Any) -> Any:
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ConfigError("pass either process_group or device_mesh, not both (as with torch's DDP)")
    if getattr(device_mesh, "ndim", None) != 1:
        raise ConfigError(f"device_mesh must be one-dimensional (data parallel over all its ranks), got "
                          f"{getattr(device_mesh, 'ndim', type(device_mesh).__name__)} dimensions; pass "
                          "process_group=mesh.get_group(<the data-parallel dimension>) instead")
    return device_mesh.get_group()


def _mixed_precision_codec(mixed_precision: Any, codec: Codec | None, param_dtypes: set[torch.dtype],
                           buffer_dtypes: set[torch.dtype]) -> Codec | None:
    """torch's ``_MixedPrecision``: a low ``reduce_dtype`` becomes the :class:`~shoal.codecs.Cast` codec;
    casting parameters or buffers for the forward is refused (torch.autocast does that)."""
    if mixed_precision is None:
        return codec
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    reduce_dtype = getattr(mixed_precision, "reduce_dtype", None)
    buffer_dtype = getattr(mixed_precision, "buffer_dtype", None)
    for name, want, have in (("param_dtype", param_dtype, param_dtypes), ("buffer_dtype", buffer_dtype, buffer_dtypes)):
        if want is not None and have - {want}:
            raise ConfigError(
                f"mixed_precision.{name}={want} would keep a low-precision copy of the module for the forward; "
                "shoal's DDP does not: run the forward under torch.autocast(device_type, dtype=...) "
                "(or convert the model with .to(dtype)) and keep mixed_precision for reduce_dtype only")
    if reduce_dtype is None:
        reduce_dtype = param_dtype   # torch: reduction in param_dtype when reduce_dtype is not given
    if reduce_dtype is None or param_dtypes == {reduce_dtype}:
        return codec
    if reduce_dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"mixed_precision.reduce_dtype={reduce_dtype} is not supported: shoal reduces in the "
                          "parameters' dtype or, with reduce_dtype float16/bfloat16, through codecs.Cast")
    if codec is not None:
        raise ConfigError(f"mixed_precision.reduce_dtype={reduce_dtype} and codec={type(codec).__name__} both say "
                          "how gradients travel: pass one (codec=shoal.codecs.Cast(dtype) is reduce_dtype's codec)")
    return Cast(reduce_dtype)


def _refuse_unsupported(bucket_cap_mb_list: Sequence[int] | None, skip_all_reduce_unused_params: bool,
                        delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any) -> None:
    if bucket_cap_mb_list:
        raise ConfigError("bucket_cap_mb_list (one cap per bucket) is not supported: shoal builds buckets with "
                          "one cap; pass bucket_cap_mb (e.g. the largest of your list)")
    if _flag("skip_all_reduce_unused_params", skip_all_reduce_unused_params):
        raise ConfigError("skip_all_reduce_unused_params=True is not supported: shoal's DDP gives unused "
                          "parameters consistent zero gradients on every rank (find_unused_parameters=True); "
                          "drop the argument, or set requires_grad=False on parameters that never train")
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ConfigError("delay_all_reduce_named_params and param_to_hook_all_reduce go together "
                          "(as with torch's DDP): pass both or neither")


def torch_ddp_options(*, broadcast_buffers: bool | None, forward_sync_buffers: bool | None, init_sync: bool,
                      check_reduction: bool, static_graph: bool, mixed_precision: Any, device_mesh: Any,
                      process_group: Any, bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[int] | None,
                      skip_all_reduce_unused_params: bool, delay_all_reduce_named_params: Any,
                      param_to_hook_all_reduce: Any, batched_grad_copy: bool, codec: Codec | None,
                      param_dtypes: set[torch.dtype], buffer_dtypes: set[torch.dtype]) -> TorchDDPOptions:
    """Validate and resolve the compatibility arguments (see docs/migrating.md).

    ``check_reduction`` (deprecated in torch, no effect there) and
    ``batched_grad_copy`` (shoal already copies a bucket's gradients in one
    batched operation) are checked and ignored; ``delay_all_reduce_named_params``
    with ``param_to_hook_all_reduce`` only reorder torch's all-reduces, so those
    gradients are averaged in shoal's buckets with the others (same result).
    """
    _flag("check_reduction", check_reduction)
    _flag("batched_grad_copy", batched_grad_copy)
    _refuse_unsupported(bucket_cap_mb_list, skip_all_reduce_unused_params, delay_all_reduce_named_params,
                        param_to_hook_all_reduce)
    forward, at_init = _buffer_sync(broadcast_buffers, forward_sync_buffers)
    cap = 25.0 if bucket_cap_mb is None else bucket_cap_mb
    if not (isinstance(cap, (int, float)) and cap > 0):
        raise ConfigError(f"bucket_cap_mb must be > 0 (it is the size cap of a gradient bucket in MiB), got {cap}")
    return TorchDDPOptions(
        forward_sync_buffers=forward, init_sync=_flag("init_sync", init_sync), init_sync_buffers=at_init,
        static_graph=_flag("static_graph", static_graph),
        codec=_mixed_precision_codec(mixed_precision, codec, param_dtypes, buffer_dtypes),
        process_group=_group_from_mesh(device_mesh, process_group), bucket_cap_mb=float(cap))
