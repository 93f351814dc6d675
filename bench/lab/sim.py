"""The routing lab's replay harness: edged's own routing parts, in simulated time, over a trace.

What runs is edged's code: ``routing.decide`` (the path decision), ``routing.Estimates`` (the
learned latencies), ``CircuitBreaker`` (on the simulated clock), ``LinkMonitor`` (fed with the
trace's probes: every 0.2 s, a failure retried at once, backoff while down, as the daemon does)
and the router's fallback reserve (``router.local_reserve``). What is simulated is only what the
trace says the world did: how long each path took for each request, and whether the cloud could
be reached. Requests are replayed one by one in arrival order; each one's outcome teaches the
estimators, the breaker and the link before the next.

Execution follows the router:
- local: the trace's ``local_ms``;
- cloud: the trace's ``cloud_ms`` if the call is allowed (circuit) and it comes within the
  deadline less the local reserve; else the call gives up at that point and runs locally
  (``fallback``): the wait plus ``local_ms``;
- hedged: the faster of the two;
- a private request that goes to the cloud is counted as a violation (there must be none).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.lab.traces import Trace
from edged.breaker import CircuitBreaker
from edged.common.stats import percentile
from edged.link import LinkMonitor
from edged.routing.conditions import parse
from edged.routing.decide import Decision, Path, Policy, Route, RouteRequest, decide
from edged.routing.estimates import Estimates
from edged.routing.learned import Learner
from edged.routing.router import local_reserve

logging.getLogger("edged.link").setLevel(logging.ERROR)  # thousands of simulated ups and downs
PROBE_INTERVAL = 0.2
PROBE_TIMEOUT = 0.25


@dataclass
class Situation:
    """What a policy sees for one request (all of it known before the request runs)."""

    request: RouteRequest
    local: Path
    cloud: Path
    facts: dict[str, float | None]
    trace_row: dict[str, Any]  # the request as the trace has it (hindsight: not for policies)
    now: float  # simulated time


Strategy = Callable[[Situation], Decision]


class Learning:
    """A strategy that also learns from what happened: ``observe`` gets, for each tier that
    ran, whether the request would have been in time there."""

    def __call__(self, s: Situation) -> Decision:
        raise NotImplementedError

    def observe(self, s: Situation, decision: Decision, in_time: dict[str, bool]) -> None:
        raise NotImplementedError


@dataclass
class Outcome:
    route: str  # what ran in the end: local, cloud, hedged, fallback
    latency_ms: float
    ok: bool  # within the deadline
    cloud_calls: int
    violation: bool


@dataclass
class Result:
    policy: str
    trace: str
    outcomes: list[Outcome] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)  # the decided route, per request

    @property
    def slo(self) -> float:
        return 100.0 * sum(o.ok for o in self.outcomes) / max(1, len(self.outcomes))

    @property
    def cloud_calls(self) -> int:
        return sum(o.cloud_calls for o in self.outcomes)

    @property
    def violations(self) -> int:
        return sum(o.violation for o in self.outcomes)

    def latency(self, q: float) -> float:
        return percentile(sorted(o.latency_ms for o in self.outcomes), q) or 0.0


class SimLink:
    """A cloud endpoint's link monitor and breaker, probed as the daemon probes (every 0.2 s, a
    failure retried at once, backoff while down) over the trace's ``rtt_key`` and
    ``outage_key`` timelines, on the replay's clock."""

    def __init__(
        self, trace: Trace, clock: Callable[[], float], rtt_key: str, outage_key: str, seed: int
    ) -> None:
        self.trace = trace
        self.keys = rtt_key, outage_key
        self.breaker = CircuitBreaker(clock=clock)
        self.link = LinkMonitor(
            "sim", self._never, interval=PROBE_INTERVAL, rng=random.Random(seed)
        )
        self.next_probe = 0.0
        self.down_attempt = 0

    @staticmethod
    async def _never() -> None:  # the replay feeds the monitor itself
        raise AssertionError

    def probe_until(self, t: float) -> None:
        """The link monitor's probes between the last request and ``t``."""
        link = self.link
        while self.next_probe <= t:
            env = self.trace.at(self.next_probe)
            timeout = link.probe_timeout()
            rtt = env[self.keys[0]] / 1000
            if env[self.keys[1]] or rtt > timeout:
                link.observe(None)
                if link.up or link.failures < link.down_after:
                    self.next_probe += timeout  # probe again at once, with a longer timeout
                else:
                    self.next_probe += timeout + link.backoff(self.down_attempt)
                    self.down_attempt += 1
            else:
                link.observe(rtt)
                self.down_attempt = 0
                self.next_probe += rtt + PROBE_INTERVAL

    def called(self, seconds: float | None, budget_s: float) -> float | None:
        """A call that took ``seconds`` (None: no answer), given ``budget_s``: what the breaker
        and the link learn (as CloudEndpoint.infer), and the time, or None if it failed."""
        if seconds is None or seconds > budget_s:
            # a timeout counts against the link and the endpoint only if it was longer than
            # a probe may take
            if self.link.silence_is_failure(budget_s):
                self.breaker.record(False)
                self.link.observe(None)
            else:
                self.breaker.record(True)
            return None
        self.breaker.record(True)
        return seconds


class Replay:
    """One policy over one trace, in simulated time."""

    def __init__(self, trace: Trace, strategy: Strategy, name: str) -> None:
        self.trace = trace
        self.strategy = strategy
        self.now = 0.0
        self.estimates = Estimates()
        self.cloud = SimLink(trace, lambda: self.now, "rtt_ms", "outage", seed=0)
        self.breaker, self.link = self.cloud.breaker, self.cloud.link
        self.result = Result(name, trace.name)

    def _forecast(self, row: dict[str, Any], tier: str, load: float | None) -> tuple[Any, ...]:
        """Path's why_not, predicted_s, cost, deviation_s for ``tier``."""
        found = self.estimates.forecast(
            row["task"], tier, load, row["payload"], self.link.rtt, self.link.bandwidth
        )
        return ("", None, 0.0, None) if found is None else ("", found[0], 0.0, found[1])

    def situation(self, row: dict[str, Any]) -> Situation:
        env = self.trace.at(row["t"])
        load = env["load"]
        request = RouteRequest(
            model=row["task"],
            task_type=row["task"],
            private=row["private"],
            deadline_s=row["deadline_ms"] / 1000,
            payload_bytes=row["payload"],
        )
        local = Path(True, *self._forecast(row, "local", load))
        if not self.link.up:
            cloud = Path(False, "link down")
        elif not self.breaker.would_allow():
            cloud = Path(False, "circuit open")
        else:
            cloud = Path(True, *self._forecast(row, "cloud", None))
        facts: dict[str, float | None] = {
            "local_load": load,
            "cpu": load,
            "rtt": self.link.rtt * 1000 if self.link.rtt is not None else None,
            "deadline": row["deadline_ms"],
            "payload": float(row["payload"]),
        }
        return Situation(request, local, cloud, facts, row, self.now)

    def run(self) -> Result:
        for row in self.trace.requests:
            self.cloud.probe_until(row["t"])
            self.now = row["t"]
            situation = self.situation(row)
            decision = self.strategy(situation)
            self.result.decisions.append(decision.route)
            in_time: dict[str, bool] = {}
            self.result.outcomes.append(self._execute(decision, row, in_time))
            if isinstance(self.strategy, Learning):
                self.strategy.observe(situation, decision, in_time)
        return self.result

    def _execute(
        self, decision: Decision, row: dict[str, Any], in_time: dict[str, bool]
    ) -> Outcome:
        local_ms, cloud_ms, deadline = row["local_ms"], row["cloud_ms"], row["deadline_ms"]
        load = self.trace.at(row["t"])["load"]
        route: str = decision.route
        calls = 0
        if route == "none":
            return Outcome("none", float("inf"), False, 0, False)

        def ran_local() -> None:
            self.estimates.observe(row["task"], "local", local_ms / 1000, load, row["payload"])
            in_time["local"] = local_ms <= deadline

        def ran_cloud(budget_ms: float) -> float | None:
            """The cloud's time, or None when it failed within ``budget_ms``."""
            nonlocal calls
            if budget_ms <= 0 or not self.breaker.allow():
                return None  # no call: no time left, or the circuit is open
            calls += 1
            in_time["cloud"] = cloud_ms is not None and cloud_ms <= deadline
            seconds = None if cloud_ms is None else cloud_ms / 1000
            if self.cloud.called(seconds, budget_ms / 1000) is None:
                return None
            self.estimates.observe(
                row["task"], "cloud", cloud_ms / 1000, None, row["payload"], self.link.rtt
            )
            return float(cloud_ms)

        if route == "local":
            latency = local_ms
            ran_local()
        elif route == "cloud":
            budget = deadline - local_reserve(decision) * 1000
            got = ran_cloud(budget)
            if got is not None:
                latency = got
            elif decision.fallback == "local":
                route, latency = "fallback", max(0.0, budget) + local_ms
                ran_local()
            else:
                latency = float("inf")
        else:  # hedged
            got = ran_cloud(deadline)
            latency = min(local_ms, got if got is not None else float("inf"))
            ran_local()
        violation = row["private"] and calls > 0
        return Outcome(route, latency, latency <= deadline, calls, violation)


# ---- policies -----------------------------------------------------------------------------------


def forced(route: Route) -> Strategy:
    """Always ``route`` where the hard constraints allow (privacy, availability)."""

    def strategy(s: Situation) -> Decision:
        request = dataclasses.replace(s.request, override=route)
        return decide(request, s.local, s.cloud, s.facts, Policy())

    return strategy


def static_rules() -> Strategy:
    """The brief's static rules: local_load < 80% -> local, else cloud; a local estimate over
    the local threshold (100 ms) -> cloud. No deadline, no estimates of the cloud."""
    busy = parse("local_load >= 80%")
    policy = Policy(hedging=False)

    def strategy(s: Situation) -> Decision:
        slow = s.local.predicted_s is not None and s.local.predicted_s > policy.local_threshold_s
        choice: Route = "cloud" if busy.holds(s.facts) or slow else "local"
        request = dataclasses.replace(s.request, override=choice)
        return decide(request, s.local, s.cloud, s.facts, policy)

    return strategy


def edged_default(policy: Policy | None = None) -> Strategy:
    """edged's ``decide()`` with its default settings (or ``policy``)."""
    chosen = policy or Policy()

    def strategy(s: Situation) -> Decision:
        return decide(s.request, s.local, s.cloud, s.facts, chosen)

    return strategy


def informed_outcome(row: dict[str, Any]) -> Outcome:
    """The informed reference: it knows what each path takes *typically* at that moment (the
    trace's medians), not this request's draw: local if its median meets the deadline, else the
    cloud if its median does, else local. No policy that cannot see the future does better on
    cloud calls at the same SLO; the gap to the oracle is what only hindsight buys."""
    deadline = row["deadline_ms"]
    cloud = row["cloud_median_ms"] if not row["private"] else None
    if row["local_median_ms"] <= deadline or cloud is None or cloud > deadline:
        return Outcome("local", row["local_ms"], row["local_ms"] <= deadline, 0, False)
    got = row["cloud_ms"]
    if got is None or got > deadline:  # its draw missed: a late answer (a fallback, at best)
        return Outcome("cloud", deadline + row["local_ms"], False, 1, False)
    return Outcome("cloud", got, True, 1, False)


def oracle_outcome(row: dict[str, Any]) -> Outcome:
    """The oracle: in hindsight, the route that meets the deadline at the least cost (local
    first); private stays local; when neither path meets it, local."""
    deadline = row["deadline_ms"]
    cloud = row["cloud_ms"] if not row["private"] else None
    if row["local_ms"] <= deadline or cloud is None or cloud > deadline:
        return Outcome("local", row["local_ms"], row["local_ms"] <= deadline, 0, False)
    return Outcome("cloud", cloud, True, 1, False)


class Learned(Learning):
    """edged's ``decide()`` refined by the learner (``routing.policy = "learned"``)."""

    def __init__(self, seed: int = 0) -> None:
        self.now = 0.0
        self.learner = Learner(seed=seed, clock=lambda: self.now)
        self.policy = Policy(hedging=False)

    def __call__(self, s: Situation) -> Decision:
        self.now = s.now
        decision = decide(s.request, s.local, s.cloud, s.facts, self.policy)
        return self.learner.refine(decision, s.request, s.local, s.cloud)

    def observe(self, s: Situation, decision: Decision, in_time: dict[str, bool]) -> None:
        if decision.basis == "learned":
            for tier, ok in in_time.items():
                path = s.local if tier == "local" else s.cloud
                self.learner.learn(s.request, tier, path, decision.deadline_s, ok)  # type: ignore[arg-type]


POLICIES: dict[str, Callable[[], Strategy]] = {
    "always-local": lambda: forced("local"),
    "always-cloud": lambda: forced("cloud"),
    "static rules": static_rules,
    "edged default": edged_default,
    "learned": Learned,
}


def run_reference(
    trace: Trace,
    name: str = "oracle",
    outcome: Callable[[dict[str, Any]], Outcome] = oracle_outcome,
) -> Result:
    result = Result(name, trace.name)
    for row in trace.requests:
        got = outcome(row)
        result.outcomes.append(got)
        result.decisions.append(got.route)
    return result


def run_all(
    trace: Trace, policies: dict[str, Callable[[], Strategy]] | None = None
) -> list[Result]:
    """The oracle first, then the informed reference, then each policy."""
    results = [run_reference(trace), run_reference(trace, "informed", informed_outcome)]
    for name, make in (POLICIES if policies is None else policies).items():
        results.append(Replay(trace, make(), name).run())
    return results


def adaptation(result: Result, best: Result, trace: Trace, window: int = 50) -> int | None:
    """Requests after the trace's regime change until the policy agrees with the oracle on at
    least 90% of the next ``window`` public requests (None: it never does)."""
    if trace.change_at_s is None:
        return None
    start = next(i for i, r in enumerate(trace.requests) if r["t"] >= trace.change_at_s)
    public = [i for i in range(start, len(trace.requests)) if not trace.requests[i]["private"]]
    for k in range(len(public) - window):
        span = public[k : k + window]
        agree = sum(result.decisions[i] == best.decisions[i] for i in span)
        if agree >= 0.9 * window:
            return k
    return None


def summary(results: list[Result], trace: Trace) -> list[dict[str, Any]]:
    best = results[0]
    rows = []
    for r in results:
        rows.append(
            {
                "trace": trace.name,
                "policy": r.policy,
                "slo_percent": round(r.slo, 2),
                "p50_ms": round(r.latency(0.5), 1),
                "p95_ms": round(r.latency(0.95), 1),
                "p99_ms": round(r.latency(0.99), 1),
                "cloud_calls": r.cloud_calls,
                "violations": r.violations,
                "regret_points": round(best.slo - r.slo, 2),
                "mean_ms": round(statistics.fmean(min(o.latency_ms, 1e5) for o in r.outcomes), 1),
                "adaptation": adaptation(r, best, trace),
            }
        )
    return rows
