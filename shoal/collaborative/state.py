"""A collaborative peer's state on the wire: sending it to peers that are behind, and averaging it.

Two exchanges move state rather than gradients:

- **loading** (:func:`exchange_state`): in a round where some members are
  behind or fresh, the round's source broadcasts one blob, written with
  ``torch.save`` and read with ``torch.load(weights_only=True)`` (never
  pickle), bounded by ``max_state_bytes`` and ``load_state_timeout``.
  :func:`encode_state` applies ``state_loading_codec`` (a ``Cast``: floating
  tensors travel in fp16/bf16, scalars such as Adam's ``step`` exactly), and
  :func:`decode_state` checks the blob against the local state (keys,
  shapes, dtypes, finite) before anything is used.
- **averaging** (:func:`average_tensors`): every ``average_state_every``
  epochs the members average parameters, the optimizer statistics named in
  ``average_opt_statistics`` and the extra tensors (:func:`stat_tensors`
  picks them), with equal weights, applied only if the vote commits.

Example::

    blob = encode_state(state, Cast(torch.bfloat16))
    same = decode_state(blob, local=state, source=3)    # None (and a warning) if unusable
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from shoal.codecs.base import Codec
from shoal.codecs.cast import Cast
from shoal.collaborative.rounds import RoundGroup, as_group
from shoal.comm.flat import flat_views
from shoal.comm.objects import broadcast_bytes, from_bytes, map_tensors, to_bytes
from shoal.collaborative.validate import Verdict, check_finite_tree, check_state
from shoal.errors import PeerLostError

log = logging.getLogger("shoal.collaborative")


def encode_state(state: dict[str, Any], codec: Codec | None) -> torch.Tensor:
    """``state`` as a byte tensor; with a ``Cast`` codec floating tensors (not scalars) travel in its dtype.

    Scalars stay exact: Adam's ``step`` is a float tensor, and fp16 holds integers only up to 2048.
    """
    if isinstance(codec, Cast):
        wire = codec.dtype
        state = map_tensors(state, lambda t: t.to(wire) if t.is_floating_point() and t.dim() > 0 else t)
    return to_bytes(state)


def decode_state(blob: torch.Tensor, local: dict[str, Any], source: int,
                 epochs: tuple[int, ...] | None = None) -> dict[str, Any] | None:
    """The state in ``blob`` if it can replace ``local`` (same keys, shapes, dtypes; finite), else None (logged).

    ``epochs``: the epochs the state may be of (the round's); a source claiming another is rejected.
    """
    try:
        state = from_bytes(blob)
    except Exception as e:  # noqa: BLE001 - anything a peer sends may be malformed
        log.warning("state from member %d is not a valid state blob (%s); not loaded", source, e)
        return None
    why = None if isinstance(state, dict) and set(state) == set(local) else "unexpected keys"
    why = why or check_state(state["params"], local["params"], "params") \
        or check_state(state["extra"], local["extra"], "extra") or check_finite_tree(state["optimizer"], "optimizer")
    epoch = state.get("local_epoch") if isinstance(state, dict) else None
    if why is None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        why = f"local_epoch {epoch!r} is not an epoch"
    if why is None and epochs is not None and epoch not in epochs:
        why = f"local_epoch {epoch} is not the round's epoch ({' or '.join(map(str, epochs))})"
    if why is not None:
        log.warning("state from member %d rejected: %s", source, why)
        return None
    return state  # type: ignore[no-any-return]


def exchange_state(g: RoundGroup, verdict: Verdict, make_blob: Callable[[], torch.Tensor], max_bytes: int,
                   timeout: float) -> torch.Tensor | None:
    """The source broadcasts ``make_blob()`` to the round; the blob if this member must load it, else None."""
    if not verdict.behind or verdict.source is None:
        return None
    blob = broadcast_bytes(g.group, make_blob() if g.rank == verdict.source else None, verdict.source, "collab/state",
                           max_bytes=max_bytes, timeout=timeout)
    if blob is None or g.rank not in verdict.behind:
        return None
    return blob


def stat_tensors(params: Sequence[torch.Tensor], names: Sequence[str], extra: Sequence[torch.Tensor],
                 optimizer: torch.optim.Optimizer, keys: Sequence[str]) -> tuple[list[torch.Tensor], list[str]]:
    """What state averaging averages: the parameters, the extra tensors, and the statistics named in ``keys``.

    A statistic is taken only if it is a floating tensor of its parameter's shape (``step`` counters are not).
    """
    tensors = list(params) + list(extra)
    out_names = list(names) + [f"extra{i}" for i in range(len(extra))]
    for p, n in zip(params, names):
        st = optimizer.state.get(p, {})
        for k in keys:
            t = st.get(k)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape:
                tensors.append(t)
                out_names.append(f"{n}:{k}")
    return tensors, out_names


def average_tensors(g: RoundGroup, tensors: list[torch.Tensor], names: list[str], codec: Codec,
                    skip: Sequence[int] = ()) -> bool:
    """Replace ``tensors`` by their mean over the round's members (equal weights) if the vote commits.

    Skipped (False, the same on every member) when the members hold different amounts of
    state (a peer whose optimizer has not created its statistics yet) or the mean is not finite.
    ``skip``: ranks whose tensors must not enter the mean (caught sending bad data earlier in this
    round, or loading state in it: behind or fresh). A sum cannot be cleaned of what they add, so the
    members all-gather their tensors and average the other members' rows (``size`` times the bytes,
    held on the group's device, only in such a round); every member, a skipped one too, takes the mean.
    """
    numel, dev = sum(t.numel() for t in tensors), g.device
    sizes = torch.empty(g.size, dtype=torch.int64, device=dev)
    g.group.all_gather_into(sizes, torch.tensor([numel], dtype=torch.int64, device=dev), tag="collab/state-avg").wait()
    keep = [r for r in range(g.size) if r not in skip]
    if g.error is not None or not keep or len({int(sizes[r]) for r in keep}) != 1:
        log.warning("state averaging skipped: the members' optimizer statistics differ in size")
        g.vote(keep=False)
        return False
    # Staged on the group's device: the tensors (parameters, optimizer statistics) may live elsewhere.
    work = torch.empty(numel, dtype=torch.float32, device=dev)
    with torch.no_grad():
        torch._foreach_copy_(flat_views(work, tensors), [t.detach() for t in tensors])
    if skip:
        if len(set(sizes.tolist())) != 1:   # an all-gather needs equal sizes: the others average next time
            log.warning("state averaging skipped: a member excluded from this round holds state of another size")
            g.vote(keep=False)
            return False
        rows = torch.empty(g.size * numel, dtype=torch.float32, device=dev)
        g.group.all_gather_into(rows, work, tag="collab/state-avg/check").wait()
        work = rows.view(g.size, numel)[keep].mean(dim=0)
    else:
        with torch.no_grad():
            codec.mean(flat_views(work, tensors), names, as_group(g.group), "collab/state-avg")
    finite = bool(torch.isfinite(work).all())
    if not finite:
        g.group.report_error(PeerLostError("state averaging produced NaN/Inf"))
    if not (g.vote() and finite):
        return False
    with torch.no_grad():
        for t, v in zip(tensors, flat_views(work, tensors)):
            t.copy_(v)
    return True


