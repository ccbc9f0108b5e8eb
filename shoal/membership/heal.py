"""Healing: bringing newcomers of a quorum up to the run's state, and the per-step rollback snapshot.

The registered state is the group's one registry of the step interface
(:class:`~shoal.comm.stepping.StateEntry`, ``group.register_state``). Owned here:

- :func:`plan_heal`: in each new quorum the members exchange (committed
  step, fresh); everyone behind or new is *needy*, and the lowest-ranked
  up-to-date member is the source.
- :func:`send_state`: the source's state as one serialised blob
  (:func:`state_blob`), point to point and in chunks, to the needy members
  only (a broadcast would push it through every member's link); every chunk
  is one operation bounded by ``Timeouts.op``, and :func:`healed_barrier`
  (bounded by ``Timeouts.quorum``) holds the others, so a state that takes
  longer than ``op`` to cross a slow link still heals.
- :func:`load_blob`: a receiver checks the blob against its own state
  before loading any of it (:mod:`shoal.membership.received`: shapes, dtypes,
  NaN/Inf); state that fails is refused and never loaded: the receiver logs
  why, leaves the run and raises :class:`~shoal.errors.ShoalError`.
- :func:`snapshot` / :func:`restore`: the rollback states, taken at each
  step's start and restored when the step is discarded.

Example (what :meth:`ElasticGroup.begin_step` does in a new quorum)::

    plan = plan_heal(group, group.step, fresh)
    if plan is not None and plan.needy:
        blob = send_state(group, plan, lambda: state_blob(states), chunk=4 << 20)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from shoal.membership.transport import ElasticCollectives
from shoal.comm.objects import from_bytes, to_bytes
from shoal.membership.received import check_received
from shoal.comm.stepping import StateEntry
from shoal.errors import CommTimeoutError, PeerLostError, ShoalError

CONTROL_TAG = "elastic/control"
HEAL_TAG = "elastic/heal"
HEAL_CHUNK = 4 << 20  # bytes per point-to-point heal message (1.7 s at 20 mbit)
log = logging.getLogger("shoal.elastic")


@dataclass(frozen=True)
class HealPlan:
    """Who sends the run's state (``src``) to whom (``needy``), and the step they all hold after (``top``).

    ``recent``: members not needy now that were healed since their last
    committed step (in an earlier, discarded attempt): they still hold a
    copy of a peer's progress, so they remain newcomers until a step commits.
    """

    top: int
    src: int
    needy: tuple[int, ...]
    recent: tuple[int, ...] = ()
    from_scratch: bool = False   # no member holds the run's state: every one is fresh at step ``top``
    ready: tuple[int, ...] = ()  # members holding the run's state at ``top`` (possible sources)
    downloading: dict[int, int] = field(default_factory=dict)   # rank -> heal id it still downloads
    background: bool = False     # every member can heal in the background (shoal.membership.catchup)
    run_over: bool = False       # from scratch in a run where some member saw a finished part: stop, not train

    @property
    def newcomers(self) -> tuple[int, ...]:
        """Every member that brings no progress of its own to this step (the same on every member)."""
        return tuple(sorted(set(self.needy) | set(self.recent)))


def snapshot(states: Mapping[str, StateEntry]) -> dict[str, Any]:
    """The rollback states' snapshots (``snapshot()`` where given, else ``get()``)."""
    return {k: (s.snapshot or s.get)() for k, s in states.items() if s.rollback}


def restore(states: Mapping[str, StateEntry], snaps: Mapping[str, Any]) -> None:
    """Load the snapshots of :func:`snapshot` back (a discarded step)."""
    for k, snap in snaps.items():
        states[k].load(snap)


def state_blob(states: Mapping[str, StateEntry]) -> torch.Tensor:
    """Every registered state, serialised into one ``uint8`` tensor."""
    return to_bytes({k: s.get() for k, s in states.items()})


def plan_heal(group: ElasticCollectives, step: int, fresh: bool, recent: bool = False, downloading: int = -1,
              capable: bool = False, run_finished: bool = False) -> HealPlan | None:
    """Exchange every member's (committed step, fresh, healed since its last commit, heal it still
    downloads or -1, can heal in the background, saw the run finished) and plan the heal.

    None if the exchange failed. Every member plans from the same gathered
    table, so every member computes the same plan, the same newcomers and the
    same verdict on a run that is over (``run_finished``: this member read a
    finished part in the store; any member's reading counts for all, so
    members that read the store at different moments never disagree).
    ``fresh``: the member holds none of the run's state (new, or a background
    joiner that has not loaded its download yet); such members never set the
    run's step. A member still downloading a background heal
    (:mod:`shoal.membership.catchup`) at the run's step is neither needy nor a
    source; at another step it is healed afresh.
    """
    cols = 6
    mine = torch.tensor([step, int(fresh), int(recent), downloading, int(capable), int(run_finished)],
                        dtype=torch.int64, device=group.device)
    table = torch.empty(cols * group.size, dtype=torch.int64, device=group.device)
    group.all_gather_into(table, mine, tag=CONTROL_TAG).wait()
    if group.error is not None:
        return None
    steps, news, recents = table[0::cols].tolist(), table[1::cols].tolist(), table[2::cols].tolist()
    hids, capables = table[3::cols].tolist(), table[4::cols].tolist()
    # A member that holds none of the run's state (fresh, or a downloader that has not loaded yet) does not set
    # the run's step: after a vote that split during a coordinator outage it may be ahead of every holder, and
    # it must then be healed, never be the source. A downloader stays one only at that step: its recorded
    # updates cover the steps since its admission, not some other member's (else it is healed afresh).
    holders = [r for r in range(group.size) if not news[r]]
    top = max(steps[r] for r in holders) if holders else max(steps)
    loading = {r: int(h) for r, h in enumerate(hids) if h >= 0 and steps[r] == top}
    ready = [r for r in range(group.size) if steps[r] == top and not news[r] and r not in loading]
    if not ready or not all(capables):
        # Nobody holds the run's state (whoever was downloading starts from scratch with the rest), or
        # a member cannot have a non-contributor now: whoever was downloading is healed blocking instead.
        loading = {}
    src = min(ready or [r for r in range(group.size) if steps[r] == top])
    needy = tuple(r for r in range(group.size)
                  if r != src and r not in loading and (steps[r] < top or news[r] or hids[r] >= 0))
    return HealPlan(top, src, needy, tuple(r for r in range(group.size) if recents[r] and r not in needy),
                    from_scratch=not ready, ready=tuple(ready), downloading=loading,
                    background=bool(ready) and all(capables), run_over=not ready and any(table[5::cols].tolist()))


def send_state(group: ElasticCollectives, plan: HealPlan, make_blob: Callable[[], torch.Tensor],
               chunk: int) -> torch.Tensor:
    """The source's blob on the source and the needy members (unfilled if a failure was recorded)."""
    src, rank = plan.src, group.rank
    empty = torch.empty(0, dtype=torch.uint8, device=group.device)
    blob = make_blob() if rank == src else empty
    n = torch.tensor([blob.numel()], dtype=torch.int64, device=group.device)
    group.broadcast(n, src=src, tag=HEAL_TAG).wait()
    if rank != src:
        blob = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
    if rank != src and rank not in plan.needy:
        return blob
    for i, start in enumerate(range(0, blob.numel(), chunk)):
        part = blob[start:start + chunk]
        if rank == src:
            handles = [group.p2p("send", part, dst, i, HEAL_TAG) for dst in plan.needy]
        else:
            handles = [group.p2p("recv", part, src, i, HEAL_TAG)]
        for h in handles:
            h.wait()
        if group.error is not None:
            break
    return blob


def broadcast_object(group: ElasticCollectives, src: int, obj: Any) -> Any:
    """``obj`` (given on ``src``, a small picklable tree) on every member: two broadcasts (its size, its
    bytes), each bounded by ``Timeouts.op``; None where a failure was recorded."""
    blob = to_bytes(obj).to(group.device) if group.rank == src else torch.empty(0, dtype=torch.uint8,
                                                                                  device=group.device)
    n = torch.tensor([blob.numel()], dtype=torch.int64, device=group.device)
    group.broadcast(n, src=src, tag=CONTROL_TAG).wait()
    if group.error is not None:
        return None
    if group.rank != src:
        blob = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(blob, src=src, tag=CONTROL_TAG).wait()
    if group.error is not None:
        return None
    try:
        return from_bytes(blob.cpu())
    except Exception:  # noqa: BLE001 - whatever a malformed blob makes torch.load raise: the caller refuses None
        return None


def healed_barrier(group: ElasticCollectives, prefix: str) -> None:
    """Wait in the store until every member is past the heal (``Timeouts.quorum``), or a failure.

    Members not involved in the heal would otherwise wait for the others
    in their next collective, i.e. only ``Timeouts.op``.
    """
    st, key = group.link.client.store, prefix + "healed"
    st.add(key, 1)
    deadline = time.monotonic() + group.link.timeouts.quorum
    while st.add(key, 0) < group.size:
        if group.error is not None:
            return
        if group.link.failures.aborted:
            group._record(PeerLostError("a member failed while the run's state was healed"))
            return
        if time.monotonic() > deadline:
            group._record(CommTimeoutError(f"healing did not finish within {group.link.timeouts.quorum} s "
                                           "(Timeouts.quorum)"))
            return
        time.sleep(0.002)


def load_blob(states: Mapping[str, StateEntry], blob: torch.Tensor, src: int, member: Any,
              leave: Callable[[], None], keys: set[str] | None = None) -> None:
    """Load the healing peer's state, all of it or (refused: leave the run and raise) none of it.

    ``member``: the source's member id (for the messages); ``leave``: called
    before raising, so that the others drop this worker at once. ``keys``:
    check and load only these states (default: all; the blob must hold every
    registered state either way).
    """
    want = set(states) if keys is None else set(keys)
    why: str | None = None
    try:
        got = from_bytes(blob)
    except Exception as e:  # noqa: BLE001 - whatever a malformed blob makes torch.load raise
        got, why = None, f"it is not a state blob ({type(e).__name__}: {e})"
    if why is None and (not isinstance(got, dict) or set(got) != set(states)):
        why = (f"it holds state {sorted(map(str, got)) if isinstance(got, dict) else '?'} but this "
               f"worker registered {sorted(states)}: every worker must run the same program")
    if why is None and isinstance(got, dict):
        why = check_received({k: got[k] for k in want}, {k: states[k].get() for k in want})
    if why is not None or not isinstance(got, dict):
        log.error("refusing the state healed from rank %d (member %s): %s; nothing of it was loaded, "
                  "this worker leaves the run", src, member, why)
        leave()   # the others drop it at once (the coordinator aborts their quorum)
        raise ShoalError(f"refused the run's state healed from rank {src} (member {member}): {why}; "
                         "nothing of it was loaded")
    for k in sorted(want):
        (states[k].heal_load or states[k].load)(got[k])
