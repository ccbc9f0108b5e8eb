"""ResumableMean: a failed attempt's finished chunks are kept by the retry, with the values an independent
computation gives (the mean over the first attempt's members for kept chunks, over the survivors for the
rest), the same on every member; a disagreement fails the attempt instead of being applied.

The members are threads over a fake group that runs each collective in lockstep (a barrier) and can fail
a member's collective at a chosen index, as a peer's death would.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from shoal.codecs import Identity
from shoal.strategies.resume import ResumableMean, plan_chunks


class World:
    """``fail_at[r]``: the index of member r's first all_reduce that fails (None: none). A collective every
    member issues exchanges data (a member that fails in it has sent its part first, as a process killed
    mid-collective has); after the first failing index some members issue no more, so later ones fail."""

    def __init__(self, n: int, fail_at: list[int | None] | None = None) -> None:
        self.n = n
        self.fail_at = fail_at or [None] * n
        self.first_fail = min((f for f in self.fail_at if f is not None), default=None)
        self.barrier = threading.Barrier(n)
        self.slots: list[Any] = [None] * n


class FakeGroup:
    """One member's view: all_reduce (sum/avg/min) and all_gather_into, with failures as ``World`` says
    (recorded in ``error``, as an elastic group does)."""

    elastic = True

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.n
        self.error: BaseException | None = None
        self.fail_at, self.calls = world.fail_at[rank], 0

    def report_error(self, err: BaseException) -> None:
        self.error = err

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.world.slots[self.rank] = t.clone()
        self.world.barrier.wait(30)
        got = list(self.world.slots)
        self.world.barrier.wait(30)
        return got

    def all_reduce(self, t: torch.Tensor, op: str = "sum", tag: str = "") -> "FakeGroup":
        i, self.calls = self.calls, self.calls + 1
        if self.error is not None:
            return self
        first = self.world.first_fail
        if first is not None and i > first:
            self.error = RuntimeError("peer lost")     # some member issues no more collectives
            return self
        got = self._exchange(t)
        if self.fail_at is not None and i >= self.fail_at:
            self.error = RuntimeError("peer lost")
            return self
        stack = torch.stack(got)
        t.copy_(stack.min(0).values if op == "min" else stack.sum(0) / (self.size if op == "avg" else 1))
        return self

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, tag: str = "") -> "FakeGroup":
        got = self._exchange(t)
        if self.error is None:
            out.copy_(torch.cat(got))
        return self

    def wait(self) -> None:
        return None


def _run(groups: list[FakeGroup], resumes: list[ResumableMean], inputs: list[list[torch.Tensor]],
         key: tuple[Any, ...], scale: float = 1.0) -> list[list[torch.Tensor]]:
    """One attempt on every member (threads); a failed attempt is discarded on all of them, as a vote
    does, which snapshots what each finished."""
    outs = [[t.clone() for t in ts] for ts in inputs]
    errors: list[BaseException] = []

    def member(r: int) -> None:
        try:
            resumes[r].mean(outs[r], [f"t{i}" for i in range(len(outs[r]))], Identity(), groups[r], "round", key,
                            scale)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    if any(g.error is not None for g in groups):
        for r in resumes:
            r.snapshot()
    return outs


def _inputs(n: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(10, 7, generator=g), torch.randn(33, generator=g)] for _ in range(n)]


def test_plan_covers_everything_in_order_within_the_limits() -> None:
    numels = [70, 33, 5, 0, 120]
    for min_bytes, max_chunks in [(4, 100), (40, 8), (1 << 20, 16), (4, 1)]:
        plan = plan_chunks(numels, 4, min_bytes, max_chunks)
        flat = [(i, e) for chunk in plan for i, a, b in chunk for e in range(a, b)]
        assert flat == [(i, e) for i, n in enumerate(numels) for e in range(n)]
        assert len(plan) <= max_chunks
        sizes = [sum(b - a for _, a, b in c) for c in plan]
        assert all(s * 4 >= min(min_bytes, 4 * sum(numels)) for s in sizes[:-1])
    assert plan_chunks([], 4, 4, 4) == [] and plan_chunks([0], 4, 4, 4) == []


def test_a_retry_keeps_the_chunks_every_member_finished_with_the_right_values() -> None:
    x = _inputs(3, 0)
    numel = 10 * 7 + 33
    resumes = [ResumableMean(min_bytes=4 * 16, max_chunks=8) for _ in range(3)]
    plan = plan_chunks([70, 33], 4, 4 * 16, 8)
    assert len(plan) == 7
    # Attempt 1 over 3 members: all-reduce #0 is the agreement, #1.. the chunks. Member 2 dies in chunk 3
    # (#4); member 1 got chunk 3 through before seeing the failure, member 0 did not.
    w = World(3, [4, 5, 4])
    g = [FakeGroup(w, r) for r in range(3)]
    _run(g, resumes, x, key=("fragment:0", 7))
    assert [r._records["round"].done for r in resumes] == [3, 4, 3]
    # Attempt 2 over the survivors (0, 1): they agree on 3 chunks, check them and reduce the other 4.
    w2 = World(2)
    out = _run([FakeGroup(w2, 0), FakeGroup(w2, 1)], resumes[:2], x[:2], key=("fragment:0", 7))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    flat3 = torch.stack([torch.cat([t.reshape(-1) for t in ts]) for ts in x]).sum(0) / 3
    flat2 = torch.stack([torch.cat([t.reshape(-1) for t in ts]) for ts in x[:2]]).sum(0) / 2
    edge = sum(b - a for c in plan[:3] for _, a, b in c)
    got = torch.cat([t.reshape(-1) for t in out[0]])
    assert got.numel() == numel
    torch.testing.assert_close(got[:edge], flat3[:edge], rtol=0, atol=1e-6)   # kept: the 3 members' mean
    torch.testing.assert_close(got[edge:], flat2[edge:], rtol=0, atol=1e-6)   # again: the survivors' mean
    assert resumes[0].kept_chunks == 3 and resumes[0].kept_bytes == 4 * edge


def test_a_newcomer_or_another_round_keeps_nothing() -> None:
    x = _inputs(2, 1)
    resumes = [ResumableMean(min_bytes=64, max_chunks=8) for _ in range(2)]
    w = World(2, [3, 3])
    _run([FakeGroup(w, 0), FakeGroup(w, 1)], resumes, x, key=("fragment:0", 1))
    assert resumes[0]._records["round"].done == 2
    fresh = ResumableMean(min_bytes=64, max_chunks=8)        # healed into the retry: nothing of its own
    w2 = World(2)
    out = _run([FakeGroup(w2, 0), FakeGroup(w2, 1)], [resumes[0], fresh], x, key=("fragment:0", 1))
    assert resumes[0].kept_chunks == 0 and torch.equal(out[0][0], out[1][0])
    want = (x[0][0] + x[1][0]) / 2
    torch.testing.assert_close(out[0][0], want, rtol=0, atol=1e-6)
    # Both now hold every chunk of this round's attempt (finished, never committed): the next round (another
    # commit count, another key) takes none of them, on either member.
    assert resumes[0]._records["round"].done == fresh._records["round"].done == 7
    w3 = World(2)
    out = _run([FakeGroup(w3, 0), FakeGroup(w3, 1)], [resumes[0], fresh], [x[1], x[0]], key=("fragment:0", 2))
    assert resumes[0].kept_chunks == fresh.kept_chunks == 0
    torch.testing.assert_close(out[0][1], (x[0][1] + x[1][1]) / 2, rtol=0, atol=1e-6)


def test_kept_chunks_that_differ_between_members_fail_the_attempt() -> None:
    x = _inputs(2, 2)
    resumes = [ResumableMean(min_bytes=64, max_chunks=8) for _ in range(2)]
    w = World(2, [3, 3])
    _run([FakeGroup(w, 0), FakeGroup(w, 1)], resumes, x, key=("fragment:0", 1))
    resumes[1]._records["round"].saved[0][0] += 1.0           # a corrupted copy on one member
    w2 = World(2)
    g = [FakeGroup(w2, 0), FakeGroup(w2, 1)]
    _run(g, resumes, x, key=("fragment:0", 1))
    assert all(isinstance(m.error, Exception) and "differ between members" in str(m.error) for m in g)
    assert all(r._records["round"].saved == [] for r in resumes)   # forgotten: the next attempt runs whole


def test_scale_applies_to_reduced_chunks_only_once() -> None:
    x = _inputs(2, 3)
    resumes = [ResumableMean(min_bytes=64, max_chunks=4) for _ in range(2)]
    w = World(2, [2, 2])
    _run([FakeGroup(w, 0), FakeGroup(w, 1)], resumes, x, key=("k",), scale=2.0)
    w2 = World(2)
    out = _run([FakeGroup(w2, 0), FakeGroup(w2, 1)], resumes, x, key=("k",), scale=2.0)
    want = torch.cat([(a.reshape(-1) + b.reshape(-1)) for a, b in zip(x[0], x[1])])   # mean x 2
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in out[0]]), want, rtol=0, atol=1e-6)
    assert resumes[0].kept_chunks == 1


def test_bad_settings_are_refused() -> None:
    from shoal.errors import ShoalError
    with pytest.raises(ShoalError):
        ResumableMean(min_bytes=0)


class FakeElastic(FakeGroup):
    """Enough of an elastic group for Rounds: steps whose vote fails on every member if any member's
    collective failed; ``failing``: the all_reduce indices that fail on every member."""

    newcomers: tuple[int, ...] = ()
    quorum_pending = False

    def __init__(self, world: World, rank: int, failing: set[int]) -> None:
        super().__init__(world, rank)
        self.failing = failing

    def refuse_background_heal(self, why: str, when: Any = None) -> None:
        return None

    def shortfall(self) -> float:
        return 0.0

    def unique_name(self, name: str) -> str:
        return name

    def register_state(self, key: str, get: Any, load: Any, rollback: bool = False, **kw: Any) -> None:
        return None

    def begin_step(self) -> None:
        self.error = None

    def commit(self) -> bool:
        ok = self._exchange(torch.tensor([self.error is None]))
        return all(bool(t) for t in ok)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", tag: str = "") -> "FakeElastic":
        i, self.calls = self.calls, self.calls + 1
        got = self._exchange(t)
        if self.error is None and i in self.failing:
            self.error = RuntimeError("peer lost")
        if self.error is None:
            stack = torch.stack(got)
            t.copy_(stack.min(0).values if op == "min" else stack.sum(0) / (self.size if op == "avg" else 1))
        return self


def test_a_round_given_up_leaves_nothing_to_the_next_round_of_its_kind() -> None:
    from shoal.comm.group import Group
    from shoal.strategies.rounds import Round, Rounds
    Group.register(FakeElastic)
    first, second = _inputs(2, 4), _inputs(2, 5)
    w = World(2)
    # Run 1: attempt 1 fails in chunk 2 (all-reduce #3; #0 is the agreement), attempt 2 keeps chunks 0-1 and
    # fails in chunk 2 again (#5): the round is given up. Run 2 (the same kind) must reduce everything anew.
    groups = [FakeElastic(w, r, failing={3, 5}) for r in range(2)]
    results: list[list[list[torch.Tensor]]] = [[], []]
    kept: list[list[int]] = [[], []]
    errors: list[BaseException] = []

    def member(r: int) -> None:
        try:
            run_member(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def run_member(r: int) -> None:
        rounds = Rounds(groups[r], "t", max_attempts=2)
        rounds.resume = ResumableMean(min_bytes=64, max_chunks=8)
        now: dict[str, list[torch.Tensor]] = {}

        def reduce(contributes: bool) -> None:   # the round's pseudo-gradient, recomputed at every attempt
            for b, x in zip(now["buf"], now["inputs"]):
                b.copy_(x)
            rounds.mean(now["buf"], ["a", "b"], Identity(), "t", resumable=True)

        rnd = rounds.add(Round("r", reduce=reduce, apply=lambda: None))
        for inputs in (first, second):
            now.update(inputs=inputs[r], buf=[t.clone() for t in inputs[r]])
            committed = rounds.run(rnd)
            assert committed == (inputs is second), "run 1 is given up, run 2 commits"
            results[r].append(now["buf"])
            kept[r].append(rounds.resume.kept_chunks)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert kept[0] == kept[1] == [2, 2]        # run 1's second attempt kept 2 chunks; run 2 kept none
    for r in range(2):
        want = [(a + b) / 2 for a, b in zip(second[0], second[1])]
        for got, w_ in zip(results[r][1], want):
            torch.testing.assert_close(got, w_, rtol=0, atol=1e-6)
