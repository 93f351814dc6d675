"""Which cloud tier takes a call (pure): of the tiers that can take it now, work that can wait
goes to the cheapest that is expected in time, urgent work to the fastest; the rest follow,
each the next to try when the one before fails. The router and the routing lab both use it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

FLEXIBLE_S = 1.0  # a request with this long left can wait: the cheapest tier takes it


@dataclass(frozen=True)
class Option(Generic[T]):
    """One tier that can take the call: its cost per call and how fast it is expected to be
    (its latency estimate, else its link's RTT; None: not measured yet)."""

    tier: T
    cost: float
    seconds: float | None


def flexible(priority: int, left_s: float) -> bool:
    """Can the request wait? A priority level below the first (2 or more), or a second or
    more left."""
    return priority > 1 or left_s >= FLEXIBLE_S


URGENT_MARGIN = 0.5  # urgent work takes a cheaper tier only when expected in half its time


def order(
    options: Sequence[Option[T]], can_wait: bool, deadline_s: float
) -> list[tuple[Option[T], str]]:
    """The tiers in the order they are tried, each with why it is there: the cheapest first of
    those expected in time, then the others, fastest first. In time: for work that can wait,
    within ``deadline_s`` (or not measured yet: how else would a cheap tier ever be
    measured); for urgent work, within ``URGENT_MARGIN`` of it, measured. Unmeasured counts
    as slowest; ties keep the configuration's order (sorted is stable)."""

    def speed(option: Option[T]) -> float:
        return math.inf if option.seconds is None else option.seconds

    if can_wait:
        fits = [o for o in options if o.seconds is None or o.seconds <= deadline_s]
    else:
        fits = [o for o in options if speed(o) <= URGENT_MARGIN * deadline_s]
    late = [o for o in options if o not in fits]
    when = "in time" if can_wait else "within half the time"
    return [
        (o, f"cheapest expected {when}") for o in sorted(fits, key=lambda o: (o.cost, speed(o)))
    ] + [(o, "fastest, none cheaper expected in time") for o in sorted(late, key=speed)]


def budget(
    left_s: float, reserve_s: float, expected_s: float | None, next_expected_s: float | None
) -> float:
    """The time a tier with another after it gets, of ``left_s`` less ``reserve_s`` (kept for
    the local fallback): all but what the next tier needs (twice its expected time, and at
    least a quarter of the time left) when that leaves this one twice its own expected time;
    else all of it (a tight deadline is not split for a failure that may not come, when the
    next tier could not make it anyway); half of what is left when either is not measured."""
    usable = left_s - reserve_s
    if expected_s is None or next_expected_s is None:
        return min(usable, left_s / 2)
    split = usable - max(2 * next_expected_s, left_s / 4)
    return split if split >= 2 * expected_s else usable
