"""cloudsync's own Prometheus metrics: the fleet connection, the outbox, edged's reachability,
rollbacks and the alerts firing on the device. Served at ``GET /metrics`` on the local API's
socket and, with ``[metrics] port``, on a loopback TCP port. Gauges are read when Prometheus
scrapes, from the agent's state.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from cloudsync.agent.session import Agent

disable_created_metrics()  # no *_created series: they double the series of every counter


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        yield GaugeMetricFamily(
            "cloudsync_mqtt_connected",
            "1 while the MQTT session with the fleet's broker is up",
            float(agent.connected),
        )
        yield GaugeMetricFamily(
            "cloudsync_edged_up",
            "1 when edged answered cloudsync's last call on its socket",
            float(agent.edged.status is not None),
        )
        stats = agent.outbox.stats()
        records = GaugeMetricFamily(
            "cloudsync_outbox_records", "Records waiting in the outbox", labels=["priority"]
        )
        for priority, count in stats["depth"].items():
            records.add_metric([priority], count)
        yield records
        yield GaugeMetricFamily(
            "cloudsync_outbox_bytes", "Size of the records waiting", float(stats["bytes"])
        )
        yield GaugeMetricFamily(
            "cloudsync_outbox_budget_bytes",
            "The outbox's disk budget (records beyond it are dropped, counted)",
            float(stats["budget_bytes"]),
        )
        yield GaugeMetricFamily(
            "cloudsync_outbox_disk_full",
            "1 while the outbox's disk is full: new local records are refused (507), what the"
            " outbox holds is still delivered",
            float(stats["disk_full"]),
        )
        yield CounterMetricFamily(
            "cloudsync_poison_messages",
            "Messages from the broker whose handling failed (acknowledged, logged)",
            float(agent.poison),
        )
        yield GaugeMetricFamily(
            "cloudsync_outbox_dead_letters",
            "Records the broker refused (kept aside, never sent again)",
            float(stats["dead_letters"]),
        )
        age = GaugeMetricFamily(
            "cloudsync_outbox_oldest_age_seconds",
            "Age of the oldest record waiting (absent: the outbox is empty)",
        )
        oldest = agent.outbox.oldest_age_s()
        if oldest is not None:
            age.add_metric([], oldest)
        yield age
        handled = CounterMetricFamily(
            "cloudsync_outbox_handled_records",
            "Records by what became of them (put, duplicate, acked, dropped_budget, dropped_ttl,"
            " dead), counted in the outbox's file across restarts",
            labels=["outcome"],
        )
        for name, value in stats["counters"].items():
            handled.add_metric([name], float(value))
        yield handled
        last = GaugeMetricFamily(
            "cloudsync_model_last_rollback_timestamp_seconds",
            "When a version of the model was last rolled back on this node (Unix time)",
            labels=["model"],
        )
        for model, at in sorted(dict(agent.rollbacks).items()):
            last.add_metric([model], at)
        yield last
        firing = GaugeMetricFamily(
            "cloudsync_alerts_firing",
            "Alerts firing on the device (cloudsync.agent.alerts), by rule: how many (a rule fires"
            " once per label set, e.g. per model)",
            labels=["alertname", "severity"],
        )
        counts = collections.Counter((a.rule.name, a.rule.severity) for a in agent.alerts.firing())
        for (name, severity), count in sorted(counts.items()):
            firing.add_metric([name, severity], float(count))
        yield firing


class Exporter:
    """The registry and the counters the agent increments."""

    def __init__(self, agent: Agent) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        r.register(AgentCollector(agent))
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
            "cloudsync_model_rollbacks", "Model versions rolled back on this node", ["model"],
            registry=r,
        )  # fmt: skip

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
