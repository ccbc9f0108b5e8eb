"""The chaos bench's loss at equal samples: the fault-free half's loss curve, read where the chaos half stopped.

Both halves of ``python -m shoal.bench.chaos`` train for the same number of
steps, but with a local-step strategy (local SGD, DiLoCo, streaming DiLoCo) a
kill loses the victim's steps since its last round, and a restart contributes
only once it is in: the chaos half commits fewer samples than the fault-free
half (4.8 % fewer, on the cluster's DiLoCo run of 2026-11-29). Its final loss
is then higher for two reasons at once: fewer samples (what the goodput
already charges) and whatever the faults did to the model (a bad heal, a
restart's stale or empty state). The loss band is meant for the second, and
the rule for quality is to compare at equal samples. So the fault-free
half's workers also keep their model at the last ``--curve`` round
boundaries (steps ``k * period + r``, ``r`` the step of a period a round
ends at, the last being the run's last step; written between two steps,
off the step's clock), the bench evaluates each after the run, as the workers
evaluate their final model (the mean over the workers), and reads that curve
at the chaos half's committed samples, linearly between the two round
boundaries around it. The same-length comparison stays in the report
(``val_loss`` of both halves); this one is ``loss_at_equal_samples``.

Committed samples are counted in worker-steps (each of ``per_worker``
samples): every incarnation's steps that made progress, less the steps each
killed one lost with it (:func:`shoal.bench.chaos_stats.progress_steps`,
:func:`~shoal.bench.chaos_stats.unsynced_steps`, the same counts as the
goodput).

Example::

    curve = read_curve(out, evaluate, workers)              # [(step, mean loss over the workers), ...]
    x = worker_steps(logs, lost) / workers                  # the chaos half's samples, in per-worker steps
    at_equal_samples(curve, x)                              # the fault-free loss there, or None below the curve
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import torch

from shoal.bench.chaos_stats import progress_steps

_NAME = re.compile(r"^curve-(\d+)-(\d+)\.pt$")
__all__ = ["at_equal_samples", "due", "read_curve", "save_point", "worker_steps"]


def due(step: int, steps: int, period: int, after_round: int | None, curve: int) -> bool:
    """Whether a worker keeps its model after ``step``: a round boundary among the last ``curve`` ones of a run
    of ``steps`` (``after_round``: the step of a period a round ends at; None: a step-synchronous strategy,
    which keeps none)."""
    if after_round is None or curve < 1 or step < 1 or step % period != after_round:
        return False
    end = steps + (after_round - steps) % period   # the run's last step: the first round boundary at or past steps
    return step > end - curve * period


def save_point(model: torch.nn.Module, out: str, rank: int, step: int) -> None:
    """Write ``model``'s parameters and buffers after ``step`` (``curve-<rank>-<step>.pt`` under ``out``)."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    path = os.path.join(out, f"curve-{rank}-{step}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def read_curve(out: str, evaluate: Callable[[dict[str, torch.Tensor]], float],
               workers: int) -> list[tuple[int, float]]:
    """The fault-free half's curve: per step that every one of the ``workers`` kept, the mean of ``evaluate``
    over their models (as the final ``val_loss`` is the mean over the workers), in step order."""
    points: dict[int, dict[int, str]] = {}
    for name in os.listdir(out):
        m = _NAME.match(name)
        if m:
            points.setdefault(int(m.group(2)), {})[int(m.group(1))] = os.path.join(out, name)
    curve = []
    for step in sorted(points):
        if len(points[step]) != workers:
            continue   # not every worker got there (a run cut short): no mean over the same workers
        vals = [evaluate(torch.load(points[step][r], weights_only=True)) for r in sorted(points[step])]
        curve.append((step, sum(vals) / len(vals)))
    return curve


def worker_steps(logs: dict[Any, list[dict[str, Any]]], lost: list[float]) -> float:
    """The committed worker-steps of a half: every incarnation's progress steps less ``lost``, what the killed
    ones lost with them (the goodput's count, :func:`shoal.bench.chaos_stats.goodput`)."""
    return float(sum(len(progress_steps(lg)) for lg in logs.values())) - float(sum(lost))


def at_equal_samples(curve: list[tuple[int, float]], x: float) -> float | None:
    """The curve's loss at ``x`` per-worker steps: linear between the two points around it, the last point's at
    or past its end (no extrapolation: a half that committed more than the fault-free one is read at its end),
    None before its first point (keep more points: ``--curve``)."""
    if not curve or x < curve[0][0]:
        return None
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if s0 <= x <= s1:
            return v0 + (v1 - v0) * (x - s0) / (s1 - s0)
    return curve[-1][1]
