"""Streaming DiLoCo (C5): fragments synchronised at staggered steps, overlapped with compute."""

from __future__ import annotations

from shoal.codecs.base import Codec
from shoal.strategies.diloco import DiLoCo, DiLoCoConfig, OuterOptimizerFactory, default_outer_optimizer


class StreamingDiLoCo(DiLoCo):
    """DiLoCo with the model split into ``fragments`` whose rounds are staggered and overlapped.

    Each fragment runs DiLoCo's round every ``inner_steps`` steps, fragment
    ``p`` after steps ``s`` with ``s % inner_steps == (p + 1) * inner_steps //
    fragments % inner_steps``, so a sync sends ``1/fragments`` of the model
    and the peak bandwidth drops by that factor. A fragment's pseudo-gradient
    is reduced on a communication thread while ``overlap_steps`` more inner
    steps run (the paper's tau); then the outer optimizer steps and the local
    fragment is merged with the result using the paper's mixing factor:
    ``local <- mixing * local + (1 - mixing) * global`` (alpha; 0 discards the
    local progress made during the overlap, 0.5 is the paper's choice).
    ``merge="carry"`` keeps that progress whole instead: ``local <- global +
    (local - local at launch)``, so each inner step enters exactly one
    pseudo-gradient, as without overlap (one fragment, ``overlap_steps=1``:
    DiLoCo with its exchange behind an inner step, whose gradient is taken
    before the merge; on the bench's ``lm`` at H 5 it measured worse than
    plain DiLoCo: docs/averaging.md).

    Args:
        inner_steps: H, steps between two syncs of the same fragment.
        fragments: P, number of fragments (``1 <= P <= H``).
        overlap_steps: tau, inner steps a reduction overlaps (``0 <= tau < H``).
        mixing: alpha in ``[0, 1)`` (default 0.5; with ``merge="carry"``: 0, the only value allowed).
        merge: ``"mix"`` (default, the paper's rule with ``mixing``) or ``"carry"``.
        outer_optimizer, codec, offload: as :class:`shoal.DiLoCo`.
        layout: ``"strided"`` (parameter ``i`` in fragment ``i % P``, the
            paper's choice; layers of each fragment spread over the depth) or
            ``"sequential"`` (contiguous, about equal sizes).

    Meter tag ``streaming-diloco/pseudograd``. :meth:`close` merges what is
    still in flight at the end of training; ``state_dict()`` waits for it.

    Example::

        strategy = shoal.StreamingDiLoCo(inner_steps=100, fragments=4, overlap_steps=5,
                                         codec=shoal.codecs.Cast())
        # DiLoCo whose outer exchange runs behind the next inner step:
        hidden = shoal.StreamingDiLoCo(inner_steps=5, fragments=1, overlap_steps=1, merge="carry",
                                       codec=shoal.codecs.SparseLoCo(0.01, 2))
        model, opt = shoal.wrap(model, torch.optim.AdamW(model.parameters()), strategy)
        ...                                     # train as usual
        strategy.close()
    """

    name = "streaming-diloco"

    def __init__(self, inner_steps: int, fragments: int, overlap_steps: int = 1, mixing: float | None = None,
                 outer_optimizer: OuterOptimizerFactory = default_outer_optimizer, codec: Codec | None = None,
                 layout: str = "strided", offload: bool | None = None, merge: str = "mix") -> None:
        if mixing is None:
            mixing = 0.0 if merge == "carry" else 0.5
        self._init(DiLoCoConfig(inner_steps, outer_optimizer, fragments, overlap_steps, mixing, layout, offload,
                                merge), codec)
