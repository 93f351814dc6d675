"""edged's Prometheus metrics (``GET /metrics`` on its socket) as fleet telemetry.

The agent reads them every heartbeat interval. The heartbeat carries the routing decisions
counted since edged started (by route); every ``telemetry.interval_s`` a ``telemetry`` record
says what happened since the previous one, per model version: requests, outcomes, errors,
latency percentiles (estimated from the histogram's buckets as Prometheus' histogram_quantile
does), and per model the routes taken. These are what a rollout's health gates read (error rate,
p95 latency, fallback rate). The last read behind a record is kept in the outbox in the same
transaction as the record, so across restarts of cloudsync nothing is counted twice or lost;
a new edged (another epoch, or a counter lower than before) counts from zero, as Prometheus'
rate() does.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from edged.common.stats import quantile

REQUESTS = "edged_inference_requests"
LATENCY = "edged_inference_request_duration_seconds"
ROUTES = "edged_route_decisions"
CONFIDENCE = "edged_inference_confidence"
CLOUD = "edged_cloud_requests"
CLOUD_LATENCY = "edged_cloud_request_duration_seconds"
AB = "edged_cloud_ab_calls"
LOCAL_LOAD = "edged_local_load_ratio"
ERROR_OUTCOMES = ("error", "timeout", "unavailable")  # the caller got no answer, not its fault
FAILED_OUTCOMES = (*ERROR_OUTCOMES, "invalid")  # and the input refused: a version's health

Key = tuple[str, ...]


@dataclass
class Snapshot:
    """Cumulative counters of one read of /metrics."""

    at: float  # time.time() of the read
    epoch: str = ""  # edged's run
    requests: dict[Key, float] = field(default_factory=dict)  # (model, version, outcome)
    buckets: dict[Key, dict[float, float]] = field(default_factory=dict)  # (model, version)
    latency_sum: dict[Key, float] = field(default_factory=dict)
    routes: dict[Key, float] = field(default_factory=dict)  # (model, route, reason)
    confidence: dict[Key, tuple[float, float]] = field(default_factory=dict)  # version: sum, n
    cloud: dict[Key, float] = field(default_factory=dict)  # (model, cloud_model, outcome)
    cloud_sum: dict[Key, float] = field(default_factory=dict)  # (model, cloud_model): seconds
    ab: dict[Key, float] = field(default_factory=dict)  # (model, cloud_model, good)
    local_load: float | None = None  # the load routing weighs, 0-1 (for the alerts)

    def route_totals(self) -> dict[str, int]:
        """Routing decisions since edged started, by route (the heartbeat's)."""
        totals: dict[str, int] = defaultdict(int)
        for (_, route, _), value in self.routes.items():
            totals[route] += int(value)
        return dict(sorted(totals.items()))

    def to_state(self) -> str:
        """As text for the outbox's state (tuple keys as lists, +Inf as text)."""
        return json.dumps(
            {
                "at": self.at,
                "epoch": self.epoch,
                "requests": [[*k, v] for k, v in self.requests.items()],
                "buckets": [
                    [*k, [[str(le), n] for le, n in b.items()]] for k, b in self.buckets.items()
                ],
                "latency_sum": [[*k, v] for k, v in self.latency_sum.items()],
                "routes": [[*k, v] for k, v in self.routes.items()],
                "confidence": [[*k, *v] for k, v in self.confidence.items()],
                "cloud": [[*k, v] for k, v in self.cloud.items()],
                "cloud_sum": [[*k, v] for k, v in self.cloud_sum.items()],
                "ab": [[*k, v] for k, v in self.ab.items()],
            }
        )

    @classmethod
    def from_state(cls, text: str | None) -> Snapshot | None:
        if not text:
            return None
        doc = json.loads(text)
        return cls(
            doc["at"],
            doc["epoch"],
            {tuple(r[:-1]): r[-1] for r in doc["requests"]},
            {tuple(r[:-1]): {float(le): n for le, n in r[-1]} for r in doc["buckets"]},
            {tuple(r[:-1]): r[-1] for r in doc["latency_sum"]},
            {tuple(r[:-1]): r[-1] for r in doc["routes"]},
            {tuple(r[:-2]): (r[-2], r[-1]) for r in doc.get("confidence", [])},
            {tuple(r[:-1]): r[-1] for r in doc.get("cloud", [])},
            {tuple(r[:-1]): r[-1] for r in doc.get("cloud_sum", [])},
            ab={tuple(r[:-1]): r[-1] for r in doc.get("ab", [])},
        )


def parse(text: str, at: float, epoch: str = "") -> Snapshot:
    """The metrics edged's telemetry uses, from Prometheus' text format."""
    snap = Snapshot(at, epoch)
    for family in text_string_to_metric_families(text):
        if family.name == LOCAL_LOAD:
            snap.local_load = next((sample.value for sample in family.samples), None)
        if family.name not in (REQUESTS, LATENCY, ROUTES, CONFIDENCE, CLOUD, CLOUD_LATENCY, AB):
            continue
        for sample in family.samples:
            labels = sample.labels
            if sample.name == f"{REQUESTS}_total":
                key = (labels["model"], labels["version"], labels["outcome"])
                snap.requests[key] = sample.value
            elif sample.name == f"{LATENCY}_bucket":
                version = (labels["model"], labels["version"])
                snap.buckets.setdefault(version, {})[float(labels["le"])] = sample.value
            elif sample.name == f"{LATENCY}_sum":
                snap.latency_sum[(labels["model"], labels["version"])] = sample.value
            elif sample.name == f"{ROUTES}_total":
                key = (labels["model"], labels["route"], labels["reason"])
                snap.routes[key] = sample.value
            elif sample.name in (f"{CONFIDENCE}_sum", f"{CONFIDENCE}_count"):
                version = (labels["model"], labels["version"])
                total, count = snap.confidence.get(version, (0.0, 0.0))
                if sample.name.endswith("_sum"):
                    snap.confidence[version] = (sample.value, count)
                else:
                    snap.confidence[version] = (total, sample.value)
            elif sample.name == f"{CLOUD}_total":
                key = (labels["model"], labels["cloud_model"], labels["outcome"])
                snap.cloud[key] = sample.value
            elif sample.name == f"{CLOUD_LATENCY}_sum":
                snap.cloud_sum[(labels["model"], labels["cloud_model"])] = sample.value
            elif sample.name == f"{AB}_total":
                snap.ab[(labels["model"], labels["cloud_model"], labels["good"])] = sample.value
    return snap


def _delta(now: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    """What each counter counted since ``before``; a counter that went down restarted."""
    out = {}
    for key, value in now.items():
        previous = before.get(key, 0.0)
        out[key] = value - previous if value >= previous else value
    return out


def telemetry(now: Snapshot, before: Snapshot | None) -> dict[str, Any] | None:
    """What happened between two reads, as a telemetry record's body (None: nothing did)."""
    restarted = before is not None and (
        before.epoch != now.epoch
        or any(v < before.requests.get(k, 0.0) for k, v in now.requests.items())
        or any(v < before.routes.get(k, 0.0) for k, v in now.routes.items())
    )
    base = before if before is not None and not restarted else Snapshot(now.at)
    requests = _delta(now.requests, base.requests)
    per_version: dict[Key, dict[str, int]] = defaultdict(dict)
    for (model, version, outcome), value in requests.items():
        if value:
            per_version[(model, version)][outcome] = int(value)
    seconds_by_version = _delta(now.latency_sum, base.latency_sum)
    models = []
    for (model, version), outcomes in sorted(per_version.items()):
        count = sum(outcomes.values())
        buckets = _delta(
            now.buckets.get((model, version), {}), base.buckets.get((model, version), {})
        )
        seconds = seconds_by_version.get((model, version), 0.0)
        row: dict[str, Any] = {
            "model": model,
            "version": version,
            "requests": count,
            "errors": sum(outcomes.get(o, 0) for o in ERROR_OUTCOMES),
            "outcomes": outcomes,
            "mean_ms": round(1000 * seconds / count, 3),
            # the latency histogram's buckets in the interval (cumulative, by upper bound, as
            # Prometheus' le) and its sum: the fleet service's series are made from them
            "buckets": {le_text(le): int(n) for le, n in sorted(buckets.items())},
            "seconds": round(seconds, 6),
        }
        total, scored = now.confidence.get((model, version), (0.0, 0.0))
        was_total, was_scored = base.confidence.get((model, version), (0.0, 0.0))
        if scored > was_scored:  # a classifier: its mean confidence in the interval
            row["confidence_mean"] = round((total - was_total) / (scored - was_scored), 4)
            row["confidence_n"] = int(scored - was_scored)
        for q in (0.5, 0.95, 0.99):
            found = quantile(q, buckets)
            row[f"p{round(q * 100)}_ms"] = None if found is None else round(1000 * found, 3)
        models.append(row)
    routes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (model, route, _), value in _delta(now.routes, base.routes).items():
        if value:
            routes[model][route] += int(value)
    cloud: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    cloud_seconds = _delta(now.cloud_sum, base.cloud_sum)
    for (model, arm, outcome), value in _delta(now.cloud, base.cloud).items():
        if value:
            row = cloud[model].setdefault(arm, {"requests": 0, "errors": 0, "outcomes": {}})
            row["requests"] += int(value)
            row["errors"] += int(value) if outcome == "error" else 0
            row["outcomes"][outcome] = int(value)
    for model, arms in cloud.items():
        for arm, row in arms.items():
            row["mean_ms"] = round(1000 * cloud_seconds.get((model, arm), 0.0) / row["requests"], 3)
    ab: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for (model, arm, good), value in _delta(now.ab, base.ab).items():
        if value:
            row = ab[model].setdefault(arm, {"calls": 0, "good": 0})
            row["calls"] += int(value)
            row["good"] += int(value) if good == "true" else 0
    if not models and not routes and not cloud and not ab:
        return None
    return {
        "metrics": {
            # None: since edged started (a new edged, or the first read)
            "interval_s": round(now.at - base.at, 3) if base is before else None,
            "edged_epoch": now.epoch,
            "models": models,
            "routes": {m: dict(r) for m, r in sorted(routes.items())},
            "cloud": dict(sorted(cloud.items())),  # per model, per version called (A/B arms)
            # an A/B test's calls per arm, and those its rule calls good (the fleet's A/B)
            "cloud_ab": dict(sorted(ab.items())),
        }
    }


def le_text(le: float) -> str:
    """A bucket's upper bound as Prometheus writes ``le`` (``0.005``, ``1.0``, ``+Inf``)."""
    return floatToGoString(le)


def row_of(body: dict[str, Any] | None, model: str, version: int) -> dict[str, Any] | None:
    """One model version's figures in a telemetry body (None: it served nothing)."""
    for row in (body or {}).get("metrics", {}).get("models", []):
        if row["model"] == model and row["version"] == str(version):
            return dict(row)
    return None


def failure_rate(row: dict[str, Any]) -> float:
    """The share of a version's calls that failed or whose input it refused."""
    failed = sum(row["outcomes"].get(o, 0) for o in FAILED_OUTCOMES)
    return failed / row["requests"] if row["requests"] else 0.0
