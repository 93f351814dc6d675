"""edged's metrics as fleet telemetry (cloudsync.protocol.telemetry), read from the text that
edged's own Prometheus registry (edged.metrics.Metrics) renders."""

from __future__ import annotations

import numpy as np
import pytest

from cloudsync.protocol.telemetry import LATENCY, Snapshot, parse, telemetry
from edged.common.errors import DeadlineExceeded, Unavailable
from edged.common.stats import quantile
from edged.metrics import Metrics


def served(
    metrics: Metrics, model: str, seconds: list[float], error: Exception | None = None
) -> None:
    for s in seconds:
        metrics.finished(model, 1, s, error)


def snapshot(metrics: Metrics, at: float, epoch: str = "e1") -> Snapshot:
    return parse(metrics.render().decode(), at, epoch)


def test_an_interval_counts_what_happened_in_it_per_model_version() -> None:
    metrics = Metrics()
    served(metrics, "intent", [0.004] * 10)
    metrics.route("intent", "local", "estimate")
    first = snapshot(metrics, 100.0)
    rng = np.random.default_rng(1)
    latencies = list(rng.uniform(0.011, 0.024, 95)) + [0.3] * 5  # 5 slow ones
    served(metrics, "intent", latencies)
    served(metrics, "intent", [0.5] * 3, DeadlineExceeded("late"))
    served(metrics, "intent", [0.001] * 2, Unavailable("no"))
    for route in ["local"] * 90 + ["cloud"] * 8 + ["fallback"] * 2:
        metrics.route("intent", route, "estimate")
    second = snapshot(metrics, 160.0)

    body = telemetry(second, first)
    assert body is not None
    doc = body["metrics"]
    assert doc["interval_s"] == 60.0 and doc["edged_epoch"] == "e1"
    (row,) = doc["models"]
    assert row["model"] == "intent" and row["version"] == "1"
    assert row["requests"] == 105 and row["errors"] == 5
    assert row["outcomes"] == {"success": 100, "timeout": 3, "unavailable": 2}
    # 95 of 105 within (10, 25] ms: the median is inside that bucket; p99 among the slow ones
    assert 10 < row["p50_ms"] <= 25
    assert 250 <= row["p99_ms"] <= 500
    assert row["mean_ms"] == pytest.approx(1000 * (sum(latencies) + 1.5 + 0.002) / 105, abs=1e-3)
    # the interval's histogram, as edged's buckets (cumulative, by le): the fleet's series
    assert row["buckets"] == {
        "0.0005": 0,
        "0.001": 2,
        "0.0025": 2,
        "0.005": 2,
        "0.01": 2,
        "0.025": 97,
        "0.05": 97,
        "0.1": 97,
        "0.25": 97,
        "0.5": 105,
        "1.0": 105,
        "2.5": 105,
        "5.0": 105,
        "10.0": 105,
        "+Inf": 105,
    }
    assert row["seconds"] == pytest.approx(sum(latencies) + 1.5 + 0.002, abs=1e-5)
    assert doc["routes"] == {"intent": {"local": 90, "cloud": 8, "fallback": 2}}
    assert second.route_totals() == {"cloud": 8, "fallback": 2, "local": 91}
    assert doc["cloud_ab"] == {}


def test_an_ab_tests_calls_per_arm_and_the_good_ones() -> None:
    metrics = Metrics()
    metrics.ab_call("intent", "intent-v2", True)
    first = snapshot(metrics, 100.0)
    for arm, good in [("intent", True)] * 5 + [("intent", False)] + [("intent-v2", False)] * 2:
        metrics.ab_call("intent", arm, good)
    body = telemetry(snapshot(metrics, 160.0), Snapshot.from_state(first.to_state()))
    assert body is not None
    assert body["metrics"]["cloud_ab"] == {
        "intent": {"intent": {"calls": 6, "good": 5}, "intent-v2": {"calls": 2, "good": 0}}
    }


def test_nothing_new_gives_no_record_and_the_first_read_counts_from_edgeds_start() -> None:
    metrics = Metrics()
    served(metrics, "ocr", [0.2] * 4)
    first = snapshot(metrics, 10.0)
    assert telemetry(snapshot(metrics, 20.0), first) is None
    since_start = telemetry(first, None)
    assert since_start is not None and since_start["metrics"]["interval_s"] is None
    assert since_start["metrics"]["models"][0]["requests"] == 4


def test_a_new_edged_counts_from_zero_even_when_its_counters_passed_the_old_ones() -> None:
    old, new = Metrics(), Metrics()
    served(old, "ocr", [0.2] * 4)
    served(new, "ocr", [0.2] * 9)  # the new run already served more than the old one had
    body = telemetry(snapshot(new, 50.0, "e2"), snapshot(old, 40.0, "e1"))
    assert body is not None and body["metrics"]["models"][0]["requests"] == 9
    assert body["metrics"]["interval_s"] is None
    # a counter lower than before within the same epoch: a reset too
    lower = telemetry(snapshot(old, 60.0, "e1"), snapshot(new, 50.0, "e1"))
    assert lower is not None and lower["metrics"]["models"][0]["requests"] == 4


def test_the_read_behind_a_record_survives_a_round_trip_through_the_outbox_state() -> None:
    metrics = Metrics()
    served(metrics, "intent", [0.003, 0.02, 7.0])
    metrics.route("intent", "hedged", "estimate")
    snap = snapshot(metrics, 1234.5, "epoch-x")
    again = Snapshot.from_state(snap.to_state())
    assert again == snap
    assert Snapshot.from_state(None) is None
    assert telemetry(snapshot(metrics, 1300.0, "epoch-x"), again) is None


def test_quantiles_interpolate_within_buckets_like_histogram_quantile() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.15)
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.99, {0.1: 1.0, float("inf"): 10.0}) == 0.1  # in +Inf: the top bound
    assert LATENCY == "edged_inference_request_duration_seconds"


def test_cloud_calls_are_counted_per_arm_of_an_ab_split() -> None:
    metrics = Metrics()
    first = snapshot(metrics, 0.0)
    for _ in range(7):
        metrics.cloud_call("intent", "intent-v1", 0.010, True, "cloud", 1.0)
    for _ in range(3):
        metrics.cloud_call("intent", "intent-v2", 0.020, True, "cloud", 1.0)
    metrics.cloud_call("intent", "intent-v2", 0.5, False, "cloud", 0.0)
    body = telemetry(snapshot(metrics, 10.0), first)
    assert body is not None
    arms = body["metrics"]["cloud"]["intent"]
    assert arms["intent-v1"] == {
        "requests": 7,
        "errors": 0,
        "mean_ms": 10.0,
        "outcomes": {"success": 7},
    }
    assert arms["intent-v2"]["requests"] == 4 and arms["intent-v2"]["errors"] == 1
    assert arms["intent-v2"]["outcomes"] == {"success": 3, "error": 1}
    assert arms["intent-v2"]["mean_ms"] == pytest.approx(1000 * (0.06 + 0.5) / 4, abs=1e-3)
    assert Snapshot.from_state(snapshot(metrics, 10.0).to_state()) == snapshot(metrics, 10.0)


def test_a_classifiers_mean_confidence_per_interval() -> None:
    metrics = Metrics()
    first = snapshot(metrics, 0.0)
    for value in (0.9, 0.8, 0.7):
        metrics.finished("intent", 1, 0.01, None)
        metrics.confidence("intent", 1, value)
    body = telemetry(snapshot(metrics, 5.0), first)
    assert body is not None
    (row,) = body["metrics"]["models"]
    assert row["confidence_mean"] == pytest.approx(0.8) and row["confidence_n"] == 3
