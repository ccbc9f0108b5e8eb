"""plan_heal: every member plans the same heal and the same newcomers from one gathered table."""

from __future__ import annotations

from typing import Any

import torch

from shoal.membership.heal import plan_heal


class _Table:
    """A group of ``len(rows)`` members whose all-gather returns ``rows`` (one per member)."""

    def __init__(self, rows: list[tuple[int, ...]], rank: int = 0) -> None:
        self.rows, self.rank, self.size = rows, rank, len(rows)
        self.device = torch.device("cpu")
        self.error: BaseException | None = None

    def all_gather_into(self, out: torch.Tensor, mine: torch.Tensor, tag: str) -> Any:
        assert mine.tolist() == list(self.rows[self.rank]), "a member sends its own row"
        out.copy_(torch.tensor([v for row in self.rows for v in row], dtype=torch.int64))

        class _Done:
            def wait(self) -> None:
                return None

        return _Done()


def test_needy_members_are_the_fresh_and_the_behind() -> None:
    plan = plan_heal(_Table([(5, 0, 0, 0), (3, 0, 0, 0), (0, 1, 0, 0)]), 5, False)   # type: ignore[arg-type]
    assert plan is not None
    assert (plan.top, plan.src, plan.needy, plan.newcomers) == (5, 0, (1, 2), (1, 2))


def test_a_member_healed_in_a_discarded_attempt_stays_a_newcomer_until_a_commit() -> None:
    # Member 2 was healed in the last quorum, whose step was then discarded: it is up to date now
    # (nothing to send it) but still holds a copy of a peer's progress, so every member counts it
    # out of this attempt's means, as in the attempt that healed it.
    rows = [(7, 0, 0, 0), (7, 0, 0, 0), (7, 0, 1, 0)]
    plans = [plan_heal(_Table(rows, rank=r), 7, False, bool(rows[r][2])) for r in range(3)]  # type: ignore[arg-type]
    assert all(p is not None and p.needy == () and p.newcomers == (2,) for p in plans), plans
    assert {p.src for p in plans if p is not None} == {0}


def test_a_recent_member_is_never_the_only_reason_to_send_state() -> None:
    plan = plan_heal(_Table([(4, 0, 1, 0), (4, 0, 0, 0)], rank=1), 4, False)   # type: ignore[arg-type]
    assert plan is not None and plan.needy == () and plan.newcomers == (0,)


def test_members_that_read_the_store_at_different_moments_agree_the_run_is_over() -> None:
    # Three fresh members: only member 1 read a finished part in the store (a leave landed between their
    # reads). Every member must reach the same verdict: the run is over, nobody trains from scratch.
    rows = [(0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 0, 0)]
    plans = [plan_heal(_Table(rows, rank=r), 0, True, False, bool(rows[r][3])) for r in range(3)]  # type: ignore[arg-type]
    assert all(p is not None and p.from_scratch and p.run_over for p in plans), plans
    # A member holding the state: not from scratch, so never "over", whatever anyone read.
    rows = [(5, 0, 0, 0), (0, 1, 0, 1)]
    plans = [plan_heal(_Table(rows, rank=r), rows[r][0], bool(rows[r][1]), False, bool(rows[r][3]))  # type: ignore[arg-type]
             for r in range(2)]
    assert all(p is not None and not p.run_over for p in plans), plans
