"""The two-level all-reduce on a real emulated cluster: hosts found from the launcher's SHOAL_HOST_ID."""

from __future__ import annotations

import contextlib
import io

import pytest

from shoal.bench import allreduce
from emulated import NEEDS_CLUSTER

pytestmark = NEEDS_CLUSTER


@pytest.mark.timeout(90)
def test_two_level_all_reduce_is_exact_across_emulated_hosts() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = allreduce.main(["--hosts", "2", "--procs-per-host", "2", "--bandwidth", "1gbit", "--mb", "1",
                             "--iters", "1", "--warmup", "0", "--hierarchical", "--chunk-mb", "0.25"])
    text = out.getvalue()
    assert rc == 0, text
    assert "results correct" in text and "two-level (hierarchical) seconds" in text, text
    assert "hosts found by topology discovery: 2" in text, text
