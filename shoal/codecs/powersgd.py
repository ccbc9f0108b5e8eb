"""PowerSGD: a rank-r approximation of each matrix's mean, in two batched rounds.

For a gradient reshaped to an ``n x m`` matrix ``M`` (``n = shape[0]``) and a
random ``m x r`` matrix ``Q`` drawn identically on every rank::

    P = mean(M Q)            all Ps of the call in one all-reduce
    P = orthonormalize(P)    Gram-Schmidt, same bits on every rank
    Q = mean(M^T P)          all Qs in one all-reduce
    mean(M) ~= P Q^T

By linearity this is exact when ``r = min(n, m)``. State (warm-start Q, error
feedback residual, call count) is keyed by tensor name, so unlike torch's hook
(keyed by bucket index) nothing forces the first steps to be uncompressed;
``start_iter`` is an optional warm-up, counted per name.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shoal.codecs.base import (BufferPool, LossyCodec, NonfiniteCounter, RollbackSlots, check_inputs, common_dtype,
                               finite_flags, flatten_into, sub_tag, unflatten_from)
from shoal.comm.group import Group
from shoal.errors import ConfigError


@dataclass(frozen=True)
class _Mat:
    """One tensor of a call that goes through the low-rank path."""

    index: int  # position in the call
    name: str
    n: int
    m: int
    r: int


def orthonormalize_(p: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of a batch of matrices ``(b, n, r)``, in place.

    ``epsilon`` is added to each column norm, so an all-zero column (a layer
    whose gradient is zero) stays zero instead of becoming NaN.

    >>> p = torch.tensor([[[3.0, 1.0], [4.0, 1.0]]]); orthonormalize_(p, 0.0)
    >>> torch.allclose(p[0].T @ p[0], torch.eye(2), atol=1e-6)
    True
    """
    r = p.shape[2]
    for i in range(r):
        col = p[:, :, i : i + 1]
        col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True).add_(epsilon))
        if i + 1 < r:
            rest = p[:, :, i + 1 :]
            rest.sub_(col * torch.sum(col * rest, dim=1, keepdim=True))


class PowerSGD(LossyCodec):
    """Low-rank compression of matrices (Vogels et al., 2019), state keyed by name.

    Args:
        rank: rank ``r`` of the approximation (>= 1). Raise it if the loss lags
            plain DDP; 1-4 usually suffices for convolutional and linear layers.
        start_iter: calls per tensor name sent uncompressed before compression
            starts (>= 0). 0 is safe here because state is per name.
        min_compression_rate: compress an ``n x m`` tensor only when
            ``n*m > min_compression_rate * r*(n+m)``; others (vectors, small
            matrices) go uncompressed, batched in one all-reduce.
        warm_start: reuse last step's Q (one power iteration per step, which
            tracks the top singular vectors over time); else draw Q anew.
        error_feedback: add last step's residual ``M - P Q^T`` to the gradient.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt; the
            default keeps zero gradients from turning into NaN.
        seed: Q is drawn from a private generator seeded by ``(seed, name,
            draw count)``: identical on every rank, the user's RNG untouched.

    Bytes handed to collectives per call: ``4 * (sum r(n+m)`` over compressed
    tensors ``)`` in two all-reduces (tags ``<tag>/powersgd/p`` and
    ``<tag>/powersgd/q``) plus ``itemsize * numel`` of the uncompressed ones
    (tag ``<tag>/powersgd/uncompressed``). Compute and wire are fp32.

    Example::

        codec = PowerSGD(rank=4)
        codec.mean(grads, names, group, tag="ddp/grad")
        codec.stats()["compression_rate"]
    """

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 0,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        error_feedback: bool = True,
        orthogonalization_epsilon: float = 1e-8,
        seed: int = 0,
    ) -> None:
        super().__init__()
        _check_int("rank", rank, 1)
        _check_int("start_iter", start_iter, 0)
        _check_int("seed", seed, 0)
        if not isinstance(min_compression_rate, (int, float)) or not min_compression_rate > 0:
            raise ConfigError(f"min_compression_rate must be > 0, got {min_compression_rate!r}")
        if not isinstance(orthogonalization_epsilon, (int, float)) or not orthogonalization_epsilon >= 0:
            raise ConfigError(f"orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        self.rank, self.start_iter, self.seed = rank, start_iter, seed
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start, self.error_feedback = bool(warm_start), bool(error_feedback)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.calls: dict[str, int] = {}
        # Warm-start Qs and error-feedback residuals; RollbackSlots make an elastic group's
        # per-step rollback snapshot free (references, not a copy of the gradient-sized residuals).
        self.q = RollbackSlots()
        self.errors = RollbackSlots()
        self.draws: dict[str, int] = {}
        self.numel_before = 0
        self.numel_after = 0
        self._nonfinite = NonfiniteCounter()
        self._pool = BufferPool()

    def config(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_iter": self.start_iter,
            "min_compression_rate": self.min_compression_rate,
            "warm_start": self.warm_start,
            "error_feedback": self.error_feedback,
            "orthogonalization_epsilon": self.orthogonalization_epsilon,
            "seed": self.seed,
        }

    # --- the step ------------------------------------------------------------
    @torch.no_grad()
    def mean_with_residual(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> None:
        check_inputs(tensors, names, "PowerSGD")
        if not tensors:
            return
        mats, plain = self._partition(tensors, names)
        payload = self._reduce_plain([tensors[i] for i in plain], group, tag)
        if residuals is not None:
            for i in plain:
                residuals[i].zero_()  # sent exactly
        if mats:
            payload += self._low_rank(tensors, mats, group, tag, residuals)
        self._count(tensors, payload)
        self.numel_before += sum(t.numel() for t in tensors)
        self.numel_after += sum(tensors[i].numel() for i in plain) + sum(x.r * (x.n + x.m) for x in mats)

    def _partition(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> tuple[list[_Mat], list[int]]:
        """Split the call into low-rank matrices and tensors sent as they are."""
        mats: list[_Mat] = []
        plain: list[int] = []
        for i, (t, name) in enumerate(zip(tensors, names)):
            calls = self.calls.get(name, 0)
            self.calls[name] = calls + 1
            if calls < self.start_iter or t.dim() < 2 or t.numel() == 0:
                plain.append(i)
                continue
            n = t.shape[0]
            m = t.numel() // n
            r = min(self.rank, n, m)
            if n * m > self.min_compression_rate * r * (n + m):
                mats.append(_Mat(i, name, n, m, r))
            else:
                plain.append(i)
        # Group same (n, r) together so Gram-Schmidt runs once per group; the
        # order depends only on names and shapes, hence is the same on every rank.
        mats.sort(key=lambda x: (x.n, x.r, x.index))
        return mats, plain

    def _reduce_plain(self, tensors: list[torch.Tensor], group: Group, tag: str) -> int:
        if not tensors:
            return 0
        flat = self._pool.get("plain", sum(t.numel() for t in tensors), common_dtype(tensors), tensors[0].device)
        flatten_into(tensors, flat)
        group.all_reduce(flat, op="avg", tag=sub_tag(tag, "powersgd/uncompressed")).wait()
        unflatten_from(flat, tensors)
        return flat.numel() * flat.element_size()

    def _low_rank(
        self,
        tensors: Sequence[torch.Tensor],
        mats: list[_Mat],
        group: Group,
        tag: str,
        residuals: Sequence[torch.Tensor] | None,
    ) -> int:
        device = tensors[0].device
        m_flat, ms = self._buffer("m", [(x.n, x.m) for x in mats], device)
        p_flat, ps = self._buffer("p", [(x.n, x.r) for x in mats], device)
        q_flat, qs = self._buffer("q", [(x.m, x.r) for x in mats], device)
        flatten_into([tensors[x.index] for x in mats], m_flat)
        old_errors = [self._error(x, device) for x in mats] if self.error_feedback else []
        if old_errors:
            torch._foreach_add_(ms, old_errors)
        old_qs = [self._initial_q(x, device) for x in mats]
        for mat, p, q, q0 in zip(ms, ps, qs, old_qs):
            q.copy_(q0)
            torch.matmul(mat, q, out=p)
        group.all_reduce(p_flat, op="avg", tag=sub_tag(tag, "powersgd/p")).wait()
        self._orthonormalize(mats, p_flat)
        for mat, p, q in zip(ms, ps, qs):
            torch.matmul(mat.t(), p, out=q)
        group.all_reduce(q_flat, op="avg", tag=sub_tag(tag, "powersgd/q")).wait()
        approx_flat, approx = self._buffer("approx", [(x.n, x.m) for x in mats], device)
        for a, p, q in zip(approx, ps, qs):
            torch.matmul(p, q.t(), out=a)
        m_flat.sub_(approx_flat)  # now the residual M - P Q^T
        self._commit(mats, ms, approx, qs, old_qs, old_errors)
        for x, a, res in zip(mats, approx, ms):
            tensors[x.index].copy_(a.view(tensors[x.index].shape))
            if residuals is not None:
                residuals[x.index].copy_(res.view(residuals[x.index].shape))
        return (p_flat.numel() + q_flat.numel()) * p_flat.element_size()

    def _commit(self, mats: list[_Mat], res: list[torch.Tensor], approx: list[torch.Tensor], qs: list[torch.Tensor],
                old_qs: list[torch.Tensor], old_errors: list[torch.Tensor]) -> None:
        """Keep warm-start Qs and residuals, except where this step went non-finite.

        A non-finite mean is identical on every rank (it came out of the same
        all-reduces), so every rank keeps the same names' old state: the Q this
        step started from and the residual it added, so one NaN gradient cannot
        poison later steps. Decided on the device (``torch.where`` on
        per-matrix flags): no host sync between this call's collectives.
        """
        mean_ok = finite_flags(approx)
        ok = mean_ok & finite_flags(res)
        self._nonfinite.add(mean_ok)
        for k, x in enumerate(mats):
            if self.warm_start:
                self.q.keep(x.name, torch.where(ok[k], qs[k], old_qs[k]))
            if self.error_feedback:
                self.errors.keep(x.name, torch.where(ok[k], res[k], old_errors[k]))

    def _orthonormalize(self, mats: list[_Mat], p_flat: torch.Tensor) -> None:
        offset, start = 0, 0
        while start < len(mats):
            end = start
            while end < len(mats) and (mats[end].n, mats[end].r) == (mats[start].n, mats[start].r):
                end += 1
            n, r, b = mats[start].n, mats[start].r, end - start
            orthonormalize_(p_flat[offset : offset + b * n * r].view(b, n, r), self.orthogonalization_epsilon)
            offset += b * n * r
            start = end

    def _buffer(self, key: str, shapes: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A pooled flat fp32 buffer and its consecutive matrix views."""
        flat = self._pool.get(key, sum(a * b for a, b in shapes), torch.float32, device)
        views, offset = [], 0
        for a, b in shapes:
            views.append(flat[offset : offset + a * b].view(a, b))
            offset += a * b
        return flat, views

    def _initial_q(self, x: _Mat, device: torch.device) -> torch.Tensor:
        q = self.q.get(x.name)
        if self.warm_start and q is not None and q.shape == (x.m, x.r):
            return q.to(device)
        draw = self.draws.get(x.name, 0)
        self.draws[x.name] = draw + 1
        # A private CPU generator: same numbers on every rank and device, and
        # the user's global RNG stream is left exactly where it was.
        gen = torch.Generator(device="cpu")
        gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(x.name.encode()) * 7919 + draw) % (2**63))
        return torch.randn(x.m, x.r, generator=gen, device="cpu").to(device)

    def _error(self, x: _Mat, device: torch.device) -> torch.Tensor:
        e = self.errors.get(x.name)
        if e is None or e.shape != (x.n, x.m):
            e = self.errors[x.name] = torch.zeros(x.n, x.m, device=device)
        elif e.device != device:
            e = self.errors[x.name] = e.to(device)
        return e

    # --- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **self._state(),
            "nonfinite_steps": self._nonfinite.value(),
            "q": {k: v.detach().clone() for k, v in self.q.items()},
            "errors": {k: v.detach().clone() for k, v in self.errors.items()},
        }

    def rollback_state(self) -> dict[str, Any]:
        """Like :meth:`state_dict` but holding the Qs and residuals by reference (no copy).

        The next step writes its Qs and residuals into other tensors (see
        :class:`~shoal.codecs.base.RollbackSlots`), so the snapshot stays valid.
        """
        return {**self._state(), "q": self.q.snapshot(), "errors": self.errors.snapshot()}

    def _state(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "config": self.config(),
            "calls": dict(self.calls),
            "draws": dict(self.draws),
            "numel_before": self.numel_before,
            "numel_after": self.numel_after,
            "nonfinite_steps": self._nonfinite.snapshot(),
        }

    def newcomer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The peer's warm-start Qs and counters, with this worker's residuals at zero."""
        return {**state, "errors": {k: torch.zeros_like(v) for k, v in state["errors"].items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state["config"] != self.config():
            raise ConfigError(f"PowerSGD state was saved with config {state['config']}, this codec has {self.config()}")
        self.calls = {k: int(v) for k, v in state["calls"].items()}
        self.draws = {k: int(v) for k, v in state["draws"].items()}
        self.q.load(state["q"])
        self.errors.load(state["errors"])
        self.numel_before, self.numel_after = int(state["numel_before"]), int(state["numel_after"])
        self._nonfinite.load(state["nonfinite_steps"])

    @property
    def nonfinite_steps(self) -> int:
        """Calls in which some matrix's mean was NaN/Inf (a host sync: not for the step's path)."""
        return self._nonfinite.value()

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out.update(
            numel_before=self.numel_before,
            numel_after=self.numel_after,
            compression_rate=self.numel_before / self.numel_after if self.numel_after else 1.0,
            nonfinite_steps=self.nonfinite_steps,
        )
        return out


def _check_int(what: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {value!r}")
