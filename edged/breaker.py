"""Circuit breaker for a cloud endpoint.

CLOSED: calls go through; outcomes are counted over a sliding ``window`` of seconds. When at
least ``min_calls`` ended in the window and the share of failures passes ``error_rate`` (5% by
default), the breaker OPENs: calls are refused at once (the router sends the work elsewhere).
After ``cooldown`` seconds it is HALF_OPEN: up to ``probes`` calls go through; if they all
succeed it CLOSEs (with a fresh window), one failure OPENs it again with the cooldown doubled
(up to ``max_cooldown``), so a sick endpoint is not hammered.

``ArmBreakers`` keeps one such breaker per arm of a cloud model's A/B split, so that a failing
version of one model is refused on its own while the tier goes on serving the rest.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Decides whether a call to an endpoint may go out, from how the last calls ended."""

    def __init__(
        self,
        error_rate: float = 0.05,
        window: float = 10.0,
        min_calls: int = 20,
        cooldown: float = 1.0,
        max_cooldown: float = 64.0,
        probes: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.error_rate = error_rate
        self.window = window
        self.min_calls = min_calls
        self.base_cooldown = cooldown
        self.cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.probes = probes
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.outcomes: deque[tuple[float, bool]] = deque()  # (time, ok) in the window
        self.opened_at = 0.0
        self.trial_started = 0  # half-open calls let through
        self.trial_passed = 0
        self.opened = 0  # times it opened, for the status
        self.trials = 0  # half-open probe calls let through, for the status

    def allow(self) -> bool:
        """May a call go out now? (In HALF_OPEN this takes one of the probe slots.)"""
        if self.state is BreakerState.OPEN:
            if self.clock() - self.opened_at < self.cooldown:
                return False
            self.state = BreakerState.HALF_OPEN
            self.trial_started = self.trial_passed = 0
        if self.state is BreakerState.HALF_OPEN:
            if self.trial_started >= self.probes:
                return False
            self.trial_started += 1
            self.trials += 1
        return True

    def current(self) -> BreakerState:
        """The state as of now: an OPEN breaker whose cool-down has passed is HALF_OPEN."""
        if self.state is BreakerState.OPEN and self.clock() - self.opened_at >= self.cooldown:
            return BreakerState.HALF_OPEN
        return self.state

    def reset(self) -> None:
        """CLOSED with a fresh window and the base cool-down (the endpoint was proven healthy
        another way, e.g. the link's probes after an outage)."""
        self.state = BreakerState.CLOSED
        self.cooldown = self.base_cooldown
        self.outcomes.clear()

    def would_allow(self) -> bool:
        """Would ``allow`` let a call out now? (Takes no probe slot: for routing decisions.)"""
        if self.state is BreakerState.OPEN:
            return self.clock() - self.opened_at >= self.cooldown
        if self.state is BreakerState.HALF_OPEN:
            return self.trial_started < self.probes
        return True

    def record(self, ok: bool) -> None:
        """How an allowed call ended."""
        now = self.clock()
        if self.state is BreakerState.HALF_OPEN:
            if not ok:
                self._open(now, backoff=True)
                return
            self.trial_passed += 1
            if self.trial_passed >= self.probes:
                self.state = BreakerState.CLOSED
                self.cooldown = self.base_cooldown
                self.outcomes.clear()
            return
        if self.state is BreakerState.OPEN:
            return  # a call that left before the breaker opened
        self.outcomes.append((now, ok))
        while self.outcomes and self.outcomes[0][0] < now - self.window:
            self.outcomes.popleft()
        failures = sum(1 for _, good in self.outcomes if not good)
        if len(self.outcomes) >= self.min_calls and failures > self.error_rate * len(self.outcomes):
            self._open(now, backoff=False)

    def _open(self, now: float, backoff: bool) -> None:
        if backoff:
            self.cooldown = min(self.max_cooldown, self.cooldown * 2)
        self.state = BreakerState.OPEN
        self.opened += 1
        self.opened_at = now
        self.outcomes.clear()

    def release(self) -> None:
        """An allowed call whose ending says nothing of this endpoint (it failed elsewhere, or
        was never sent): in HALF_OPEN its probe slot is free again, so the trial still ends."""
        if self.state is BreakerState.HALF_OPEN and self.trial_started > self.trial_passed:
            self.trial_started -= 1

    def failure_rate(self) -> float:
        """Share of failed calls in the window (0 when none ended)."""
        if not self.outcomes:
            return 0.0
        return sum(1 for _, ok in self.outcomes if not ok) / len(self.outcomes)


class ArmBreakers:
    """The breakers of a tier's A/B split calls, one per model and version called (an arm).

    The tier's own breaker answers for the tier as a whole; a failing arm must not close the
    tier to the healthy arm and to every other model, so a split call's failures that are its
    version's are counted here instead. A call drawn for an arm whose circuit is open goes to
    the other arm while that one's is not (``choose``). Made on first use with the tier
    breaker's settings (``make``); a model's are forgotten when its split changes."""

    def __init__(self, make: Callable[[], CircuitBreaker]) -> None:
        self.make = make
        self.breakers: dict[tuple[str, str], CircuitBreaker] = {}

    def of(self, model: str, version: str) -> CircuitBreaker:
        """The breaker of ``model``'s arm ``version`` (its name on the server)."""
        found = self.breakers.get((model, version))
        if found is None:
            found = self.breakers[(model, version)] = self.make()
        return found

    def choose(self, model: str, drawn: str, other: str) -> str | None:
        """Where a call drawn for version ``drawn`` goes: there while its circuit would let
        it, else to ``other`` while that one's would; None when both are open. Takes no
        probe slot (``allow`` does, when the call goes out)."""
        for version in (drawn, other):
            if self.of(model, version).would_allow():
                return version
        return None

    def forget(self, model: str) -> None:
        """A new split (or none) of ``model``: its arms start afresh."""
        for key in [k for k in self.breakers if k[0] == model]:
            del self.breakers[key]

    def reset(self) -> None:
        """Every arm CLOSED (the link came back: what the outage made fail says nothing of
        the versions)."""
        for breaker in self.breakers.values():
            breaker.reset()


class ScaleOut:
    """The scale-out signal of a cloud endpoint, for whoever sizes the cloud (an autoscaler
    reading the metric, the fleet reading the event): the share of its calls that failed over
    the last ``window`` seconds, counted in one-second buckets (memory bound by the window,
    whatever the traffic).

    Raised when, with at least ``min_calls`` calls in the window, more than ``error_rate`` of
    them failed; lowered when, with at least ``min_calls``, no more than that did, or when no
    call at all was made for a whole window. With fewer calls than that it stays as it was:
    while the breaker holds the traffic back, a few probes say too little either way."""

    def __init__(
        self,
        error_rate: float = 0.05,
        window: float = 60.0,
        min_calls: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.error_rate = error_rate
        self.window = window
        self.min_calls = min_calls
        self.clock = clock
        self.buckets: deque[list[int]] = deque()  # [second, calls, failures], oldest first
        self.raised = False

    def record(self, ok: bool) -> bool | None:
        """How a call ended; the signal's new state when this changed it, else None."""
        second = int(self.clock())
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append([second, 0, 0])
        self.buckets[-1][1] += 1
        self.buckets[-1][2] += not ok
        return self.check()

    def counts(self) -> tuple[int, int]:
        """Calls and failures in the window, as of now."""
        oldest = int(self.clock() - self.window)
        while self.buckets and self.buckets[0][0] <= oldest:
            self.buckets.popleft()
        return sum(b[1] for b in self.buckets), sum(b[2] for b in self.buckets)

    def check(self) -> bool | None:
        """Re-evaluate as of now; the new state when it changed, else None."""
        calls, failures = self.counts()
        if calls >= self.min_calls:
            raised = failures > self.error_rate * calls
        elif calls == 0:
            raised = False
        else:
            return None
        if raised == self.raised:
            return None
        self.raised = raised
        return raised
