"""The abort flag is keyed by its quorum: an old quorum's flag never aborts a newer quorum's step.

The race (issue 19): the heartbeat thread reads the watched prefix (quorum 1), the training thread
enters quorum 2 and re-points the watch, and only then does the heartbeat thread find quorum 1's
flag raised. Here that interleaving is forced, deterministically, by a store whose ``check`` runs
the training thread's re-pointing in the middle of the heartbeat's look: no sleeps, no threads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch.distributed as dist

from shoal.membership.vote import Failures
from shoal.membership.client import AbortWatch

OLD, NEW = "run/q1/", "run/q2/"


class _Interleaving:
    """A store that runs ``between`` once, while the heartbeat is inside its check of ``key``."""

    def __init__(self, store: Any, key: str, between: Callable[[], None]) -> None:
        self.store, self.key, self.between = store, key, between

    def check(self, keys: list[str]) -> bool:
        found = bool(self.store.check(keys))
        if self.key in keys and self.between is not None:
            between, self.between = self.between, None   # type: ignore[assignment]
            between()
        return found

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def clone(self) -> "_Interleaving":
        return self


def _store() -> Any:
    return dist.HashStore()


def test_an_old_quorums_flag_seen_after_the_watch_moved_does_not_abort_the_new_quorum() -> None:
    real = _store()
    real.set(OLD + "abort", "PeerLostError")        # quorum 1 failed: its flag stays in the store
    watch = AbortWatch()
    watch.watch(OLD)
    # The heartbeat reads OLD, then (inside its store call) the training thread enters quorum 2.
    watch.poll(_Interleaving(real, OLD + "abort", lambda: watch.watch(NEW)))
    assert watch.prefix == NEW
    assert not watch.raised(NEW), "quorum 1's abort flag aborted quorum 2's first step"
    watch.poll(real)                                  # the next beat looks at quorum 2's own flag
    assert not watch.raised(NEW)
    real.set(NEW + "abort", "CommTimeoutError")       # quorum 2 really fails: now it aborts
    watch.poll(real)
    assert watch.raised(NEW) and not watch.raised(OLD)


def test_a_flag_seen_before_the_watch_moved_is_forgotten_by_the_new_quorum() -> None:
    real = _store()
    real.set(OLD + "abort", "PeerLostError")
    watch = AbortWatch()
    watch.watch(OLD)
    watch.poll(real)
    assert watch.raised(OLD)
    watch.watch(NEW)
    assert not watch.raised(NEW) and not watch.raised(OLD)


def test_failures_reads_the_abort_of_its_own_quorum_only() -> None:
    real = _store()
    real.set(OLD + "abort", "PeerLostError")
    current = {"prefix": OLD}
    client = SimpleNamespace(store=_Interleaving(real, "-", lambda: None), abort=AbortWatch())
    failures = Failures(client, lambda: current["prefix"], lambda *a, **k: None)  # type: ignore[arg-type]
    client.abort.watch(OLD)
    client.abort.poll(_Interleaving(real, OLD + "abort", lambda: (client.abort.watch(NEW),
                                                                  current.update(prefix=NEW))))
    assert not failures.aborted
    failures.record(RuntimeError("a peer closed its socket"))   # this member fails in quorum 2
    assert real.check([NEW + "abort"])
    client.abort.poll(real)
    assert failures.aborted
