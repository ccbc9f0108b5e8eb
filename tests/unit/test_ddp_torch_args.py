"""Every argument and public method of torch's DDP is accounted for by shoal's (issue 23).

Walks torch's own signature and class, so a torch upgrade that adds an
argument or a method fails here until shoal decides what it means (and
docs/migrating.md says so).
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import shoal
from shoal.errors import ConfigError, ShoalError

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "migrating.md")
# torch DDP methods that are not nn.Module's and do not start with "_", plus the private ones scripts call.
EXTRA_METHODS = ("_set_static_graph", "_register_fused_optim")


def _torch_args() -> list[str]:
    return [n for n in inspect.signature(TORCH_DDP.__init__).parameters if n != "self"]


def _torch_methods() -> list[str]:
    return sorted({m for m in dir(TORCH_DDP) if not m.startswith("_") and m not in dir(nn.Module)}
                  | set(EXTRA_METHODS))


@pytest.mark.parametrize("name", _torch_args())
def test_every_torch_argument_is_a_shoal_argument_and_documented(name: str) -> None:
    ours = inspect.signature(shoal.DistributedDataParallel.__init__).parameters
    assert name in ours, f"torch's DDP takes {name!r}; shoal's DDP must accept or refuse it"
    theirs = inspect.signature(TORCH_DDP.__init__).parameters[name]
    if theirs.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:  # same position: positional calls still work
        assert list(ours).index(name) == list(inspect.signature(TORCH_DDP.__init__).parameters).index(name)
    with open(DOC) as f:
        assert f"`{name}`" in f.read(), f"docs/migrating.md must say what shoal does with {name!r}"


@pytest.mark.parametrize("name", _torch_methods())
def test_every_torch_method_is_there_and_documented(name: str) -> None:
    assert hasattr(shoal.DistributedDataParallel, name), name
    with open(DOC) as f:
        assert f"`{name}" in f.read(), f"docs/migrating.md must say what shoal does with {name!r}"


def _mp(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(**{"param_dtype": None, "reduce_dtype": None, "buffer_dtype": None, **kw})


@pytest.mark.parametrize("kwargs, match", [
    ({"bucket_cap_mb_list": [1, 25]}, "bucket_cap_mb"),
    ({"skip_all_reduce_unused_params": True}, "find_unused_parameters"),
    ({"delay_all_reduce_named_params": []}, "param_to_hook_all_reduce"),
    ({"mixed_precision": _mp(param_dtype=torch.bfloat16)}, "torch.autocast"),
    ({"mixed_precision": _mp(buffer_dtype=torch.float16)}, "torch.autocast"),
    ({"mixed_precision": _mp(reduce_dtype=torch.float64)}, "Cast"),
    ({"mixed_precision": _mp(reduce_dtype=torch.bfloat16), "codec": shoal.codecs.Int8Blockwise()}, "pass one"),
    ({"device_mesh": SimpleNamespace(ndim=2)}, "get_group"),
    ({"device_mesh": SimpleNamespace(ndim=1), "process_group": object()}, "not both"),
    ({"init_sync": "no"}, "init_sync"),
    ({"static_graph": 1}, "static_graph"),
    ({"check_reduction": None}, "check_reduction"),
    ({"batched_grad_copy": "yes"}, "batched_grad_copy"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
])
def test_refused_torch_arguments_say_what_to_do(kwargs: dict, match: str) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(ConfigError, match=match):
        shoal.DistributedDataParallel(net, **kwargs)


def test_multi_device_helpers_refuse_with_the_alternative() -> None:
    for name in ("scatter", "gather", "to_kwargs"):
        with pytest.raises(ShoalError, match=r"\.to\(device\)"):
            getattr(shoal.DistributedDataParallel, name)(None)
