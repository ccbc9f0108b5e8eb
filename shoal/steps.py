"""The round runner's two step primitives: open a step, vote it. The only place above membership that does.

A strategy synchronises through typed rounds (:mod:`shoal.strategies.rounds`:
a :class:`~shoal.strategies.rounds.Round` run by
:class:`~shoal.strategies.rounds.Rounds`, or one-off by
:func:`~shoal.strategies.rounds.run_round`), and the runner opens and votes
each round's step through these two functions. Code that is not a round
calls them too, instead of ``group.begin_step()`` / ``group.commit()`` by
hand, so that every place above the membership package where a step begins
or is voted is one of these calls (``tests/unit/test_vote_sites.py`` holds
the count at zero). They are not in the runner's module only because code
below the strategies (DDP, ZeRO, the elastic sampler) needs them and may not
import the strategies package.

The steps that are not a round, and why:

- shoal's ``DistributedDataParallel.forward`` opens the step before its
  first collective (buffer broadcast; gradient means in backward): a DDP
  step spans forward, backward and the optimizer step, so no single call
  holds it; the optimizer votes it (``ElasticOptimizer.step`` through
  ``run_round``, or ``ZeroRedundancyOptimizer``).
- ``ElasticSampler.next_batch`` opens the step to read its quorum (size and
  rank give this worker's slice); it issues no collective, and the step's
  vote is the optimizer's.
- ``ZeroRedundancyOptimizer``: its step may begin in DDP's forward and its
  shards be stepped bucket by bucket in backward; its vote waits for the
  parameter broadcasts, and the journal of what the step changed is restored
  around it (on a discard, and on an exception before the verdict).

On a static group opening runs only the ``before_begin_step`` hooks and the
vote is always True (it counts the step and runs the ``on_commit`` hooks).

Example (a step whose collectives no round issues)::

    from shoal.steps import open_step, vote_step

    open_step(group)                          # elastic: adopt the latest quorum, heal newcomers
    group.all_reduce(flat_grad, op="avg", tag="grad").wait()
    if vote_step(group):                      # the same verdict on every member
        optimizer.step()
"""

from __future__ import annotations

from shoal.comm.stepping import StepInterface


def open_step(group: StepInterface) -> None:
    """Begin ``group``'s step, or stay in the one already open (the ``before_begin_step`` hooks run either way).

    Elastic: adopt the latest quorum and heal newcomers the first time in a
    step; afterwards ``group.size``, ``group.rank`` and ``group.newcomers``
    are this step's. Static: only the hooks run.
    """
    group.begin_step()


def vote_step(group: StepInterface) -> bool:
    """End ``group``'s open step with the same verdict on every member: True to apply it, False to drop it.

    Static: always True. Elastic: on False the rollback state registered
    with the group is restored and the next :func:`open_step` moves to a
    quorum without the failed member.
    """
    return group.commit()
