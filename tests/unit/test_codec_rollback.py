"""A codec's rollback snapshot (what an elastic group restores after a discarded step).

Reference: a second codec that only ever sees the committed steps. A codec
that runs every step, discarded ones included, and is restored from its
``rollback_state()`` after each discard must produce bitwise the same means
and end in the same state. PowerSGD's snapshot holds its tensors by
reference (no per-step copy); the test also checks that the step did not
write into them.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from shoal.codecs import ErrorFeedback, PowerSGD, SparseLoCo, TopK
from shoal.comm import Group
from shoal.testing import free_port

NAMES = ["w1", "b1", "w2"]
VERDICTS = [True, True, False, True, False, False, True, True, False, True]


@pytest.fixture(scope="module")
def group():
    created = False
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )
        created = True
    yield Group()
    if created:  # later tests in this process check the no-process-group errors
        dist.destroy_process_group()


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(24, 10, generator=g), torch.randn(10, generator=g), torch.randn(6, 24, generator=g)]


def _flat_state(state: dict) -> dict:
    """Tensors of a state dict by path (nested dicts flattened), everything else as is."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in _flat_state(v).items()})
        else:
            out[k] = v
    return out


def _assert_same_state(a: dict, b: dict) -> None:
    fa, fb = _flat_state(a), _flat_state(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor) or isinstance(fb[k], torch.Tensor):
            # a counter is a device tensor in a rollback snapshot (no host sync), an int in a state dict
            assert torch.equal(torch.as_tensor(fa[k]), torch.as_tensor(fb[k])), k
        else:
            assert fa[k] == fb[k], k


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2, min_compression_rate=1.0),
                                  lambda: PowerSGD(rank=3, min_compression_rate=1.0, start_iter=2),
                                  lambda: ErrorFeedback(TopK(0.3)), lambda: SparseLoCo(0.05, 2, 64)],
                         ids=["powersgd", "powersgd-start2", "ef-topk", "sparseloco"])
def test_rollback_after_discards_equals_a_codec_that_saw_only_commits(group, make) -> None:
    rolled, ref = make(), make()
    for step, commit in enumerate(VERDICTS):
        snap = rolled.rollback_state()
        before = rolled.state_dict()               # a deep copy, to check the snapshot is left intact
        got = [t.clone() for t in _grads(step)]
        rolled.mean(got, NAMES, group, "t")
        _assert_same_state(snap, before)           # the step wrote nothing into the snapshot
        if commit:
            want = [t.clone() for t in _grads(step)]
            ref.mean(want, NAMES, group, "t")
            for a, b in zip(got, want):
                assert torch.equal(a, b), step
        else:
            rolled.load_state_dict(snap)
            _assert_same_state(rolled.state_dict(), before)
    _assert_same_state(rolled.state_dict(), ref.state_dict())


def test_powersgd_snapshot_holds_references_not_copies(group) -> None:
    codec = PowerSGD(rank=2, min_compression_rate=1.0)
    for step in range(3):
        snap = codec.rollback_state()
        codec.mean(_grads(step), NAMES, group, "t")
    snap = codec.rollback_state()
    assert snap["errors"] and all(t is codec.errors[n] for n, t in snap["errors"].items())
    assert snap["q"] and all(t is codec.q[n] for n, t in snap["q"].items())
    # After one more step the codec's tensors are others (the spares), not the snapshot's.
    codec.mean(_grads(3), NAMES, group, "t")
    assert all(t is not codec.errors[n] for n, t in snap["errors"].items())
