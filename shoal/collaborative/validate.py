"""Checking what peers send before it is used.

Why two stages: an all-reduce hands each peer only the *sum* of everyone's
contributions, so a bad peer cannot be singled out from it. shoal therefore

1. exchanges a fixed-size integer header per peer first (all-gather of
   ``HEADER_LEN`` int64: member id, epoch, weight, a local finiteness flag, a
   digest of the tensor names/shapes/dtypes, the element count, role flags).
   Every member judges the same gathered headers with the same rules, so they
   all reach the same verdict without another round trip; a peer whose layout
   differs from the majority's (shape or dtype), whose weight is out of bounds,
   whose claims contradict each other, or that declares an epoch ahead of the
   round's is excluded and the round re-forms without it. (Every member
   matched for the round of epoch ``e`` under the same store key, and an honest
   peer never declares more than the epoch it matched for: a peer that is
   behind declares its own lower epoch. A higher claim can only be a lie meant
   to make the others load its state.) Headers are plain integers: nothing received is unpickled.
2. runs the fast all-reduce through the codec, then checks that the result is
   finite. Only if it is not (a peer sent NaN/Inf despite its header) does the
   round fall back to an all-gather of the raw contributions, where each
   peer's tensor can be checked; the offenders are dropped and the mean is
   taken over the rest. That costs ``size`` times the bytes, but only in a
   round that is under attack, never in a healthy one.

State received for loading (a ``torch.load(weights_only=True)`` blob, never
pickle) is checked against the local model: same keys, shapes, dtypes, finite.

Example:
    >>> import torch
    >>> d = layout_digest(["w"], [torch.zeros(2, 3)])
    >>> h = encode_header(7, epoch=3, weight=64, finite=True, digest=d, numel=6, flags=0)
    >>> judge_headers([h, h.clone()], [7, 7], max_weight=1024, round_epoch=3).violators
    []
    >>> judge_headers([h, encode_header(7, 10**6, 64, True, d, 6, 0)], [7, 7], 1024, round_epoch=3).violators
    [1]
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

HEADER_LEN = 8
FLAG_AUX, FLAG_CLIENT, FLAG_FRESH = 1, 2, 4


def layout_digest(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
    """A signed 63-bit digest of names, shapes and dtypes (equal on peers running the same model)."""
    h = hashlib.sha256()
    for n, t in zip(names, tensors):
        h.update(f"{n}:{tuple(t.shape)}:{t.dtype};".encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True) >> 1


def encode_header(member: int, epoch: int, weight: int, finite: bool, digest: int, numel: int,
                  flags: int, device: torch.device | str | None = None) -> torch.Tensor:
    """This peer's header for a round, on ``device`` (the round group's; shoal passes it)."""
    return torch.tensor([member, epoch, weight, int(finite), digest, numel, flags, 0], dtype=torch.int64,
                        device=device)


@dataclass
class Verdict:
    """The outcome of judging a round's headers (the same on every member)."""

    violators: list[int] = field(default_factory=list)          # ranks excluded, with reasons below
    reasons: dict[int, str] = field(default_factory=dict)
    weights: list[int] = field(default_factory=list)            # per rank, 0 for violators/behind/aux
    epoch: int = 0                                              # the round's epoch (max among valid)
    behind: list[int] = field(default_factory=list)             # ranks that must load state
    source: int | None = None                                   # rank that sends state, if anyone needs it
    candidates: list[int] = field(default_factory=list)         # ranks able to send state, best first
    fresh: list[int] = field(default_factory=list)              # valid ranks that declared FLAG_FRESH

    def without(self, bad: Sequence[int]) -> "Verdict":
        """This verdict with ``bad`` ranks (caught sending bad data) no longer trusted to send state."""
        if not bad or self.source is None or self.source not in bad:
            return self
        ok = [r for r in self.candidates if r not in bad]
        source = ok[0] if ok else None
        behind = sorted((set(self.behind) | set(self.fresh)) - {source}) if source is not None else []
        return Verdict(self.violators, self.reasons, self.weights, self.epoch, behind, source, ok, self.fresh)


def judge_headers(headers: Sequence[torch.Tensor], members: Sequence[int], max_weight: int,
                  round_epoch: int) -> Verdict:
    """Apply the header rules; every member gets the same verdict from the same headers.

    ``round_epoch`` is the epoch the round was matched for (the same on every member).

    The accepted layout is the one most members declare (ties: the lowest
    rank's), so a single peer with a wrong shape cannot make the others look wrong.
    """
    rows = [[int(v) for v in h.tolist()] for h in headers]
    votes: dict[tuple[int, int], list[int]] = {}
    for r, row in enumerate(rows):
        votes.setdefault((row[4], row[5]), []).append(r)
    layout = max(votes, key=lambda k: (len(votes[k]), -min(votes[k])))
    v = Verdict()
    for r, (mid, epoch, weight, finite, digest, numel, flags, _) in enumerate(rows):
        why = None
        if mid != members[r]:
            why = f"claims member id {mid} but holds the slot of member {members[r]}"
        elif (digest, numel) != layout:
            why = "sent tensors whose names/shapes/dtypes differ from the swarm's (layout digest mismatch)"
        elif not 0 <= weight <= max_weight:
            why = f"declared weight {weight} outside [0, {max_weight}]"
        elif finite not in (0, 1) or (finite == 0 and weight > 0):
            why = "declared non-finite gradients with a non-zero weight"
        elif flags & FLAG_AUX and weight > 0:
            why = "is auxiliary but declared a non-zero weight"
        elif not 0 <= epoch < 1 << 40:
            why = f"declared an impossible epoch {epoch}"
        elif epoch > round_epoch:
            why = f"declared epoch {epoch}, ahead of the round's epoch {round_epoch} (no peer of this round can be there)"
        if why is not None:
            v.violators.append(r)
            v.reasons[r] = why
    valid = [r for r in range(len(rows)) if r not in v.violators]
    v.epoch = max((rows[r][1] for r in valid), default=0)
    v.behind = [r for r in valid if rows[r][1] < v.epoch]
    v.weights = [rows[r][2] if r in valid and r not in v.behind else 0 for r in range(len(rows))]
    up = [r for r in valid if rows[r][1] == v.epoch and not rows[r][6] & FLAG_CLIENT]
    settled = [r for r in up if not rows[r][6] & FLAG_FRESH]
    v.fresh = [r for r in valid if rows[r][6] & FLAG_FRESH]
    if up:
        # Prefer a peer that already holds the swarm's state over one that only holds its own init.
        v.candidates = sorted(settled) + sorted(set(up) - set(settled))
        v.source = v.candidates[0]
        v.behind = sorted((set(v.behind) | set(v.fresh)) - {v.source})
    else:
        v.behind = []           # only client-mode peers are up to date: they never serve, nothing is loaded
    return v


def check_state(received: dict[str, Any], local: dict[str, Any], path: str = "state") -> str | None:
    """Why ``received`` cannot replace ``local`` (keys, shapes, dtypes, finiteness), or None if it can."""
    if isinstance(local, torch.Tensor):
        if not isinstance(received, torch.Tensor):
            return f"{path}: expected a tensor, got {type(received).__name__}"
        if received.shape != local.shape:
            return f"{path}: shape {tuple(received.shape)} differs from the local {tuple(local.shape)}"
        if received.is_floating_point() != local.is_floating_point():
            return f"{path}: dtype {received.dtype} is not compatible with the local {local.dtype}"
        if received.is_floating_point() and not bool(torch.isfinite(received).all()):
            return f"{path}: contains NaN or Inf"
        return None
    if isinstance(local, dict):
        if not isinstance(received, dict) or set(received) != set(local):
            return f"{path}: keys {sorted(map(str, received)) if isinstance(received, dict) else '?'} " \
                   f"differ from the local {sorted(map(str, local))}"
        for k in local:
            why = check_state(received[k], local[k], f"{path}.{k}")
            if why:
                return why
        return None
    if isinstance(local, (list, tuple)):
        if not isinstance(received, (list, tuple)) or len(received) != len(local):
            return f"{path}: expected a sequence of {len(local)} items"
        for i, (a, b) in enumerate(zip(received, local)):
            why = check_state(a, b, f"{path}[{i}]")
            if why:
                return why
        return None
    return None if isinstance(received, type(local)) or local is None else \
        f"{path}: expected {type(local).__name__}, got {type(received).__name__}"


def check_finite_tree(received: Any, path: str = "state", max_depth: int = 8) -> str | None:
    """Why a nested structure of tensors cannot be used (a non-finite tensor, too deep), or None."""
    if max_depth < 0:
        return f"{path}: nested too deeply"
    if isinstance(received, torch.Tensor):
        if received.is_floating_point() and not bool(torch.isfinite(received).all()):
            return f"{path}: contains NaN or Inf"
        return None
    items = received.items() if isinstance(received, dict) else \
        enumerate(received) if isinstance(received, (list, tuple)) else ()
    for k, x in items:
        why = check_finite_tree(x, f"{path}.{k}", max_depth - 1)
        if why:
            return why
    return None
