"""Canary rollouts (cloudsync.fleet.gates): which nodes a stage takes, and the gates on live
figures."""

from __future__ import annotations

from typing import Any

import pytest

from cloudsync.fleet.cli import NO_SERVICE_ROLLOUT, main
from cloudsync.fleet.gates import Gates, breached, pick

NODES = [f"n{i}" for i in range(1, 21)]


def test_stages_take_a_stable_share_and_grow_without_reshuffling() -> None:
    first = pick(NODES, "r1", 0.1)
    assert len(first) == 2 and first == pick(list(reversed(NODES)), "r1", 0.1)
    assert pick(NODES, "r1", 0.5)[:2] == first  # a later stage keeps the earlier nodes
    assert len(pick(NODES, "r1", 1.0)) == 20
    assert pick(NODES, "r2", 0.1) != first or pick(NODES, "r3", 0.1) != first  # per rollout
    assert len(pick(NODES[:3], "r1", 0.1)) == 1  # at least one


def figures(
    requests: int, failure: float, p95: float | None, fallback: float, sure: float | None = None
) -> dict[str, Any]:
    return {
        "requests": requests,
        "failure_rate": failure,
        "p95_ms": p95,
        "fallback_rate": fallback,
        "confidence": sure,
    }


def test_each_gate_compares_with_the_other_nodes() -> None:
    gates = Gates(max_failure=0.05, max_p95_increase=1.0, max_fallback=0.1, min_requests=20)
    calm = figures(1000, 0.01, 10.0, 0.0, 0.9)
    assert breached(gates, figures(100, 0.05, 12.0, 0.05), calm) == ""
    assert "failure rate 7.0%" in breached(gates, figures(100, 0.07, 12.0, 0.0), calm)
    assert "p95 25.0 ms against 10.0 ms" in breached(gates, figures(100, 0.0, 25.0, 0.0), calm)
    assert "fallback rate 20.0%" in breached(gates, figures(100, 0.0, 10.0, 0.2), calm)
    assert breached(gates, figures(10, 1.0, 99.0, 1.0), calm) == ""  # too few calls yet
    assert "mean confidence 0.700 against 0.900" in breached(
        gates, figures(100, 0.0, 10.0, 0.0, 0.7), calm
    )
    assert breached(gates, figures(100, 0.0, 10.0, 0.0, 0.85), calm) == ""


def test_a_gate_holds_at_its_bound_and_judges_from_the_least_number_of_calls() -> None:
    """Each gate is "worse than the others by more than": exactly at the bound is no breach;
    a canary is judged from exactly min_requests calls. (Values exact in binary.)"""
    gates = Gates(
        max_failure=0.25,
        max_p95_increase=1.0,
        max_fallback=0.25,
        max_confidence_drop=0.25,
        min_requests=20,
    )
    others = figures(1000, 0.25, 10.0, 0.25, 0.75)
    assert breached(gates, figures(20, 0.5, 20.0, 0.5, 0.5), others) == ""  # all at the bound
    assert breached(gates, figures(20, 0.625, 20.0, 0.5, 0.5), others) == (
        "failure rate 62.5% against 25.0% on the other nodes (more than 25.0% worse)"
    )  # from the 20th call on
    assert breached(gates, figures(19, 1.0, 99.0, 1.0, 0.0), others) == ""  # one call short
    assert breached(gates, figures(20, 0.5, 20.5, 0.5, 0.5), others) == (
        "p95 20.5 ms against 10.0 ms on the other nodes"
    )
    assert breached(gates, figures(20, 0.5, 20.0, 0.5, 0.375), others) == (
        "mean confidence 0.375 against 0.750 on the other nodes"
    )
    assert breached(gates, figures(20, 0.5, 20.0, 0.625, 0.5), others) == (
        "fallback rate 62.5% against 25.0%"
    )


def test_edgefleet_runs_no_rollout_without_the_service(capsys: pytest.CaptureFixture[str]) -> None:
    """The shell's rollout engine is gone (issue 45: two engines one letter apart): without
    --service each action is a usage error that says where rollouts run, before connecting."""
    for action in ("create", "status", "promote", "abort"):
        assert main(["rollout", action, "r1", "--manifest", "m.json"]) == 2
        assert NO_SERVICE_ROLLOUT in capsys.readouterr().err
