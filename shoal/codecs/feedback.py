"""Error feedback around any lossy codec."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from shoal.codecs.base import (BufferPool, Codec, LossyCodec, NonfiniteCounter, check_inputs, finite_flags,
                               flatten_into, keep_where, unflatten_from)
from shoal.comm.flat import flat_views
from shoal.comm.group import Group
from shoal.errors import ConfigError


class ErrorFeedback(Codec):
    """Carry what compression lost into the next step, per tensor name.

    Each step rank r sends ``x + e`` through the inner codec and keeps
    ``e <- (x + e) - C_r(x + e)``, where ``C_r`` is what its contribution
    decodes to. Over steps nothing is lost: ``sum of decoded means + mean of
    the ranks' residuals = sum of mean inputs`` (except an error the inner
    codec makes on the mean itself, which no rank's residual holds: Int8's
    requantization at 3+ ranks). Residuals are fp32 and keyed
    by name, so they survive re-bucketing and are saved by :meth:`state_dict`.

    Non-finite values: if the mean of a tensor comes out NaN/Inf (some rank
    sent NaN/Inf), every rank keeps that tensor's residual as it was before the
    call and passes the non-finite mean through, so a finiteness check (shoal
    skips such steps on every rank) sees it. The decision depends only on the
    mean, identical on every rank, so ranks agree without extra messages and
    one bad gradient never poisons the residual for the rest of training.
    This rank's own residual is also kept where its new value is non-finite.
    All of it is decided on the device (``torch.where`` on per-tensor flags):
    no host sync inside the collectives, so it is safe on a communication
    thread; ``stats()["nonfinite_steps"]`` reads the device counter.

    ``decay`` (default 1) scales the residual before it is added:
    ``e <- (x + decay * e) - C_r(x + decay * e)``; below 1 the sum above is
    no longer conserved (old errors fade), as in SparseLoCo.

    Example::

        codec = ErrorFeedback(TopK(ratio=0.01))
        codec.mean(grads, names, group, tag="ddp/grad")
    """

    lossy = True

    def __init__(self, codec: Codec, decay: float = 1.0) -> None:
        super().__init__()
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < float(decay) <= 1.0:
            raise ConfigError(f"decay must be in (0, 1] (the weight of the carried residual), got {decay!r}")
        self.decay = float(decay)
        if not isinstance(codec, LossyCodec):
            raise ConfigError(
                f"ErrorFeedback wraps a lossy codec (Cast, Int8Blockwise, TopK, PowerSGD), got {type(codec).__name__}: "
                "an exact codec leaves no error to feed back"
            )
        if getattr(codec, "error_feedback", False):
            raise ConfigError(
                "the inner codec already does its own error feedback (error_feedback=True); "
                "wrapping it would feed the error back twice"
            )
        self.codec: LossyCodec = codec
        self.residuals: dict[str, torch.Tensor] = {}
        self._nonfinite = NonfiniteCounter()
        self._pool = BufferPool()

    @torch.no_grad()
    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], group: Group, tag: str) -> None:
        check_inputs(tensors, names, "ErrorFeedback")
        if not tensors:
            return
        device = tensors[0].device
        numel = sum(t.numel() for t in tensors)
        comp_flat = self._pool.get("comp", numel, torch.float32, device)
        res_flat = self._pool.get("res", numel, torch.float32, device)
        comp = flat_views(comp_flat, tensors)
        new_res = flat_views(res_flat, tensors)
        old_res = [self._residual(n, t) for n, t in zip(names, tensors)]
        flatten_into(tensors, comp_flat)
        torch._foreach_add_(comp, old_res, alpha=self.decay)
        self.codec.mean_with_residual(comp, names, group, tag, new_res)
        # Per tensor: the new residual where the mean and the residual are finite, else the old one.
        mean_ok = finite_flags(comp)
        ok = mean_ok & finite_flags(new_res)
        torch._foreach_copy_(old_res, keep_where(ok, new_res, old_res))
        self._nonfinite.add(mean_ok)
        unflatten_from(comp_flat, tensors)
        self._count(tensors, 0)

    @property
    def nonfinite_steps(self) -> int:
        """Calls in which some tensor's mean was NaN/Inf (a host sync: not for the step's path)."""
        return self._nonfinite.value()

    def _residual(self, name: str, t: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(name)
        if r is None:
            r = self.residuals[name] = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        elif r.shape != t.shape:
            raise ConfigError(f"tensor {name!r} changed shape from {tuple(r.shape)} to {tuple(t.shape)}")
        elif r.device != t.device:
            r = self.residuals[name] = r.to(t.device)  # e.g. loaded from a CPU checkpoint
        return r

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "residuals": {n: r.detach().clone() for n, r in self.residuals.items()},
            "nonfinite_steps": self._nonfinite.value(),
            "inner": self.codec.state_dict(),
        }

    def rollback_state(self) -> dict[str, Any]:
        """A copy of the residuals, the inner codec's rollback state, the counter as a device
        tensor: no host sync at a step's start."""
        return {**super().state_dict(), "residuals": {n: r.detach().clone() for n, r in self.residuals.items()},
                "nonfinite_steps": self._nonfinite.snapshot(), "inner": self.codec.rollback_state()}

    def newcomer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The inner codec's newcomer state, with this worker's residuals at zero."""
        return {**state, "residuals": {n: torch.zeros_like(r) for n, r in state["residuals"].items()},
                "inner": self.codec.newcomer_state(state["inner"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.codec.load_state_dict(state["inner"])
        self.residuals = {n: r.detach().clone().to(torch.float32) for n, r in state["residuals"].items()}
        self._nonfinite.load(state["nonfinite_steps"])

    def stats(self) -> dict[str, float]:
        out = dict(self.codec.stats())
        out["nonfinite_steps"] = self.nonfinite_steps
        # Not a hot path: one sync per name is fine here.
        out["residual_norm"] = sum(float(r.pow(2).sum()) for r in self.residuals.values()) ** 0.5
        return out


