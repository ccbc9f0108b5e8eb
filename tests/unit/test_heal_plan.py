"""plan_heal: every member plans the same heal and the same newcomers from one gathered table."""

from __future__ import annotations

from typing import Any

import torch

from shoal.membership.heal import plan_heal


class _Table:
    """A group of ``len(rows)`` members whose all-gather returns ``rows`` (one per member)."""

    def __init__(self, rows: list[tuple[int, ...]], rank: int = 0) -> None:
        # (step, fresh, recent[, heal it downloads, can heal in the background[, saw the run finished]]):
        # short rows download none and saw nothing
        self.rows = [tuple(row) + (-1, 0, 0)[len(row) - 3:] for row in rows]
        self.rank, self.size = rank, len(rows)
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
    plan = plan_heal(_Table([(5, 0, 0), (3, 0, 0), (0, 1, 0)]), 5, False)   # type: ignore[arg-type]
    assert plan is not None
    assert (plan.top, plan.src, plan.needy, plan.newcomers) == (5, 0, (1, 2), (1, 2))


def test_a_member_healed_in_a_discarded_attempt_stays_a_newcomer_until_a_commit() -> None:
    # Member 2 was healed in the last quorum, whose step was then discarded: it is up to date now
    # (nothing to send it) but still holds a copy of a peer's progress, so every member counts it
    # out of this attempt's means, as in the attempt that healed it.
    rows = [(7, 0, 0), (7, 0, 0), (7, 0, 1)]
    plans = [plan_heal(_Table(rows, rank=r), 7, False, bool(rows[r][2])) for r in range(3)]  # type: ignore[arg-type]
    assert all(p is not None and p.needy == () and p.newcomers == (2,) for p in plans), plans
    assert {p.src for p in plans if p is not None} == {0}


def test_a_recent_member_is_never_the_only_reason_to_send_state() -> None:
    plan = plan_heal(_Table([(4, 0, 1), (4, 0, 0)], rank=1), 4, False)   # type: ignore[arg-type]
    assert plan is not None and plan.needy == () and plan.newcomers == (0,)


def test_a_downloading_member_is_neither_needy_nor_a_source() -> None:
    # Member 2 is still downloading heal 9 in the background (its step follows the run's): the new
    # quorum sends it nothing and takes no state from it; member 3 is new and everyone can heal in
    # the background, so it is admitted as a downloader too (background=True: no blocking heal).
    rows = [(6, 0, 0, -1, 1), (6, 0, 0, -1, 1), (6, 0, 1, 9, 1), (0, 1, 0, -1, 1)]
    plans = [plan_heal(_Table(rows, rank=r), *rows[r][:1], bool(rows[r][1]), bool(rows[r][2]), rows[r][3],
                       bool(rows[r][4])) for r in range(4)]   # type: ignore[arg-type]
    for p in plans:
        assert p is not None
        assert (p.src, p.ready, p.needy, p.downloading, p.background) == (0, (0, 1), (3,), {2: 9}, True)


def test_background_needs_every_member_capable_and_a_holder_of_the_state() -> None:
    one_blocking = plan_heal(_Table([(4, 0, 0, -1, 1), (0, 1, 0, -1, 0)]), 4, False, False, -1, True)  # type: ignore[arg-type]
    assert one_blocking is not None and one_blocking.needy == (1,) and not one_blocking.background
    # Nobody holds the run's state (the only holder left while member 1 downloaded): the download is
    # abandoned and both start from scratch, as fresh members do.
    nobody = plan_heal(_Table([(4, 1, 0, -1, 1), (4, 0, 1, 3, 1)]), 4, True, False, -1, True)  # type: ignore[arg-type]
    assert nobody is not None and nobody.from_scratch and nobody.downloading == {} and not nobody.background


def test_a_downloader_is_healed_blocking_in_a_quorum_that_cannot_have_a_non_contributor() -> None:
    # Member 1 was downloading heal 5; member 2 cannot have a non-contributor now (a codec, a quorum
    # across hosts under a two-level DDP): member 1 is needy again, and the heal is the blocking one.
    rows = [(8, 0, 0, -1, 1), (8, 0, 1, 5, 1), (8, 0, 0, -1, 0)]
    plan = plan_heal(_Table(rows, rank=1), 8, False, True, 5, True)   # type: ignore[arg-type]
    assert plan is not None and plan.needy == (1,) and plan.downloading == {} and not plan.background


def test_members_that_read_the_store_at_different_moments_agree_the_run_is_over() -> None:
    # Three fresh members: only member 1 read a finished part in the store (a leave landed between their
    # reads). Every member must reach the same verdict: the run is over, nobody trains from scratch.
    rows = [(0, 1, 0, -1, 0, 0), (0, 1, 0, -1, 0, 1), (0, 1, 0, -1, 0, 0)]
    plans = [plan_heal(_Table(rows, rank=r), 0, True, False, run_finished=bool(rows[r][5]))  # type: ignore[arg-type]
             for r in range(3)]
    assert all(p is not None and p.from_scratch and p.run_over for p in plans), plans
    # A member holding the state: not from scratch, so never "over", whatever anyone read.
    rows = [(5, 0, 0, -1, 0, 0), (0, 1, 0, -1, 0, 1)]
    plans = [plan_heal(_Table(rows, rank=r), rows[r][0], bool(rows[r][1]), False,  # type: ignore[arg-type]
                       run_finished=bool(rows[r][5])) for r in range(2)]
    assert all(p is not None and not p.run_over for p in plans), plans


def _plans(rows: list[tuple[int, ...]]) -> list[Any]:
    plans = [plan_heal(_Table(rows, rank=r), rows[r][0], bool(rows[r][1]),  # type: ignore[arg-type]
                       bool(rows[r][2]), rows[r][3], bool(rows[r][4])) for r in range(len(rows))]
    assert all(p == plans[0] for p in plans), plans   # the same plan on every member
    return plans


def test_a_downloader_ahead_of_every_holder_after_a_split_vote_is_healed_never_the_source() -> None:
    # Member 2 downloads heal 9 and has loaded nothing (it reports itself fresh); a vote that split during a
    # coordinator outage committed a step on it alone. It must not set the run's step: the holders' step 6
    # is the top, member 0 the source, and member 2 is healed afresh (in the background: it is needy again).
    # Planned from the highest step, member 2 would have been the source of a blocking heal of the others.
    (plan, *_) = _plans([(6, 0, 0, -1, 1), (6, 0, 0, -1, 1), (7, 1, 0, 9, 1)])
    assert (plan.top, plan.src, plan.needy, plan.ready, plan.downloading) == (6, 0, (2,), (0, 1), {}), plan
    assert plan.background and not plan.from_scratch


def test_a_downloader_behind_the_run_is_healed_afresh_not_kept_downloading() -> None:
    # Its recorded updates cover the steps since its admission; at another step than the run's they do not
    # lead to the run's state, so it downloads a new snapshot instead of replaying a wrong count.
    (plan, *_) = _plans([(6, 0, 0, -1, 1), (6, 0, 0, -1, 1), (5, 1, 0, 9, 1)])
    assert (plan.top, plan.needy, plan.downloading) == (6, (2,), {}), plan
    (kept, *_) = _plans([(6, 0, 0, -1, 1), (6, 0, 0, -1, 1), (6, 1, 0, 9, 1)])   # at the run's step: kept
    assert (kept.needy, kept.downloading, kept.background) == ((), {2: 9}, True), kept
