"""The arithmetic of a comparison: time to target, the ideal curve, efficiency.

All functions take *points*: dicts with at least ``wall_s``, ``samples`` and
``val_loss``, in increasing ``step`` order, as the workers record them.

* **time to target**: the training seconds at which validation loss first
  reaches the target, linearly interpolated between the two eval points around
  the crossing (None if never reached).
* **ideal curve**: what a perfect network would give on this cluster. ``local``
  (one worker, same global batch) gives the best loss per sample; ``nosync``
  (all workers, no communication) gives the most samples per second. The ideal
  loss at second ``t`` is local's loss at the number of samples nosync had
  processed by ``t``.
* **efficiency** of a strategy: ideal time to target / its own time to
  target (1.0 = as fast as a perfect network; 0.25 = four times slower).
* **speed-up vs DDP**: ddp's time to target / the strategy's.

Example:
    >>> pts = [{"wall_s": 0, "samples": 0, "val_loss": 5.0}, {"wall_s": 10, "samples": 100, "val_loss": 3.0}]
    >>> time_to_target(pts, 4.0)
    5.0
"""

from __future__ import annotations

from typing import Any, Sequence

Point = dict[str, Any]


def crossing(xs: Sequence[float], losses: Sequence[float | None], target: float) -> float | None:
    """First ``x`` where the loss reaches ``target``, interpolated linearly.

    >>> crossing([0, 10, 20], [5.0, 4.0, 2.0], 3.0)
    15.0
    >>> crossing([0, 10], [5.0, 4.0], 3.0) is None
    True
    """
    prev: tuple[float, float] | None = None
    for x, loss in zip(xs, losses):
        if loss is None:
            continue
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(x)
            x0, l0 = prev
            return float(x0 + (x - x0) * (l0 - target) / (l0 - loss))
        prev = (x, loss)
    return None


def time_to_target(points: Sequence[Point], target: float) -> float | None:
    """Training seconds until validation loss reaches ``target`` (None if never)."""
    return crossing([p["wall_s"] for p in points], [p["val_loss"] for p in points], target)


def samples_to_target(points: Sequence[Point], target: float) -> float | None:
    """Samples until validation loss reaches ``target`` (None if never)."""
    return crossing([p["samples"] for p in points], [p["val_loss"] for p in points], target)


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """``y`` at ``x`` on the polyline ``(xs, ys)`` (xs increasing); None outside its range.

    >>> interpolate(5, [0, 10], [1.0, 3.0])
    2.0
    """
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return float(y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return float(ys[0])


def _valid(points: Sequence[Point]) -> list[Point]:
    return [p for p in points if p.get("val_loss") is not None]


def ideal_curve(local: Sequence[Point], nosync: Sequence[Point]) -> list[Point]:
    """Ideal ``(wall_s, samples, val_loss)``: local's loss at nosync's samples per second.

    Defined at nosync's eval times, while nosync's sample count stays within
    the range local covered.

    >>> local = [{"wall_s": 0, "samples": 0, "val_loss": 5.0}, {"wall_s": 99, "samples": 100, "val_loss": 3.0}]
    >>> nosync = [{"wall_s": 0, "samples": 0, "val_loss": 5.0}, {"wall_s": 10, "samples": 50, "val_loss": 4.5}]
    >>> [p["val_loss"] for p in ideal_curve(local, nosync)]
    [5.0, 4.0]
    """
    lp = _valid(local)
    xs, ys = [p["samples"] for p in lp], [p["val_loss"] for p in lp]
    out = []
    for p in nosync:
        loss = interpolate(p["samples"], xs, ys)
        if loss is not None:
            out.append({"wall_s": p["wall_s"], "samples": p["samples"], "val_loss": loss})
    return out


def nosync_seconds_for(samples: float, nosync: Sequence[Point]) -> float | None:
    """Seconds nosync needs to process ``samples``: interpolated on its curve,
    extrapolated at its average rate beyond its last point.

    >>> nosync_seconds_for(150, [{"wall_s": 0, "samples": 0}, {"wall_s": 10, "samples": 100}])
    15.0
    """
    if not nosync:
        return None
    xs, ts = [p["samples"] for p in nosync], [p["wall_s"] for p in nosync]
    inside = interpolate(samples, xs, ts)
    if inside is not None:
        return inside
    last = nosync[-1]
    if last["samples"] <= 0 or last["wall_s"] <= 0:
        return None
    return float(samples * last["wall_s"] / last["samples"])


def ideal_time_to_target(local: Sequence[Point], nosync: Sequence[Point], target: float) -> float | None:
    """Seconds a perfect network would need: samples local needs, at nosync's pace."""
    n = samples_to_target(local, target)
    return None if n is None else nosync_seconds_for(n, nosync)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def auto_target(finals: dict[str, float | None]) -> float | None:
    """The target every listed strategy reached: the highest final validation loss.

    >>> auto_target({"ddp": 3.1, "local": 2.5, "broken": None})
    3.1
    """
    values = [v for v in finals.values() if v is not None]
    return max(values) if values else None
