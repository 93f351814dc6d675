#!/usr/bin/env python3
"""The routing lab with two cloud tiers: on-demand, and a cheaper spot tier that is interrupted.

The trace (``spot``, drawn with a fixed seed like the others): a device under varying load
(40-90%), both tiers on a LAN-like link (on-demand about 8 ms away, spot 12 ms), the spot tier
unreachable for 20-40 s about every 90 s (an interruption: its calls get no answer until the
link monitor takes it out), half the requests at a low priority (2: work that can wait), the
task mix and deadlines of the other traces. A call costs 1 on on-demand and 0.3 on spot (a
typical spot discount), paid when it is answered.

What runs is edged's own code, as in ``bench/lab/sim.py``: per tier a ``LinkMonitor`` and a
``CircuitBreaker`` probed over the trace; the tier's choice (``edged.routing.tiers``: work that
can wait to the cheapest tier that can take it, urgent work to the fastest); the path decision
(``decide()``, the cost model, with that tier as the cloud); and the router's failover: a tier
with another after it gets at most half the time left, the next tier the rest, then the local
fallback. Policies: the edged default with only on-demand configured, with only spot, and with
both; the oracle (in hindsight, the cheapest route that meets the deadline: local, spot,
on-demand).

    .venv/bin/python bench/lab/tiers.py        # prints the table (make bench-lab runs it too)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.lab.sim import SimLink  # noqa: E402
from bench.lab.traces import STEP, TASKS, Trace, arrivals, bursts, local_ms, random_walk  # noqa: E402
from edged.routing import tiers  # noqa: E402
from edged.routing.decide import Path as RoutePath  # noqa: E402
from edged.routing.decide import Policy, RouteRequest, decide  # noqa: E402
from edged.routing.estimates import Estimates  # noqa: E402
from edged.routing.router import local_reserve  # noqa: E402

COST = {"on-demand": 1.0, "spot": 0.3}
LOW_PRIORITY_SHARE = 0.5


def spot_trace(seed: int = 6, duration_s: float = 300.0, rate: float = 10.0) -> Trace:
    """The two-tier world and its requests (each with what both tiers would take)."""
    rng = np.random.default_rng(seed)
    n = int(duration_s / STEP)
    env = {
        "load": list(random_walk(rng, n, 40, 90, 1.5)),
        "throttled": [False] * n,
        "on-demand_rtt_ms": list(8 * rng.lognormal(0, 0.2, n)),
        "on-demand_outage": [False] * n,
        "spot_rtt_ms": list(12 * rng.lognormal(0, 0.2, n)),
        "spot_outage": list(bursts(rng, n, 90.0, (20.0, 40.0))),
    }
    bandwidth = 20e6
    requests = []
    for t, i, task, payload in arrivals(rng, n, duration_s, rate):
        base, service, _, deadlines, _ = TASKS[task]
        local = local_ms(base, env["load"][i], False, 1.0) * rng.lognormal(0, 0.15)
        row: dict[str, Any] = {
            "t": round(float(t), 4),
            "task": task,
            "payload": payload,
            "deadline_ms": float(rng.choice(deadlines)),
            "private": bool(rng.random() < 0.1),
            "priority": 2 if rng.random() < LOW_PRIORITY_SHARE else 0,
            "local_ms": round(float(local), 3),
        }
        for tier in COST:
            rtt = env[f"{tier}_rtt_ms"][i] * rng.lognormal(0, 0.1)
            took = rtt + service * rng.lognormal(0, 0.2) + payload / bandwidth * 1000
            row[f"{tier}_ms"] = None if env[f"{tier}_outage"][i] else round(float(took), 3)
        requests.append(row)
    plain = {
        k: [bool(v) if isinstance(v, (bool, np.bool_)) else round(float(v), 3) for v in vals]
        for k, vals in env.items()
    }
    return Trace(
        "spot", "two cloud tiers, spot interrupted", seed, duration_s, None, plain, requests
    )


@dataclass
class Tally:
    policy: str
    ok: int = 0
    requests: int = 0
    cost: float = 0.0
    calls: dict[str, int] | None = None
    violations: int = 0

    def row(self) -> list[str]:
        calls = self.calls or {}
        return [
            self.policy,
            f"{100 * self.ok / self.requests:.2f}",
            str(calls.get("on-demand", 0)),
            str(calls.get("spot", 0)),
            f"{1000 * self.cost / self.requests:.1f}",
            str(self.violations),
        ]


class TierReplay:
    """edged's default policy with the cloud tiers ``names`` configured, over ``trace``."""

    def __init__(self, trace: Trace, names: list[str]) -> None:
        self.trace = trace
        self.now = 0.0
        self.links = {
            name: SimLink(trace, lambda: self.now, f"{name}_rtt_ms", f"{name}_outage", seed=i)
            for i, name in enumerate(names)
        }
        self.estimates = Estimates()
        self.policy = Policy()
        self.tally = Tally(" + ".join(names), calls={name: 0 for name in names})

    def run(self) -> Tally:
        for row in self.trace.requests:
            for sim in self.links.values():
                sim.probe_until(row["t"])
            self.now = row["t"]
            latency = self.step(row)
            self.tally.requests += 1
            self.tally.ok += latency <= row["deadline_ms"]
        return self.tally

    def step(self, row: dict[str, Any]) -> float:
        """One request: decided and run as the router does; its latency (ms)."""
        load = self.trace.at(row["t"])["load"]
        deadline = row["deadline_ms"]
        request = RouteRequest(
            row["task"], row["task"], row["private"], deadline / 1000, row["payload"]
        )
        found = self.estimates.forecast(row["task"], "local", load, row["payload"])
        predicted, deviation = found or (None, None)
        local = RoutePath(True, "", predicted, 0.0, deviation)
        options = []
        for name, sim in self.links.items():
            if not sim.link.up or not sim.breaker.would_allow():
                continue
            got = self.estimates.forecast(row["task"], name, None, row["payload"], sim.link.rtt)
            predicted, deviation = got or (None, None)
            path = RoutePath(True, "", predicted, COST[name], deviation)
            seconds = predicted if predicted is not None else sim.link.rtt
            options.append(tiers.Option((name, path), COST[name], seconds))
        flexible = tiers.flexible(row["priority"], deadline / 1000)
        ranked = [o for o, _ in tiers.order(options, flexible, deadline / 1000)]
        ordered = [(o.tier[0], o.seconds) for o in ranked]
        cloud = ranked[0].tier[1] if ranked else RoutePath(False, "no tier can take it")
        decision = decide(request, local, cloud, {}, self.policy)
        if decision.route == "local":
            return self.local(row, load)
        if decision.route == "hedged":
            spent, got = self.cloud(row, ordered, 0.0)
            return min(self.local(row, load), got if got is not None else float("inf"))
        if decision.route == "cloud":
            spent, got = self.cloud(row, ordered, local_reserve(decision) * 1000)
            if got is not None:
                return got
            if decision.fallback == "local":
                return spent + self.local(row, load)
        return float("inf")

    def local(self, row: dict[str, Any], load: float) -> float:
        self.estimates.observe(row["task"], "local", row["local_ms"] / 1000, load, row["payload"])
        return float(row["local_ms"])

    def cloud(
        self, row: dict[str, Any], ordered: list[tuple[str, float | None]], reserve_ms: float
    ) -> tuple[float, float | None]:
        """The tiers in order, as the router tries them: (the time spent on those that failed,
        the time of the answer or None)."""
        spent, deadline = 0.0, row["deadline_ms"]
        for k, (name, expected) in enumerate(ordered):
            left = deadline - spent
            budget = left - reserve_ms
            if k + 1 < len(ordered):
                after = ordered[k + 1][1]
                budget = 1000 * tiers.budget(left / 1000, reserve_ms / 1000, expected, after)
            sim = self.links[name]
            if budget <= 0 or not sim.breaker.allow():
                continue
            took = row[f"{name}_ms"]
            if sim.called(None if took is None else took / 1000, budget / 1000) is None:
                spent += budget
                continue
            rtt = sim.link.rtt
            self.estimates.observe(row["task"], name, took / 1000, None, row["payload"], rtt)
            self.tally.cost += COST[name]
            assert self.tally.calls is not None
            self.tally.calls[name] += 1
            if row["private"]:
                self.tally.violations += 1
            return spent, spent + took
        return spent, None


def oracle(trace: Trace) -> Tally:
    """In hindsight, per request: local if it meets the deadline, else the cheapest tier that
    does (spot, then on-demand), else local."""
    tally = Tally("oracle", calls={name: 0 for name in COST})
    for row in trace.requests:
        deadline = row["deadline_ms"]
        tally.requests += 1
        if row["local_ms"] <= deadline or row["private"]:
            tally.ok += row["local_ms"] <= deadline
            continue
        for name in sorted(COST, key=COST.__getitem__):
            took = row[f"{name}_ms"]
            if took is not None and took <= deadline:
                tally.ok += 1
                tally.cost += COST[name]
                assert tally.calls is not None
                tally.calls[name] += 1
                break
    return tally


def table(trace: Trace) -> list[Tally]:
    configured = (["on-demand"], ["spot"], ["spot", "on-demand"])
    return [oracle(trace), *(TierReplay(trace, names).run() for names in configured)]


def main() -> None:
    trace = spot_trace()
    header = [
        "policy (tiers configured)",
        "SLO %",
        "on-demand calls",
        "spot calls",
        "cost / 1,000 requests",
        "privacy violations",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    results = table(trace)
    for tally in results:
        print("| " + " | ".join(tally.row()) + " |")
    both, alone = results[3], results[1]
    saved = 1 - both.cost / alone.cost
    lost = 100 * (alone.ok - both.ok) / alone.requests
    print(
        f"\nspot + on-demand against on-demand only: cost {saved:.0%} lower, SLO {lost:+.2f}"
        " points lost"
    )


if __name__ == "__main__":
    main()
