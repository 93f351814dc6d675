"""The circuit breaker on a clock the test moves: opening at 5%, half-open probes, closing,
backoff on a failed probe; and a property test over random outcome sequences."""

from __future__ import annotations

import random

from edged.breaker import BreakerState, CircuitBreaker, ScaleOut


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_above_5_percent_then_half_opens_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(clock=clock)
    for i in range(100):  # 10% of calls fail, as the scenario
        clock.now += 0.01
        assert breaker.allow()
        breaker.record(ok=i % 10 != 0)
        if breaker.state is BreakerState.OPEN:
            break
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow()  # refused at once while open
    clock.now += 1.01  # the cooldown (1 s)
    assert [breaker.allow() for _ in range(4)] == [True, True, True, False]  # 3 probes
    assert breaker.state is BreakerState.HALF_OPEN
    for _ in range(3):
        breaker.record(ok=True)
    assert breaker.state is BreakerState.CLOSED and breaker.allow()


def test_a_failed_probe_reopens_with_a_longer_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(min_calls=5, clock=clock)
    for _ in range(5):
        breaker.allow()
        breaker.record(ok=False)
    assert breaker.state is BreakerState.OPEN
    clock.now += 1.0
    assert breaker.allow()
    breaker.record(ok=False)
    assert breaker.state is BreakerState.OPEN and breaker.cooldown == 2.0
    clock.now += 1.5
    assert not breaker.allow()  # 2 s now
    clock.now += 0.5
    assert breaker.allow()


def test_below_the_rate_or_the_minimum_it_stays_closed() -> None:
    clock = Clock()
    breaker = CircuitBreaker(clock=clock)
    for i in range(1000):  # 4% failures
        clock.now += 0.01
        breaker.allow()
        breaker.record(ok=i % 25 != 0)
    assert breaker.state is BreakerState.CLOSED
    fresh = CircuitBreaker(clock=clock)
    for _ in range(19):  # all fail, but fewer than min_calls
        fresh.record(ok=False)
    assert fresh.state is BreakerState.CLOSED


def test_old_failures_leave_the_window() -> None:
    clock = Clock()
    breaker = CircuitBreaker(clock=clock)
    for _ in range(3):
        breaker.record(ok=False)
    clock.now += 11  # the 10 s window has passed
    for _ in range(30):
        breaker.record(ok=True)
    assert breaker.state is BreakerState.CLOSED and breaker.failure_rate() == 0.0


def test_never_lets_more_than_the_probes_through_while_half_open() -> None:
    rng = random.Random(7)
    for _ in range(200):
        clock = Clock()
        breaker = CircuitBreaker(min_calls=5, probes=2, clock=clock)
        in_flight = 0
        for _ in range(300):
            clock.now += rng.random() * 0.2
            was_half_open = breaker.state is BreakerState.HALF_OPEN
            if breaker.allow():
                in_flight += 1
            if in_flight and rng.random() < 0.6:
                in_flight -= 1
                breaker.record(ok=rng.random() < 0.8)
            if breaker.state is BreakerState.HALF_OPEN and was_half_open:
                assert breaker.trial_started <= 2
            assert breaker.cooldown <= 64.0


def test_would_allow_takes_no_probe_slot_and_reset_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(min_calls=4, cooldown=1.0, probes=2, clock=clock)
    for ok in (True, True, False, False):
        breaker.record(ok)
    assert breaker.state is BreakerState.OPEN and not breaker.would_allow()
    clock.now += 1.0
    assert breaker.current() is BreakerState.HALF_OPEN  # as the status shows it
    for _ in range(5):
        assert breaker.would_allow()  # asking takes no slot
    assert breaker.allow() and breaker.allow() and not breaker.allow()
    assert not breaker.would_allow()  # the two probe slots are taken
    breaker.reset()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert (breaker.opened, breaker.trials) == (1, 2)


def test_scale_out_is_raised_above_the_rate_over_the_window_and_lowered_below_it() -> None:
    clock = Clock()
    scale = ScaleOut(error_rate=0.05, window=60.0, min_calls=20, clock=clock)
    changes = []
    for i in range(19):  # 2 failures of 19: too few calls to tell
        changes.append(scale.record(ok=i % 10 != 0))
        clock.now += 0.5
    assert changes == [None] * 19 and not scale.raised
    assert scale.record(ok=True) is True  # the 20th: 2 of 20 = 10% > 5%
    assert scale.raised and scale.counts() == (20, 2)
    for _ in range(19):  # 2 of 39: still over
        assert scale.record(ok=True) is None
    assert scale.record(ok=True) is False  # 2 of 40 = 5%: not more than 5%
    assert not scale.raised
    assert scale.record(ok=False) is True  # 3 of 41


def test_scale_out_forgets_what_left_the_window_and_holds_on_too_few_calls() -> None:
    clock = Clock()
    scale = ScaleOut(error_rate=0.05, window=10.0, min_calls=5, clock=clock)
    for _ in range(5):
        scale.record(ok=False)
    assert scale.raised
    clock.now += 9.0
    assert scale.check() is None and scale.counts() == (5, 5)  # still in the window
    clock.now += 2.0
    assert scale.counts() == (0, 0)
    assert scale.check() is False  # no call for a whole window: nothing to scale for
    for _ in range(5):
        scale.record(ok=False)
    clock.now += 11.0
    assert scale.record(ok=True) is None  # 1 call (a probe) is too few to lower it
    assert scale.raised


def test_scale_out_memory_is_bound_by_the_window_not_the_traffic() -> None:
    clock = Clock()
    scale = ScaleOut(window=60.0, clock=clock)
    for _ in range(600):  # 10 minutes at 100 calls a second
        for _ in range(100):
            scale.record(ok=True)
        clock.now += 1.0
    assert len(scale.buckets) <= 60
    assert scale.counts() == (5900, 0)  # the seconds after now - 60 (now is a second on)
