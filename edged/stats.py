"""Small running statistics shared by the scheduler, the runtimes and the monitors."""

from __future__ import annotations

from collections.abc import Sequence


def ewma(old: float | None, new: float, alpha: float = 0.2) -> float:
    """Exponentially weighted moving average; the first sample starts it."""
    return new if old is None else old + alpha * (new - old)


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) of sorted samples, nearest rank; None when there are none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
