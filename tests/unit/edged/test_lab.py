"""The routing lab at a small scale: it runs, no policy leaks a private input, and no policy
beats the hindsight oracle on any request (which would mean a bug in the lab)."""

from __future__ import annotations

import pytest

from bench.lab.sim import POLICIES, Replay, edged_default, run_all, summary
from bench.lab.tiers import spot_trace
from bench.lab.tiers import table as tiers_table
from bench.lab.traces import TRACES, Trace, generate


@pytest.fixture(scope="module", params=sorted(TRACES))
def trace(request: pytest.FixtureRequest) -> Trace:
    return generate(request.param, seed=7, duration_s=40.0, rate=10.0)


def test_every_policy_runs_leaks_nothing_and_never_beats_the_oracle(trace: Trace) -> None:
    results = run_all(trace)
    oracle = results[0]
    assert oracle.policy == "oracle" and len(results) == 2 + len(POLICIES)
    for result in results:
        assert len(result.outcomes) == len(trace.requests) > 100
        assert result.violations == 0, f"{result.policy} sent a private input to the cloud"
        for i, (mine, best) in enumerate(zip(result.outcomes, oracle.outcomes)):
            assert best.ok or not mine.ok, f"{result.policy} beat the oracle on request {i}"
        assert result.slo <= oracle.slo
    rows = summary(results, trace)
    assert [r["policy"] for r in rows] == ["oracle", "informed", *POLICIES]
    assert all(r["regret_points"] >= 0 for r in rows)


def test_the_replay_is_deterministic(trace: Trace) -> None:
    first = Replay(trace, edged_default(), "a").run()
    second = Replay(trace, edged_default(), "b").run()
    assert first.decisions == second.decisions
    assert [o.latency_ms for o in first.outcomes] == [o.latency_ms for o in second.outcomes]


def test_traces_are_what_they_say() -> None:
    cellular = generate("cellular", seed=3, duration_s=120.0)
    assert any(r["cloud_ms"] is None for r in cellular.requests)  # outages
    busy = generate("busy-device", seed=3, duration_s=120.0)
    assert max(busy.env["load"]) > 90 and any(busy.env["throttled"])
    degrading = generate("degrading", seed=3, duration_s=60.0)
    assert degrading.change_at_s == 30.0
    before = [r for r in degrading.env["rtt_ms"][:300]]
    after = [r for r in degrading.env["rtt_ms"][300:]]
    assert max(before) < 20 < 150 < min(after)
    private = sum(r["private"] for r in cellular.requests) / len(cellular.requests)
    assert 0.05 < private < 0.15


def test_the_spot_lab_runs_leaks_nothing_and_spot_costs_less() -> None:
    """bench/lab/tiers.py at a small scale: two cloud tiers, spot interrupted; no private input
    reaches a tier, no policy beats the hindsight oracle's SLO, the tiers' failover keeps the
    SLO within 2 points of on-demand alone at a lower cost, and spot alone loses more."""
    trace = spot_trace(seed=3, duration_s=120.0)
    assert any(trace.env["spot_outage"]) and not any(trace.env["on-demand_outage"])
    oracle, on_demand, spot, both = tiers_table(trace)
    assert both.calls is not None and min(both.calls.values()) > 0
    for tally in (oracle, on_demand, spot, both):
        assert tally.requests == len(trace.requests) and tally.violations == 0
        assert tally.ok <= oracle.ok
    assert both.cost < on_demand.cost and on_demand.ok - both.ok <= 0.02 * both.requests
    assert spot.ok < both.ok
