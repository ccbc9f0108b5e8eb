"""Every tensor factory call in shoal's library code names its device (issue #13).

A buffer created without ``device=`` lands on the default device (the CPU)
and breaks on CUDA next to the tensors it serves or in an NCCL collective.
The runtime check (tests/dist/test_device_guard.py) covers the paths a few
training steps reach; this scan covers every call site of the library,
reached or not. Host-side buffers say ``device="cpu"`` on purpose, so a
reader (and this test) can tell them from an oversight. Not scanned: the
benchmark harness (shoal/bench), the CLI and shoal/testing, which build
their own models and data.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shoal")
SKIP = ("bench", "cli", "testing")
# torch functions that create a tensor from nothing (their *_like and Tensor.new_* forms inherit a device).
FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
             "linspace", "logspace", "eye", "as_tensor", "empty_strided", "scalar_tensor"}


def _calls_without_device(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" or k.arg is None for k in node.keywords)):   # None: **kwargs
            found.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{node.lineno} torch.{node.func.attr}(...)")
    return found


def test_every_factory_call_in_shoal_names_its_device() -> None:
    found = []
    scanned = 0
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        if rel.split(os.sep)[0] in SKIP:
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                scanned += 1
                found += _calls_without_device(os.path.join(folder, name))
    assert scanned > 40, f"scanned only {scanned} files under {ROOT}"
    assert not found, ("tensors created without device= (pass the device of the tensors served or of the "
                       "group, or device=\"cpu\" for host-side data):\n" + "\n".join(found))


def test_the_scan_sees_a_missing_device(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "sample.py")
    with open(path, "w") as f:
        f.write("import torch\na = torch.zeros(3)\nb = torch.zeros(3, device=x.device)\nc = torch.tensor([1], **kw)\n")
    assert [s.split(":")[1] for s in _calls_without_device(path)] == ["2 torch.zeros(...)"]
