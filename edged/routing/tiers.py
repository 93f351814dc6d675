"""Which cloud tier takes a call (pure): of the tiers that can take it now, work that can wait
goes to the cheapest, urgent work to the fastest; the rest follow in the same order, each the
next to try when the one before fails. The router and the routing lab both use it."""

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


def order(options: Sequence[Option[T]], can_wait: bool) -> list[Option[T]]:
    """The tiers in the order they are tried: by cost, then speed, for work that can wait; by
    speed, then cost, for urgent work. Unmeasured counts as slowest; ties keep the
    configuration's order (sorted is stable)."""

    def speed(option: Option[T]) -> float:
        return math.inf if option.seconds is None else option.seconds

    if can_wait:
        return sorted(options, key=lambda o: (o.cost, speed(o)))
    return sorted(options, key=lambda o: (speed(o), o.cost))
