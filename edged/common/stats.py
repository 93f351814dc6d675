"""Small running statistics shared by the scheduler, the runtimes and the monitors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# the latency histograms' buckets, in seconds: edged's metrics, and the fleet simulator's
# nodes (bench/fleetsim.py), whose series the fleet service reads as edged's
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def ewma(old: float | None, new: float, alpha: float = 0.2) -> float:
    """Exponentially weighted moving average; the first sample starts it."""
    return new if old is None else old + alpha * (new - old)


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) of sorted samples, nearest rank; None when there are none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative buckets (upper bound -> count):
    linear within the bucket, the highest finite bound when the rank falls in +Inf; None when
    there are no counts."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in sorted(buckets):
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower
