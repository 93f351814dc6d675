"""The Prometheus families of what a node tells about itself (its link to the fleet, edged's
reachability, its outbox, the alerts firing on it): cloudsync's own ``/metrics`` and the fleet
service's series per node (from the node's heartbeat) are made by the same functions, so both
paths have the same names, labels and units.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric


def session_families(connected: bool, edged_up: bool | None) -> Iterator[Metric]:
    """The node's MQTT session, and edged's answer (None: not known, no sample)."""
    yield GaugeMetricFamily(
        "cloudsync_mqtt_connected",
        "1 while the MQTT session with the fleet's broker is up",
        float(connected),
    )
    up = GaugeMetricFamily(
        "cloudsync_edged_up", "1 when edged answered cloudsync's last call on its socket"
    )
    if edged_up is not None:
        up.add_metric([], float(edged_up))
    yield up


def outbox_families(stats: Mapping[str, Any], oldest_s: float | None) -> Iterator[Metric]:
    """The outbox's figures (``Outbox.stats()``, as the heartbeat carries them)."""
    records = GaugeMetricFamily(
        "cloudsync_outbox_records", "Records waiting in the outbox", labels=["priority"]
    )
    for priority, count in stats["depth"].items():
        records.add_metric([str(priority)], float(count))
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
    yield GaugeMetricFamily(
        "cloudsync_outbox_dead_letters",
        "Records the broker refused (kept aside, never sent again)",
        float(stats["dead_letters"]),
    )
    age = GaugeMetricFamily(
        "cloudsync_outbox_oldest_age_seconds",
        "Age of the oldest record waiting (absent: the outbox is empty)",
    )
    if oldest_s is not None:
        age.add_metric([], float(oldest_s))
    yield age
    handled = CounterMetricFamily(
        "cloudsync_outbox_handled_records",
        "Records by what became of them (put, duplicate, acked, dropped_budget, dropped_ttl,"
        " dead), counted in the outbox's file across restarts",
        labels=["outcome"],
    )
    for name, value in stats["counters"].items():
        handled.add_metric([str(name)], float(value))
    yield handled


def alerts_family(counts: Mapping[tuple[str, str], int]) -> Metric:
    """The alerts firing on the node, by (alertname, severity): how many."""
    firing = GaugeMetricFamily(
        "cloudsync_alerts_firing",
        "Alerts firing on the device (cloudsync.agent.alerts), by rule: how many (a rule fires"
        " once per label set, e.g. per model)",
        labels=["alertname", "severity"],
    )
    for (name, severity), count in sorted(counts.items()):
        firing.add_metric([name, severity], float(count))
    return firing
