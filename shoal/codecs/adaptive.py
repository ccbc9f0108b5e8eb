"""Size-adaptive composition: small tensors by one codec, large by another."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from shoal.codecs.base import Codec, LossyCodec, check_inputs
from shoal.comm.group import Group
from shoal.errors import ConfigError


class SizeAdaptive(LossyCodec):
    """Send tensors with fewer than ``threshold`` elements by ``small``, the rest by ``large``.

    Small tensors (biases, norms) gain little from compression and often
    suffer most from it; large ones carry the bytes. The small group is sent
    first, then the large one, each as one call of its codec, so collectives
    stay in the same order on every rank. Tags are the inner codecs' own.

    Example::

        codec = SizeAdaptive(Identity(), Int8Blockwise(256), threshold=2**16)
        codec.mean(grads, names, group, tag="ddp/grad")
    """

    def __init__(self, small: Codec, large: Codec, threshold: int = 2**16) -> None:
        super().__init__()
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ConfigError(f"threshold must be a positive integer number of elements, got {threshold!r}")
        self.small, self.large, self.threshold = small, large, threshold
        self.lossy = small.lossy or large.lossy
        self.error_feedback = bool(getattr(small, "error_feedback", False) or getattr(large, "error_feedback", False))

    @torch.no_grad()
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        check_inputs(tensors, names, "SizeAdaptive")
        small = [i for i, t in enumerate(tensors) if t.numel() < self.threshold]
        large = [i for i, t in enumerate(tensors) if t.numel() >= self.threshold]
        for codec, idx in ((self.small, small), (self.large, large)):
            if not idx:
                continue
            ts, ns = [tensors[i] for i in idx], [names[i] for i in idx]
            if isinstance(codec, LossyCodec):
                res = None if residuals is None else [residuals[i] for i in idx]
                codec.mean_with_residual(ts, ns, group, tag, res)
            else:
                codec.mean(ts, ns, group, tag)
                if residuals is not None:
                    for i in idx:
                        residuals[i].zero_()  # an exact codec loses nothing
        self._count(tensors, 0)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "small": self.small.state_dict(), "large": self.large.state_dict()}

    def newcomer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "small": self.small.newcomer_state(state["small"]),
                "large": self.large.newcomer_state(state["large"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.small.load_state_dict(state["small"])
        self.large.load_state_dict(state["large"])

    def stats(self) -> dict[str, Any]:  # type: ignore[override]
        return {"small": self.small.stats(), "large": self.large.stats()}
