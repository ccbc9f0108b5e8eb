"""A round's exact mean in chunks, so that an attempt cut by a lost member keeps what it finished.

DiLoCo's outer round all-reduces the whole pseudo-gradient: ~10 s of a 20 mbit link for the
3.26 M-parameter ``lm``. A member killed in that all-reduce used to cost the survivors the part of
the round already done plus the whole round again over the new quorum. With
:class:`ResumableMean` the mean runs as a sequence of chunk all-reduces (at most
``max_chunks``, each at least ``min_bytes``); each member remembers which chunks it finished and
their results. The next attempt of the same round (same round name, same commit count) first
agrees over the new quorum on the chunks *every* member finished (one all-reduce of one integer,
``min``), checks that they hold the same values there (one all-gather of two fp64 sums), copies
them back, and all-reduces only the rest. So a kill mid-round costs about the chunk in flight and a
rebuild, not a whole round.

What a kept chunk holds: the mean over the quorum of the attempt that finished it, the lost
member's pseudo-gradient included (it was a contributor when it sent it); the chunks reduced again
hold the mean over the survivors. Every member holds the same values: the agreement takes only
chunks all of them finished, a gloo/NCCL all-reduce gives every member that finishes it the same
result, and the check makes a disagreement this attempt's failure (and forgets what was kept).
A member that has nothing kept (a newcomer healed into the retry) agrees on 0: the round then runs
whole, as before.

Only for the exact mean (:class:`~shoal.codecs.Identity`): a stateful or lossy codec encodes the
whole tensor set at once (error feedback, PowerSGD's factors). Reading the agreed count is one host
sync before the round's first bulk collective (once per round, not per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from shoal.codecs.base import Codec
from shoal.errors import ShoalError

Slice = tuple[int, int, int]     # (tensor index, start, end) in that tensor's flattened elements


def plan_chunks(numels: Sequence[int], elem_bytes: int, min_bytes: int, max_chunks: int) -> list[list[Slice]]:
    """Split the concatenation of tensors of ``numels`` elements into at most ``max_chunks`` chunks of
    at least ``min_bytes`` (the last may be smaller), in order; each chunk a list of tensor slices."""
    total = sum(numels)
    if total == 0:
        return []
    per = max(math.ceil(total / max_chunks), math.ceil(min_bytes / elem_bytes), 1)
    chunks: list[list[Slice]] = []
    cur: list[Slice] = []
    room = per
    for i, n in enumerate(numels):
        at = 0
        while at < n:
            take = min(room, n - at)
            cur.append((i, at, at + take))
            at += take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur, room = [], per
    if cur:
        chunks.append(cur)
    return chunks


@dataclass
class _Record:
    key: tuple[Any, ...]
    done: int = 0
    saved: list[torch.Tensor] = field(default_factory=list)


class ResumableMean:
    """Chunked exact means whose finished chunks outlive a failed attempt (see the module docstring).

    Args:
        min_bytes: smallest chunk (a chunk's all-reduce must stay bandwidth-bound).
        max_chunks: most chunks a mean is split into (what a kill can cost: ~1/max_chunks of a round).

    Example (what :meth:`shoal.strategies.rounds.Rounds.mean` does for ``resumable=True``)::

        resume = ResumableMean()
        resume.mean(tensors, names, Identity(), group, "diloco/pseudograd", key=("fragment:0", 12), scale=1.0)
        resume.clear()      # the round committed
    """

    def __init__(self, min_bytes: int = 1 << 20, max_chunks: int = 16) -> None:
        if min_bytes < 1 or max_chunks < 1:
            raise ShoalError(f"min_bytes and max_chunks must be >= 1, got {min_bytes}, {max_chunks}")
        self.min_bytes, self.max_chunks = min_bytes, max_chunks
        self._records: dict[str, _Record] = {}
        self.kept_chunks = 0        # chunks taken from a failed attempt instead of reduced again, all rounds
        self.kept_bytes = 0

    def clear(self) -> None:
        """Forget every finished chunk (a round committed: nothing of it is reduced again)."""
        self._records.clear()

    @torch.no_grad()
    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], codec: Codec, group: Any, tag: str,
             key: tuple[Any, ...], scale: float) -> None:
        """``tensors`` <- their mean over ``group`` times ``scale``, chunk by chunk, keeping an earlier
        attempt's finished chunks where every member has them (``key`` names the round's attempts)."""
        numels = [t.numel() for t in tensors]
        plan = plan_chunks(numels, tensors[0].element_size(), self.min_bytes, self.max_chunks)
        flats = [t.view(-1) for t in tensors]
        sig = (key, tuple(numels), tuple(str(t.dtype) for t in tensors))
        rec = self._records.get(tag)
        if rec is None or rec.key != sig:
            rec = self._records[tag] = _Record(sig)
        kept = self._agree(rec, flats, plan, group, tag)
        if kept < 0:
            return            # the agreement failed: this attempt is lost (the group recorded why)
        for j in range(kept):
            self._copy_in(flats, plan[j], rec.saved[j])
        del rec.saved[kept:]
        rec.done = kept
        self.kept_chunks += kept
        self.kept_bytes += sum(s.numel() * s.element_size() for s in rec.saved)
        for j in range(kept, len(plan)):
            views = [flats[i][a:b] for i, a, b in plan[j]]
            codec.mean(views, [f"{names[i]}[{a}:{b}]" for i, a, b in plan[j]], group, tag)
            if group.error is not None:
                return        # lost: the chunks before this one stay kept for the next attempt
            if scale != 1.0:
                torch._foreach_mul_(views, scale)
            rec.saved.append(torch.cat([v.reshape(-1) for v in views]))
            rec.done = j + 1

    def _agree(self, rec: _Record, flats: list[torch.Tensor], plan: list[list[Slice]], group: Any, tag: str) -> int:
        """The chunks every member finished (-1: the attempt failed); checked to hold the same values."""
        device = flats[0].device
        count = torch.tensor([rec.done], dtype=torch.int64, device=device)
        group.all_reduce(count, op="min", tag=f"{tag}/resume").wait()
        if group.error is not None:
            return -1
        kept = int(count.item())
        if kept == 0:
            return 0
        if kept > rec.done or kept > len(plan):   # pragma: no cover - min over members, mine included
            raise ShoalError(f"resumed round {tag!r}: agreed on {kept} chunks, this member finished {rec.done}")
        d = torch.cat([s.double() for s in rec.saved[:kept]])
        mine = torch.stack([d.sum(), (d * d).sum()]).view(torch.int64)
        table = torch.empty(2 * group.size, dtype=torch.int64, device=device)
        group.all_gather_into(table, mine, tag=f"{tag}/resume").wait()
        if group.error is not None:
            return -1
        if not bool((table.view(-1, 2) == mine).all()):
            rec.saved.clear()
            rec.done = 0
            group.report_error(ShoalError(f"round {tag!r}: the {kept} chunks kept from a failed attempt differ "
                                          "between members; the round runs again whole"))
            return -1
        return kept

    @staticmethod
    def _copy_in(flats: list[torch.Tensor], chunk: list[Slice], saved: torch.Tensor) -> None:
        at = 0
        for i, a, b in chunk:
            flats[i][a:b].copy_(saved[at:at + b - a])
            at += b - a
