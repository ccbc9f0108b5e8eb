"""DiLoCo's state, in the parts that travel apart: outer state, schedule, pending means, and the checkpoint of all.

On an elastic group each part is its own registered state, because a joiner
healed in the background needs each at another moment
(:mod:`shoal.strategies.diloco_heal`):

- ``<key>/strategy`` (:func:`outer_state`): the global copies and the outer
  optimizers' state, the same on every member: downloaded, then kept current
  by replaying the outer steps.
- ``<key>/schedule`` (:func:`schedule_state`): the inner-step counter and
  which fragment merges at which step (and whether its next attempt reduces in
  the foreground): a few bytes, needed at the admission.
- ``<key>/pending`` (:func:`pending_state`): the landed means not yet merged;
  a joiner takes part in every reduction from its admission on, so it holds
  its own.

A blocking heal sends all three; :func:`checkpoint` and :func:`load_checkpoint`
are ``DiLoCo.state_dict()`` and ``load_state_dict()``.

Example::

    state = checkpoint(strategy)          # what strategy.state_dict() returns
    load_checkpoint(other, state)
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

from shoal.errors import ConfigError


def outer_state(strategy: Any) -> dict[str, Any]:
    """Every fragment's global copy and outer optimizer state (copies)."""
    return {"fragments": [{"global": f.snapshot.detach().cpu().clone(), "outer": copy.deepcopy(f.outer.state_dict())}
                          for f in strategy.fragments]}


@torch.no_grad()
def load_outer(strategy: Any, state: Mapping[str, Any]) -> None:
    frags = state["fragments"]
    if len(frags) != len(strategy.fragments):
        raise ConfigError(f"state has {len(frags)} fragments but this {type(strategy).__name__} has "
                          f"{len(strategy.fragments)}")
    for f, s in zip(strategy.fragments, frags):
        if s["global"].numel() != f.snapshot.numel():
            raise ConfigError(f"fragment {f.index} holds {f.snapshot.numel()} values but the state has "
                              f"{s['global'].numel()}")
        f.snapshot.copy_(s["global"])
        f.outer.load_state_dict(s["outer"])


def schedule_state(strategy: Any) -> dict[str, Any]:
    """The inner-step counter and, per fragment, ``(merge_at, redo)`` of a pending reduction or None."""
    return {"step": strategy.step,
            "merges": [None if f.merge_at is None else [f.merge_at, f.redo] for f in strategy.fragments]}


def load_schedule(strategy: Any, state: Mapping[str, Any]) -> None:
    strategy.step = int(state["step"])
    merges = state["merges"]
    if len(merges) != len(strategy.fragments):
        raise ConfigError(f"schedule has {len(merges)} fragments but this strategy has {len(strategy.fragments)}")
    for f, m in zip(strategy.fragments, merges):
        f.future = None
        f.merge_at, f.redo = (None, False) if m is None else (int(m[0]), bool(m[1]))


def pending_state(strategy: Any) -> list[torch.Tensor | None]:
    """Per fragment, the landed mean not merged yet (a reduction in flight is waited for), or None."""
    out: list[torch.Tensor | None] = []
    for f in strategy.fragments:
        if f.merge_at is not None:
            strategy._land(f)   # CUDA: joins the side stream before the mean is read
        out.append(None if f.merge_at is None else f.delta.detach().cpu().clone())
    return out


@torch.no_grad()
def load_pending(strategy: Any, state: list[torch.Tensor | None]) -> None:
    if len(state) != len(strategy.fragments):
        raise ConfigError(f"pending means for {len(state)} fragments but this strategy has {len(strategy.fragments)}")
    for f, d in zip(strategy.fragments, state):
        if d is not None:
            f.delta.copy_(d)


def checkpoint(strategy: Any) -> dict[str, Any]:
    """``state_dict()``: step, global copies, outer optimizers, codec, finished-but-unmerged reductions (with
    merge="carry", also the parameters at their launch)."""
    sched, pending = schedule_state(strategy), pending_state(strategy)
    frags = outer_state(strategy)["fragments"]
    for fr, m, d, f in zip(frags, sched["merges"], pending, strategy.fragments):
        fr["pending"] = None if m is None else {"merge_at": m[0], "delta": d, "redo": m[1]}
        if m is not None and f.launched is not None:   # merge="carry": the merge carries the progress since then
            fr["pending"]["launched"] = f.launched.detach().cpu().clone()
    return {"step": strategy.step, "fragments": frags, "codec": strategy.codec.state_dict(),
            "merged_rounds": strategy.merged_rounds}


def load_checkpoint(strategy: Any, state: Mapping[str, Any]) -> None:
    """``load_state_dict()``: what :func:`checkpoint` returned.

    A pending merge saved without merge="carry" cannot be carried (the parameters at its launch were not
    kept): refused before anything is loaded, unless its next attempt reduces in the foreground anyway. A
    carry checkpoint loads into another merge rule, which does not need those parameters.
    """
    frags = state["fragments"]
    for f, s in zip(strategy.fragments, frags):
        p = s.get("pending")
        if f.launched is not None and p is not None and not p.get("redo", False) and "launched" not in p:
            raise ConfigError(f"fragment {f.index}'s pending merge was saved without merge='carry' (no parameters "
                              "at its launch): load it into a strategy with the same merge rule")
    load_outer(strategy, state)
    strategy.merged_rounds = int(state.get("merged_rounds", 0))   # absent from checkpoints before it existed
    load_schedule(strategy, {"step": state["step"], "merges": [
        None if s["pending"] is None else [s["pending"]["merge_at"], s["pending"].get("redo", False)] for s in frags]})
    load_pending(strategy, [None if s["pending"] is None else s["pending"]["delta"] for s in frags])
    for f, s in zip(strategy.fragments, frags):
        if s["pending"] is not None and f.launched is not None and "launched" in s["pending"]:
            with torch.no_grad():
                f.launched.copy_(s["pending"]["launched"])
    strategy.codec.load_state_dict(state["codec"])
