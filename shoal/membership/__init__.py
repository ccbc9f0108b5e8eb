"""Membership: who is in the run, step by step, on top of the transport (:mod:`shoal.comm`).

The layer that decides; :mod:`shoal.comm` only moves tensors and never
imports from here. Modules, from the store up:

- :mod:`~shoal.membership.auth`, :mod:`~shoal.membership.records`: the run
  token and signed records in the coordinator's store.
- :mod:`~shoal.membership.coordinator`: the coordinator (launcher process):
  liveness, quorums, the verdicts; the protocol's description.
- :mod:`~shoal.membership.client`: the member client (worker process):
  join, heartbeat, quorums, the per-quorum abort watch.
- :mod:`~shoal.membership.transport`: a quorum's process group and its
  collectives, failures recorded instead of raised.
- :mod:`~shoal.membership.vote`: the first failure, the commit vote, the
  discard limit.
- :mod:`~shoal.membership.heal` and :mod:`~shoal.membership.received`:
  bringing newcomers to the run's state, and checking it before loading.
- :mod:`~shoal.membership.views`: subgroups re-applied to every quorum.
- :mod:`~shoal.membership.leaving`: an orderly leave (collectives counted
  per quorum) and the marks the launcher reads.
- :mod:`~shoal.membership.elastic`: :class:`ElasticGroup`, the group that
  follows the run's quorums: it holds a per-quorum seat (rank, size, process
  group) and swaps it, rather than subclassing :class:`~shoal.comm.Group`.

Example::

    from shoal.membership import ElasticGroup, Timeouts
    group = ElasticGroup("run1", coordinator="127.0.0.1:29400", token="s3cret-token",
                         timeouts=Timeouts(op=30.0))
"""

from shoal.membership.coordinator import Coordinator, Quorum, Timeouts
from shoal.membership.client import MemberClient
from shoal.membership.elastic import ElasticGroup

__all__ = ["Coordinator", "MemberClient", "Quorum", "Timeouts", "ElasticGroup"]
