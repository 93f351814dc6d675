"""Prometheus metrics (prometheus_client), in base units with Prometheus' names.

One registry per daemon (not the library's global one), served at ``GET /metrics`` on the
socket and, when ``metrics.port`` is set, on a loopback TCP port. Labels are bounded: model and
version names come from the repository, never from what a client asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from edged.common.errors import EdgedError
from edged.common.gauges import cloud_families, device_families, gauge, tier_families
from edged.common.load import LoadSnapshot
from edged.common.stats import LATENCY_BUCKETS
from edged.scheduler import Observer, Scheduler

log = logging.getLogger(__name__)
T = TypeVar("T")
disable_created_metrics()  # no *_created series: they double the series of every counter

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def outcome_of(error: BaseException | None) -> str:
    """The ``outcome`` label of a finished request."""
    if error is None:
        return "success"
    status = error.status if isinstance(error, EdgedError) else 500
    return {429: "rejected", 503: "unavailable", 504: "timeout"}.get(
        status, "invalid" if 400 <= status < 500 else "error"
    )


class StateCollector(Collector):
    """Figures read when Prometheus scrapes, from the parts that hold them: the device's load,
    the cloud tier (link, breaker) and the model versions. A figure that no provider can tell
    has no sample (absent, not 0)."""

    def __init__(
        self,
        load: Callable[[], LoadSnapshot] = LoadSnapshot,
        cloud: Callable[[], dict[str, Any] | None] = lambda: None,
        models: Callable[[], list[dict[str, Any]]] = list,
        tiers: Callable[[], list[dict[str, Any]]] = list,
        runtimes: Callable[[], list[tuple[str, int, dict[str, Any]]]] = list,
    ) -> None:
        """The sources, read at each scrape: ``runtimes`` gives (model, version, runtime
        metadata) of the loaded tensor-model versions."""
        self.load = load
        self.cloud = cloud
        self.tiers = tiers
        self.models = models
        self.runtimes = runtimes
        self.failed: set[str] = set()

    def _read(self, what: str, source: Callable[[], T], default: T) -> T:
        """A source's answer; one that fails costs its own figures, not the scrape (logged
        once a source)."""
        try:
            return source()
        except Exception as exc:
            if what not in self.failed:
                self.failed.add(what)
                log.warning("metrics: cannot read the %s: %s: %s", what, type(exc).__name__, exc)
            return default

    def collect(self) -> Iterator[Metric]:
        yield from device_families(self._read("load", self.load, LoadSnapshot()))
        yield from cloud_families(self._read("cloud state", self.cloud, None))
        yield from tier_families(self._read("cloud tiers", self.tiers, []))
        info = InfoMetricFamily(
            "edged_model_version",
            "Every model version of the repository (1), with its state (READY, LOADING,"
            " UNAVAILABLE, UNLOADING) and whether it is idle-unloaded",
            labels=["model", "version", "state", "idle"],
        )
        rows: list[dict[str, Any]] = self._read("model index", self.models, [])
        for row in rows:
            if "version" in row:
                info.add_metric(
                    [],
                    {
                        "model": row["name"],
                        "version": row["version"],
                        "state": row["state"],
                        "idle": "true" if row.get("idle") else "false",
                    },
                )
        yield info
        runtimes: list[tuple[str, int, dict[str, Any]]] = self._read("runtimes", self.runtimes, [])
        providers = InfoMetricFamily(
            "edged_model_runtime",
            "Each loaded tensor-model version's runtime (1): the execution providers in use,"
            " TensorRT's precision, and whether it fell back from a GPU provider (the start-up"
            " self-test)",
            labels=["model", "version", "providers", "precision", "fallback"],
        )
        for model, version, meta in runtimes:
            labels = {
                "model": model,
                "version": str(version),
                "providers": ",".join(meta.get("providers") or []),
                "precision": meta.get("precision") or "",
                "fallback": "true" if meta.get("fallback") else "false",
            }
            providers.add_metric([], labels)
        yield providers
        workers = [m.get("rss_bytes") or 0 for _, _, m in runtimes if m.get("isolation")]
        yield gauge(
            "edged_worker_resident_memory_bytes",
            "Resident memory of the runtime worker processes (models isolated in a process)",
            sum(workers) if workers else None,
        )


class Metrics:
    """Every metric edged exports."""

    def __init__(self, state: StateCollector | None = None) -> None:
        """``state``: the figures read at scrape time, from their sources (none by default)."""
        self.registry = CollectorRegistry()
        r, model = self.registry, ["model", "version"]
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.state = state or StateCollector()
        r.register(self.state)
        self.requests = Counter(
            "edged_inference_requests",
            "Inference requests by model, version and outcome (success, invalid, rejected,"
            " timeout, unavailable, error, cancelled); pipeline steps count as requests",
            [*model, "outcome"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "edged_inference_request_duration_seconds",
            "Time from a model call to its answer: queue plus compute (plus steps for pipelines)",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "edged_inference_queue_duration_seconds",
            "Time a request waited in the scheduler's queue before its execution started",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "edged_inference_compute_duration_seconds",
            "Time of one execution of the model (one batch)",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "edged_inference_batch_size",
            "Rows per execution (dynamic batching merges requests)",
            model,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.outcome_seconds = Counter(
            "edged_inference_request_outcome_seconds",
            "Time of model calls summed by outcome (Triton's statistics: success and fail"
            " durations)",
            [*model, "outcome"],
            registry=r,
        )
        self.last_call = Gauge(
            "edged_inference_last_timestamp_seconds",
            "When a model version's last call ended (Unix time)",
            model,
            registry=r,
        )
        # Triton's batch_stats: executions and their time by exact batch size, per version
        # (kept here, not exported: up to max_batch_size series a version would be too many)
        self.batches: dict[tuple[str, str], dict[int, list[float]]] = {}
        self.executions = Counter(
            "edged_inference_executions",
            "Executions of the model (fewer than requests when batching)",
            model,
            registry=r,
        )
        self.queue_depth = Gauge(
            "edged_inference_queue_depth", "Requests waiting in the queue", model, registry=r
        )
        self.inflight = Gauge(
            "edged_requests_in_flight", "API requests being answered (REST and gRPC)", registry=r
        )
        self.routes = Counter(
            "edged_route_decisions",
            "Model calls by where they ran (local, cloud, hedged, escalated, fallback, none) and"
            " what decided (a rule's label, private, unavailable, request, estimate)",
            ["model", "route", "reason"],
            registry=r,
        )
        # labels() costs a lock and a lookup: each combination's child is looked up once (no
        # child is ever removed, so none kept here can be one Prometheus no longer shows)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.confidences = Histogram(
            "edged_inference_confidence",
            "Each local call's best score (the mean over its rows), for classifiers (an output"
            " with labels, or the model's confidence_output): a new version's drift shows here",
            model,
            buckets=CONFIDENCE_BUCKETS,
            registry=r,
        )
        self.cloud_requests = Counter(
            "edged_cloud_requests",
            "Calls to the cloud tier by model, the version called on the server (cloud_model:"
            " an A/B arm) and outcome (success, error)",
            ["model", "cloud_model", "outcome"],
            registry=r,
        )
        self.ab_calls = Counter(
            "edged_cloud_ab_calls",
            "Calls an A/B test of a cloud model counted, by the version called (cloud_model: its"
            " arm) and whether the test's rule calls it good (answered, in time, sure enough):"
            " the fleet service adds these up across nodes for an A/B the fleet decides",
            ["model", "cloud_model", "good"],
            registry=r,
        )
        self.tier_calls = Counter(
            "edged_cloud_tier_calls",
            "Calls to each cloud tier ([cloud] name, [[cloud.tiers]]) by outcome (success, error)",
            ["tier", "outcome"],
            registry=r,
        )
        self.tier_cost = Counter(
            "edged_cloud_cost",
            "What the cloud calls answered cost, by tier: its cost per call plus the model's"
            " [[cloud.models]] cost, in the operator's unit",
            ["tier"],
            registry=r,
        )
        self.cloud_seconds = Histogram(
            "edged_cloud_request_duration_seconds",
            "Time of a call to the cloud tier, by model and the version called on the server",
            ["model", "cloud_model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.idle_unloads = Counter(
            "edged_model_idle_unloads",
            "Unloads of a model's versions because nobody called them for models.idle_unload_s",
            ["model"],
            registry=r,
        )
        self.wake_seconds = Histogram(
            "edged_model_wake_duration_seconds",
            "Time a call waited for its idle-unloaded model version to load again",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per combination."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def route(self, model: str, route: str, reason: str) -> None:
        """Count one routing decision (``reason``: the rule's label or what decided)."""
        self.child(self.routes, model, route, reason).inc()

    def confidence(self, model: str, version: int, value: float) -> None:
        self.child(self.confidences, model, str(version)).observe(value)

    def cloud_call(
        self, model: str, cloud_model: str, seconds: float, ok: bool, tier: str, cost: float
    ) -> None:
        """One call to a cloud tier ended (labels: names from the catalog and the config);
        ``cost``: what it cost, counted when it was answered."""
        outcome = "success" if ok else "error"
        self.cloud_requests.labels(model, cloud_model, outcome).inc()
        self.cloud_seconds.labels(model, cloud_model).observe(seconds)
        self.tier_calls.labels(tier, outcome).inc()
        if ok:
            self.tier_cost.labels(tier).inc(cost)

    def ab_call(self, model: str, cloud_model: str, good: bool) -> None:
        self.ab_calls.labels(model, cloud_model, "true" if good else "false").inc()

    def attach(self, scheduler: Scheduler, model: str, version: int) -> None:
        """Observe one model version's scheduler: its hooks, and its queue depth read when
        Prometheus scrapes."""
        labels = (model, str(version))
        queue = self.queue_seconds.labels(*labels)
        compute = self.compute_seconds.labels(*labels)
        batch = self.batch_size.labels(*labels)
        executions = self.executions.labels(*labels)
        sizes = self.batches.setdefault(labels, {})

        def executed(rows: int, seconds: float) -> None:
            executions.inc()
            batch.observe(rows)
            compute.observe(seconds)
            row = sizes.setdefault(rows, [0, 0.0])
            row[0] += 1
            row[1] += seconds

        scheduler.observer = Observer(queued=queue.observe, executed=executed)
        self.queue_depth.labels(*labels).set_function(lambda: scheduler.depth)

    def finished(
        self, model: str, version: int, seconds: float, error: BaseException | None
    ) -> None:
        """A model call ended (answered, refused or failed)."""
        outcome = "cancelled" if error is not None and not isinstance(error, Exception) else None
        outcome = outcome or outcome_of(error)
        served = str(version)
        self.child(self.requests, model, served, outcome).inc()
        self.child(self.outcome_seconds, model, served, outcome).inc(seconds)
        self.child(self.request_seconds, model, served).observe(seconds)
        self.child(self.last_call, model, served).set_to_current_time()

    def statistics(self, versions: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Triton's statistics extension for these (model, version) pairs, from the counters
        above: calls by outcome (success, fail: every other outcome) with their time, queue,
        executions (compute_infer: edged times an execution whole, so compute_input and
        compute_output stay 0) and the rows they ran (inference_count), per batch size too."""
        wanted = set(versions)
        figures: dict[tuple[str, str], dict[str, float]] = {v: {} for v in versions}
        metrics: list[Any] = [
            self.requests,
            self.outcome_seconds,
            self.queue_seconds,
            self.compute_seconds,
            self.batch_size,
            self.executions,
            self.last_call,
        ]
        for metric in metrics:
            for family in metric.collect():
                for sample in family.samples:
                    key = (sample.labels.get("model", ""), sample.labels.get("version", ""))
                    if key not in wanted or sample.name.endswith(("_bucket", "_created")):
                        continue
                    name = sample.name
                    if "outcome" in sample.labels:
                        good = "success" if sample.labels["outcome"] == "success" else "fail"
                        name = f"{name}:{good}"
                    figures[key][name] = figures[key].get(name, 0.0) + sample.value
        return [self._statistics(m, v, figures[(m, v)]) for m, v in versions]

    def _statistics(self, model: str, version: str, f: dict[str, float]) -> dict[str, Any]:
        def duration(count: float, seconds: float) -> dict[str, int]:
            return {"count": int(count), "ns": int(seconds * 1e9)}

        def of(name: str) -> float:
            return f.get(f"edged_inference_{name}", 0.0)

        def outcome(good: str) -> dict[str, int]:
            return duration(
                of(f"requests_total:{good}"), of(f"request_outcome_seconds_total:{good}")
            )

        zero = duration(0, 0)
        executions = of("executions_total")
        stats = {
            "success": outcome("success"),
            "fail": outcome("fail"),
            "queue": duration(of("queue_duration_seconds_count"), of("queue_duration_seconds_sum")),
            "compute_input": zero,
            "compute_infer": duration(executions, of("compute_duration_seconds_sum")),
            "compute_output": zero,
            "cache_hit": zero,
            "cache_miss": zero,
        }
        batches = [
            {
                "batch_size": size,
                "compute_input": duration(n, 0),
                "compute_infer": duration(n, seconds),
                "compute_output": duration(n, 0),
            }
            for size, (n, seconds) in sorted(self.batches.get((model, version), {}).items())
        ]
        return {
            "name": model,
            "version": version,
            "last_inference": int(of("last_timestamp_seconds") * 1000),
            "inference_count": int(of("batch_size_sum")),
            "execution_count": int(executions),
            "inference_stats": stats,
            "batch_stats": batches,
            "memory_usage": [],
        }

    def render(self) -> bytes:
        """The text exposition format."""
        return bytes(generate_latest(self.registry))
