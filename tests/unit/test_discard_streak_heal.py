"""A member that discarded steps and then rejoins loads a peer's discard streak of another length.

Seen on the emulated cluster (tests/e2e/test_lost_host_partition.py): a host
cut off by a partition discards the step in flight (its streak: 1 reason),
rejoins as a newcomer once its link is back, and is healed by a survivor
whose streak is empty (it committed since). The heal must load that empty
streak; it used to be refused ("0 items where the local state has 1") because
the streak travelled as a list, whose length the received-state check compares,
and the rejoining worker left the run.
"""

from __future__ import annotations

import pytest

from shoal.comm.stepping import StateEntry
from shoal.errors import PeerLostError
from shoal.membership.heal import load_blob, state_blob
from shoal.membership.vote import DiscardStreak


def _streak(n: int) -> DiscardStreak:
    s = DiscardStreak()
    for i in range(n):
        s.count(PeerLostError(f"lost {i}"), False, limit=10)
    return s


def _entry(s: DiscardStreak) -> dict[str, StateEntry]:
    return {"elastic/discards": StateEntry(s.state, s.load)}


@pytest.mark.parametrize("mine,theirs", [(1, 0), (3, 1), (0, 2), (2, 2)])
def test_a_heal_loads_a_discard_streak_of_any_length(mine: int, theirs: int) -> None:
    receiver, sender = _streak(mine), _streak(theirs)
    left = []
    load_blob(_entry(receiver), state_blob(_entry(sender)), src=0, member=1, leave=lambda: left.append(1))
    assert left == [] and receiver.reasons == sender.reasons


def test_the_streak_survives_its_own_state_round_trip_in_order() -> None:
    s = _streak(3)
    t = DiscardStreak()
    t.load(s.state())
    assert t.reasons == ["PeerLostError: lost 0", "PeerLostError: lost 1", "PeerLostError: lost 2"]
    t.count(None, True, limit=10)
    assert len(t.reasons) == 4
    with pytest.raises(PeerLostError, match="5 steps in a row"):
        t.count(None, False, limit=5)
