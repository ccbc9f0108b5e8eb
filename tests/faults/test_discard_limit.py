"""A failure that repeats at every step ends the run on every member (issue #14 item 7).

Two elastic workers and a coordinator in the test; worker 1's backend fails
every all-reduce from committed step 2 on (a deterministic failure: the
discarded step is retried, fails again, and so on). Without a limit the
workers would loop forever; with ``Timeouts.max_consecutive_discards=3``
both raise PeerLostError carrying the reasons after the third discard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal.membership.elastic import BackendSpec, ElasticGroup, gloo_backend
from shoal.elastic import Coordinator, Timeouts
from shoal.errors import ConfigError, PeerLostError
from shoal.testing import run_workers

LIMIT = 3
FROM_STEP = 2
TOKEN = "discard-limit-test-token"


class _FailsFromStep:
    """A backend whose all-reduces fail from committed step ``FROM_STEP`` on, like a deterministic bug."""

    def __init__(self, spec: BackendSpec) -> None:
        self.inner, self.step = gloo_backend(spec), spec.step

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        if self.step() >= FROM_STEP:
            raise RuntimeError(f"deterministic failure at step {self.step()}")
        return self.inner.allreduce(tensors, opts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _worker(rank: int, world: int, address: str) -> dict[str, Any]:
    timeouts = Timeouts(op=3.0, heartbeat_interval=0.1, probe=0.5, heartbeat_timeout=3.0, quorum=15.0, join=30.0,
                        max_consecutive_discards=LIMIT)
    factory = _FailsFromStep if rank == 1 else gloo_backend
    group = ElasticGroup("discards", coordinator=address, timeouts=timeouts, min_workers=2,
                         backend_factory=factory, token=TOKEN)
    verdicts: list[bool] = []
    try:
        for _ in range(FROM_STEP + 2 * LIMIT):      # more than enough: it must stop by itself
            group.start_step()
            group.all_reduce(torch.ones(4), op="avg", tag="t").wait()
            verdicts.append(group.should_commit())
    except PeerLostError as e:
        return {"verdicts": verdicts, "error": str(e), "step": group.step, "discards": group.stats.discards}
    finally:
        group.leave()
    return {"verdicts": verdicts, "error": None}


@pytest.mark.timeout(90)
def test_repeated_discards_raise_on_every_member_with_the_reasons() -> None:
    coord = Coordinator(port=0, initial_workers=2, token=TOKEN).start()
    try:
        out = run_workers(_worker, 2, coord.address, timeout=75, init_group=False)
    finally:
        coord.stop()
    for r in out:
        # Two commits, then LIMIT - 1 discards returned, and the LIMIT-th raised instead of returning.
        assert r["verdicts"] == [True] * FROM_STEP + [False] * (LIMIT - 1), r
        assert r["error"] is not None and r["step"] == FROM_STEP and r["discards"] == LIMIT, r
        assert f"{LIMIT} steps in a row were discarded" in r["error"], r["error"]
        assert f"max_consecutive_discards={LIMIT}" in r["error"], r["error"]
    assert "deterministic failure at step 2" in out[1]["error"] and f"(x{LIMIT})" in out[1]["error"], out[1]["error"]


def test_max_consecutive_discards_is_validated() -> None:
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ConfigError, match="max_consecutive_discards"):
            Timeouts(max_consecutive_discards=bad)  # type: ignore[arg-type]
    assert Timeouts().max_consecutive_discards == 20


def test_the_discard_streak_travels_with_the_healed_state() -> None:
    # A newcomer loads the run's state blob: it must give up at the same step as its peers.
    coord = Coordinator(port=0, initial_workers=1, token=TOKEN).start()
    group = ElasticGroup("streak", coordinator=coord.address, min_workers=1, token=TOKEN)
    try:
        group.discards.reasons = ["PeerLostError: lost (a)", "PeerLostError: lost (b)"]
        blob = group._blob()
        group.discards.reasons = []
        group._load_blob(blob, src=0)
        assert group.discards.reasons == ["PeerLostError: lost (a)", "PeerLostError: lost (b)"]
    finally:
        group.leave()
        coord.stop()
