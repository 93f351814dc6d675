"""Which cloud tier takes a call (edged/routing/tiers.py): the cheapest expected in time (for
urgent work, within half its time), else the fastest; the time a tier with another after it
gets; what can wait."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from edged.routing.tiers import FLEXIBLE_S, URGENT_MARGIN, Option, budget, flexible, order

OPTIONS = st.lists(
    st.builds(
        Option,
        st.integers(0, 1000),
        st.sampled_from([0.0, 0.3, 1.0, 2.5]),
        st.one_of(st.none(), st.floats(0.001, 5.0)),
    ),
    max_size=6,
)
SECONDS = st.one_of(st.none(), st.floats(0.001, 2.0))


def speed(option: Option[int]) -> float:
    return math.inf if option.seconds is None else option.seconds


def names(options: list[tuple[Option[str], str]]) -> list[str]:
    return [o.tier for o, _ in options]


def test_the_cheapest_in_time_else_the_fastest() -> None:
    on_demand, spot = Option("on-demand", 1.0, 0.010), Option("spot", 0.3, 0.030)
    assert names(order([on_demand, spot], True, 1.0)) == ["spot", "on-demand"]
    assert names(order([on_demand, spot], True, 0.02)) == ["on-demand", "spot"]
    # urgent: a cheaper tier only when expected within half the time
    assert names(order([on_demand, spot], False, 1.0)) == ["spot", "on-demand"]
    ordered = order([on_demand, spot], False, 0.05)
    assert ordered == [
        (on_demand, "cheapest expected within half the time"),
        (spot, "fastest, none cheaper expected in time"),
    ]
    assert order([on_demand, spot], True, 1.0)[0][1] == "cheapest expected in time"
    # not measured yet: tried when it can wait (else it never would be), last when urgent
    new = Option("new", 0.1, None)
    assert names(order([on_demand, new], True, 1.0)) == ["new", "on-demand"]
    assert names(order([new, on_demand], False, 1.0)) == ["on-demand", "new"]


def test_a_tier_with_another_after_it_leaves_the_next_its_time() -> None:
    assert budget(3.0, 0.0, 0.2, 0.005) == 2.25  # the next gets a quarter at least
    assert budget(3.0, 0.0, 0.2, 0.5) == 2.0  # or twice its expected time
    assert budget(0.025, 0.0, 0.019, 0.017) == 0.025  # tight: not split for a maybe
    assert budget(0.3, 0.0, 0.005, 0.2) == 0.3  # the next could not make it anyway
    assert budget(1.0, 0.2, None, 0.02) == 0.5  # unmeasured: half of what is left
    assert budget(1.0, 0.6, 0.01, None) == 0.4  # never more than the reserve leaves


def test_what_can_wait() -> None:
    assert not flexible(0, 0.5) and not flexible(1, 0.999)
    assert flexible(2, 0.1) and flexible(0, FLEXIBLE_S) and flexible(1, 30.0)


@given(OPTIONS, st.booleans(), st.floats(0.001, 5.0))
def test_every_tier_once_cheapest_in_time_first_then_fastest(
    options: list[Option[int]], wait: bool, deadline: float
) -> None:
    ordered = [o for o, _ in order(options, wait, deadline)]
    assert sorted(map(id, ordered)) == sorted(map(id, options))
    limit = deadline if wait else URGENT_MARGIN * deadline

    def fits(o: Option[int]) -> bool:
        return (wait and o.seconds is None) or speed(o) <= limit

    n = sum(map(fits, options))
    assert all(map(fits, ordered[:n])) and not any(map(fits, ordered[n:]))
    head = [(o.cost, speed(o)) for o in ordered[:n]]
    assert head == sorted(head)
    tail = [speed(o) for o in ordered[n:]]
    assert tail == sorted(tail)


@given(st.floats(0.0, 5.0), st.floats(0.0, 1.0), SECONDS, SECONDS)
def test_a_budget_is_never_more_than_what_is_left(
    left: float, reserve: float, expected: float | None, after: float | None
) -> None:
    got = budget(left, reserve, expected, after)
    assert got <= left - reserve
    if expected is not None and after is not None:
        assert got >= min(left - reserve, 2 * expected)
        assert got == left - reserve or left - reserve - got >= max(2 * after, left / 4) - 1e-9
