"""The two questions about a group's steps that code above the transport may ask.

Code above :mod:`shoal.comm` does not ask what kind of group it holds: it
asks how the group's steps behave. A group's :class:`~shoal.comm.start.Traits`
answer these questions here, in one place; a feature that must *refuse* a
kind of group reads ``group.traits`` itself (its error names the trait).

:func:`members_fixed`
    The members are known at setup and never change. Checks against them
    (sizes, hosts, slots) and layouts made once hold for the whole run, and a
    step no one voted counts as committed. Otherwise the members are known
    only inside a step (after ``begin_step``) and only a voted step counts.
:func:`step_ends_at_vote`
    No collective may stay in flight past a step's vote: every reduction a
    step launched must land before ``commit`` (the next ``begin_step`` may
    change the quorum, and a failed step rolls back).

Example::

    from shoal.comm.asks import members_fixed, step_ends_at_vote

    if members_fixed(group):
        check_world(group.size)        # once, at setup
    ...
    if step_ends_at_vote(group):
        land_every_reduction()         # before the round's vote
"""

from __future__ import annotations

from typing import Protocol

from shoal.comm.start import Traits


class _HasTraits(Protocol):
    @property
    def traits(self) -> Traits: ...


def members_fixed(group: _HasTraits) -> bool:
    """True when ``group``'s members are known at setup and never change (see the module docstring).

    Example::

        layout = STATIC if members_fixed(group) else group.quorum.qid
    """
    return not group.traits.members_change


def step_ends_at_vote(group: _HasTraits) -> bool:
    """True when no collective of a step may stay in flight past its vote (see the module docstring).

    Example::

        if step_ends_at_vote(group):
            handle.wait()   # before group.commit()
    """
    return not group.traits.work_in_flight
