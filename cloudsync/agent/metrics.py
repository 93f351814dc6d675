"""cloudsync's own Prometheus metrics: the fleet connection, the outbox, edged's reachability,
rollbacks and the alerts firing on the device. Served at ``GET /metrics`` on the local API's
socket and, with ``[metrics] port``, on a loopback TCP port. Gauges are read when Prometheus
scrapes, from the agent's state (``cloudsync.agent.state``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cloudsync.agent.alerts import Evaluator
from cloudsync.agent.outbox import Outbox
from cloudsync.agent.state import AgentState
from cloudsync.protocol.series import alerts_family, outbox_families, session_families

disable_created_metrics()  # no *_created series: they double the series of every counter


class AgentStateCollector(Collector):
    """The gauges read from the agent's state, the outbox and the alerts at each scrape."""

    def __init__(self, state: AgentState, outbox: Outbox, alerts: Evaluator) -> None:
        self.state, self.outbox, self.alerts = state, outbox, alerts

    def collect(self) -> Iterator[Metric]:
        state = self.state
        yield from session_families(state.connected, state.edged.status is not None)
        yield from outbox_families(self.outbox.stats(), self.outbox.oldest_age_s())
        yield CounterMetricFamily(
            "cloudsync_poison_messages",
            "Messages from the broker whose handling failed (acknowledged, logged)",
            float(state.poison),
        )
        last = GaugeMetricFamily(
            "cloudsync_model_last_rollback_timestamp_seconds",
            "When a version of the model was last rolled back on this node (Unix time)",
            labels=["model"],
        )
        for model, at in sorted(dict(state.rollbacks).items()):
            last.add_metric([model], at)
        yield last
        counts = collections.Counter((a.rule.name, a.rule.severity) for a in self.alerts.firing())
        yield alerts_family(counts)


class AgentMetrics:
    """The registry and the counters the agent increments."""

    def __init__(self, state: AgentState, outbox: Outbox, alerts: Evaluator) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        r.register(AgentStateCollector(state, outbox, alerts))
        self.connections = Counter(
            "cloudsync_mqtt_connections", "Sessions established with the broker", registry=r
        )
        self.heartbeats = Counter("cloudsync_heartbeats", "Heartbeats published", registry=r)
        self.restarts = Counter(
            "cloudsync_thread_restarts",
            "Times a thread of cloudsync failed and was started again (a bug or the disk: see"
            " the log)",
            ["thread"],
            registry=r,
        )
        self.rollbacks = Counter(
            "cloudsync_model_rollbacks",
            "Model versions rolled back on this node",
            ["model"],
            registry=r,
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return bytes(generate_latest(self.registry))

    def serve(self, address: str, port: int) -> Callable[[], None]:
        """/metrics on a TCP port (a thread); returns what stops it."""
        server, thread = start_http_server(port, address, self.registry)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(5)

        return stop
