"""Which cloud tier takes a call (edged/routing/tiers.py): work that can wait goes to the
cheapest tier, urgent work to the fastest, the rest in the same order; unmeasured is slowest."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from edged.routing.tiers import FLEXIBLE_S, Option, flexible, order

OPTIONS = st.lists(
    st.builds(
        Option,
        st.integers(0, 1000),
        st.sampled_from([0.0, 0.3, 1.0, 2.5]),
        st.one_of(st.none(), st.floats(0.001, 5.0)),
    ),
    max_size=6,
)


def speed(option: Option[int]) -> float:
    return math.inf if option.seconds is None else option.seconds


def test_spot_for_what_can_wait_on_demand_for_what_cannot() -> None:
    on_demand, spot = Option("on-demand", 1.0, 0.010), Option("spot", 0.3, 0.030)
    assert [o.tier for o in order([on_demand, spot], can_wait=True)] == ["spot", "on-demand"]
    assert [o.tier for o in order([on_demand, spot], can_wait=False)] == ["on-demand", "spot"]
    unmeasured = Option("new", 0.1, None)
    assert order([unmeasured, on_demand], can_wait=False)[0] is on_demand
    assert order([unmeasured, on_demand], can_wait=True)[0] is unmeasured


def test_what_can_wait() -> None:
    assert not flexible(0, 0.5) and not flexible(1, 0.999)
    assert flexible(2, 0.1) and flexible(0, FLEXIBLE_S) and flexible(1, 30.0)


@given(OPTIONS, st.booleans())
def test_the_order_is_every_tier_once_best_first(options: list[Option[int]], wait: bool) -> None:
    ordered = order(options, wait)
    assert sorted(map(id, ordered)) == sorted(map(id, options))
    keys = [(o.cost, speed(o)) if wait else (speed(o), o.cost) for o in ordered]
    assert keys == sorted(keys)
    if options:
        best = min(o.cost for o in options) if wait else min(speed(o) for o in options)
        assert (ordered[0].cost if wait else speed(ordered[0])) == best
