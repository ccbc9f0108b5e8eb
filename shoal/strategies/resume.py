"""A round's exact mean in chunks, so that an attempt cut by a lost member keeps what it finished.

DiLoCo's outer round all-reduces the whole pseudo-gradient: ~10 s of a 20 mbit link for the
3.26 M-parameter ``lm``. A member killed in that all-reduce used to cost the survivors the part of
the round already done plus the whole round again over the new quorum. With
:class:`ResumableMean` the mean runs as a sequence of chunk all-reduces (at most
``max_chunks``, each at least ``min_bytes``); each member remembers which chunks it finished and
their results (copied out when the attempt is discarded). The next attempt of the same round
(``key``: the round's name and the runner's count of rounds started) first
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
    plan: list[list[Slice]]
    flats: list[torch.Tensor]
    saved: list[torch.Tensor] = field(default_factory=list)   # chunks kept for the next attempt (copies)
    done: int = 0          # chunks whose mean is in ``flats`` now (this attempt's, kept ones included)
    live: bool = False     # ``flats`` hold this attempt's chunks [0, done) (the agreement succeeded)


class ResumableMean:
    """Chunked exact means whose finished chunks outlive a failed attempt (see the module docstring).

    Args:
        min_bytes: smallest chunk (a chunk's all-reduce must stay bandwidth-bound).
        max_chunks: most chunks a mean is split into (what a kill can cost: ~1/max_chunks of a round).

    Nothing is copied while rounds commit: the finished chunks are copied out of the scratch tensors
    only when an attempt is discarded (:meth:`snapshot`, before the retry overwrites them), so a failed
    round holds one extra copy of what it finished until the next commit (:meth:`clear`).

    Example (what :class:`shoal.strategies.rounds.Rounds` does for ``mean(..., resumable=True)``)::

        resume = ResumableMean()
        resume.mean(tensors, names, Identity(), group, "diloco/pseudograd", key=("fragment:0", 12), scale=1.0)
        resume.snapshot()   # the attempt was discarded: keep what it finished
        resume.clear()      # the round committed, or was given up: nothing of it is used again
    """

    def __init__(self, min_bytes: int = 1 << 20, max_chunks: int = 16) -> None:
        if min_bytes < 1 or max_chunks < 1:
            raise ShoalError(f"min_bytes and max_chunks must be >= 1, got {min_bytes}, {max_chunks}")
        self.min_bytes, self.max_chunks = min_bytes, max_chunks
        self._records: dict[str, _Record] = {}
        self.kept_chunks = 0        # chunks taken from a failed attempt instead of reduced again, all rounds
        self.kept_bytes = 0

    def forget(self, tag: str) -> None:
        """Drop what this member kept for ``tag`` (it was healed into this attempt: its chunks may predate it)."""
        self._records.pop(tag, None)

    def clear(self) -> None:
        """Forget every finished chunk (the round committed or was given up: nothing of it is reduced again)."""
        self._records.clear()

    @torch.no_grad()
    def snapshot(self) -> None:
        """The attempt was discarded: copy the chunks it finished out of the scratch tensors, which the
        next attempt overwrites (chunks kept from earlier attempts are copied already)."""
        for rec in self._records.values():
            if rec.live:
                for j in range(len(rec.saved), rec.done):
                    rec.saved.append(torch.cat([rec.flats[i][a:b] for i, a, b in rec.plan[j]]))
                rec.live = False

    @torch.no_grad()
    def mean(self, tensors: Sequence[torch.Tensor], names: Sequence[str], codec: Codec, group: Any, tag: str,
             key: tuple[Any, ...], scale: float) -> None:
        """``tensors`` <- their mean over ``group`` times ``scale``, chunk by chunk, keeping an earlier
        attempt's finished chunks where every member has them (``key`` names the round's attempts)."""
        numels = [t.numel() for t in tensors]
        flats = [t.view(-1) for t in tensors]
        sig = (key, tuple(numels), tuple(str(t.dtype) for t in tensors))
        rec = self._records.get(tag)
        if rec is None or rec.key != sig:
            plan = plan_chunks(numels, tensors[0].element_size(), self.min_bytes, self.max_chunks)
            rec = self._records[tag] = _Record(sig, plan, flats)
        rec.flats, rec.live = flats, False
        kept = self._agree(rec, group, tag)
        if kept < 0:
            return            # the agreement failed: this attempt is lost (the group recorded why)
        for j in range(kept):
            self._copy_in(flats, rec.plan[j], rec.saved[j])
        del rec.saved[kept:]
        rec.done, rec.live = kept, True
        self.kept_chunks += kept
        self.kept_bytes += sum(s.numel() * s.element_size() for s in rec.saved)
        for j in range(kept, len(rec.plan)):
            views = [flats[i][a:b] for i, a, b in rec.plan[j]]
            codec.mean(views, [f"{names[i]}[{a}:{b}]" for i, a, b in rec.plan[j]], group, tag)
            if group.error is not None:
                return        # lost: the chunks before this one are kept by snapshot() for the next attempt
            if scale != 1.0:
                torch._foreach_mul_(views, scale)
            rec.done = j + 1

    def _agree(self, rec: _Record, group: Any, tag: str) -> int:
        """The chunks every member kept (-1: the attempt failed); checked to hold the same values."""
        device = rec.flats[0].device
        count = torch.tensor([len(rec.saved)], dtype=torch.int64, device=device)
        group.all_reduce(count, op="min", tag=f"{tag}/resume").wait()
        if group.error is not None:
            return -1
        kept = int(count.item())
        if kept == 0:
            return 0
        if kept > len(rec.saved):   # pragma: no cover - min over members, mine included
            raise ShoalError(f"resumed round {tag!r}: agreed on {kept} chunks, this member kept {len(rec.saved)}")
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
