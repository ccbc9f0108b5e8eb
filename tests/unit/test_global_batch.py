"""ElasticSampler and global_share: a step's samples go to its contributors, and with ``global_batch`` the
survivors of a kill (and the members while a joiner catches up) take over the missing workers' share.

The fake group plays a run's membership step by step: each member of a step asks the sampler for its
indices, then the step commits (or is discarded). The oracle is the dataset itself: what the committed
steps' contributors read, in order, must be the index stream without a gap or a repeat.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest

from shoal.elastic import ElasticSampler, global_share
from shoal.errors import ConfigError, ShoalError


class Member:
    """One member's view of an elastic group: its rank and the step's quorum size and out ranks."""

    traits = SimpleNamespace(members_change=True)

    def __init__(self, rank: int, size: int, out: frozenset[int] = frozenset()) -> None:
        self.rank, self.size, self.out = rank, size, out
        self.states: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {}
        self.commits: list[Callable[[], None]] = []
        self.began = 0

    def out_ranks(self) -> frozenset[int]:
        return self.out

    def begin_step(self) -> None:
        self.began += 1

    def register_state(self, key: str, get: Callable[[], Any], load: Callable[[Any], Any]) -> None:
        self.states[key] = (get, load)

    def unique_name(self, name: str) -> str:
        return name

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.commits.append(fn)

    def commit(self) -> None:
        for fn in self.commits:
            fn()


def _run(steps: list[tuple[int, frozenset[int], bool]], **kw: Any) -> tuple[list[int], list[list[list[int]]]]:
    """Play ``steps`` (quorum size, out ranks, committed): ranks ``0..size-1`` are the step's members. Each rank's
    sampler lives on across steps (a discarded step leaves it as it is); a rank outside the quorum is dead and
    its sampler dropped; one that comes back is a new sampler that loads a live member's registered state, as
    a heal does. The indices the committed steps' contributors read, in order, and every step's slices."""
    members: dict[int, Member] = {}
    samplers: dict[int, ElasticSampler] = {}
    read: list[int] = []
    slices = []
    for size, out, ok in steps:
        for r in [r for r in samplers if r >= size]:
            del samplers[r], members[r]
        for r in range(size):
            if r not in samplers:
                members[r] = Member(r, size, out)
                samplers[r] = ElasticSampler(1000, members[r], shuffle=False, **kw)
                live = next((m for q, m in members.items() if q != r and q in samplers), None)
                if live is not None:   # the heal: the survivors' cursor, through the registered state
                    members[r].states["sampler"][1](live.states["sampler"][0]())
            members[r].size, members[r].out = size, out
        began = [members[r].began for r in range(size)]
        got = [samplers[r].next_batch() for r in range(size)]
        assert [members[r].began for r in range(size)] == [b + 1 for b in began]   # it started the step
        assert len({samplers[r].last_global for r in range(size)}) == 1
        slices.append(got)
        if ok:
            read += [i for r in range(size) if r not in out for i in got[r]]
            for r in range(size):
                members[r].commit()
            assert len({samplers[r].cursor for r in range(size)}) == 1
    return read, slices


def test_per_worker_batch_is_unchanged_without_joiners() -> None:
    read, slices = _run([(4, frozenset(), True), (3, frozenset(), True)], batch_size=8)
    assert slices[0][1] == list(range(8, 16)) and slices[1][2] == list(range(48, 56))
    assert read == list(range(56))


def test_a_joiner_catching_up_skips_no_sample() -> None:
    """Rank 1 catches up (its gradient counts zero): the contributors read consecutive slices; the
    joiner's slice comes after theirs, and the next step reads it again (before: it was skipped)."""
    read, slices = _run([(4, frozenset({1}), True), (4, frozenset(), True)], batch_size=8)
    assert slices[0][0] == list(range(0, 8)) and slices[0][2] == list(range(8, 16))
    assert slices[0][3] == list(range(16, 24)) and slices[0][1] == list(range(24, 32))
    assert read == list(range(24 + 32))


@pytest.mark.parametrize("size,out,per", [(4, frozenset(), 8), (3, frozenset(), 11), (4, frozenset({0}), 11),
                                          (2, frozenset(), 16), (4, frozenset({1, 3}), 16), (1, frozenset(), 32)])
def test_global_batch_is_split_over_the_contributors(size: int, out: frozenset[int], per: int) -> None:
    read, slices = _run([(size, out, True)], global_batch=32)
    assert all(len(s) == per for s in slices[0])
    assert read == list(range(per * (size - len(out))))
    member = Member(0, size, out)
    assert global_share(member, 32) == per
    assert member.began == 1   # it started the step: the share is the step's quorum's


def test_global_batch_keeps_the_stream_across_a_kill_a_discard_and_a_join() -> None:
    steps = [(4, frozenset(), True), (4, frozenset(), False),   # the kill: the step in flight is discarded
             (3, frozenset(), True), (4, frozenset({3}), True), (4, frozenset(), True)]
    read, slices = _run(steps, global_batch=32)
    assert [len(s[0]) for s in slices] == [8, 8, 11, 11, 8]
    assert read == list(range(32 + 33 + 33 + 32))


@pytest.mark.parametrize("kw,per", [({"global_batch": 32}, 11), ({"batch_size": 8}, 8)])
def test_a_joiner_reads_at_most_joiner_batch_samples_and_the_stream_is_unchanged(kw: dict[str, int],
                                                                               per: int) -> None:
    """joiner_batch=2: rank 3 catching up computes 2 samples (the first of its slice), not a full share; the
    contributors' slices, the step's global count and the committed stream are those without it."""
    steps = [(4, frozenset({3}), True), (4, frozenset({3}), False), (4, frozenset(), True)]
    read, slices = _run(steps, joiner_batch=2, **kw)
    full_read, full = _run(steps, **kw)
    assert [len(s) for s in slices[0]] == [per, per, per, 2] and slices[0][3] == full[0][3][:2]
    assert [s[:3] for s in slices] == [s[:3] for s in full] and read == full_read
    assert slices[2] == full[2]   # caught up: a contributor's share again
    assert global_share(Member(3, 4, frozenset({3})), 32, joiner_batch=2) == 2
    assert global_share(Member(3, 4, frozenset({3})), 32, joiner_batch=20) == 11   # never more than a share
    assert global_share(Member(0, 4, frozenset({3})), 32, joiner_batch=2) == 11


def test_sampler_arguments_are_checked() -> None:
    m = Member(0, 2)
    with pytest.raises(ConfigError, match="exactly one of batch_size"):
        ElasticSampler(10, m)
    with pytest.raises(ConfigError, match="exactly one of batch_size"):
        ElasticSampler(10, m, 4, global_batch=8)
    with pytest.raises(ConfigError, match="global_batch must be"):
        ElasticSampler(10, m, global_batch=0)
    with pytest.raises(ConfigError, match="global_batch must be"):
        global_share(m, True)   # type: ignore[arg-type]
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="joiner_batch must be"):
            ElasticSampler(10, m, global_batch=8, joiner_batch=bad)   # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="joiner_batch must be"):
            global_share(m, 8, joiner_batch=bad)   # type: ignore[arg-type]
    with pytest.raises(ShoalError, match="no member of this step's quorum contributes"):
        global_share(Member(0, 2, frozenset({0, 1})), 8)
