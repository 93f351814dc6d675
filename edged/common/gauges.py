"""The gauges of a device's load and of its cloud tier, as Prometheus families: edged's own
``/metrics`` and the fleet service's series per node (from the node's heartbeat) are made by
the same functions, so both paths have the same names, labels and units. A figure nobody could
tell has no sample (absent, not 0).

A leaf: prometheus_client's metric families and the load snapshot only (the fleet service
imports it without edged's runtime).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, InfoMetricFamily, Metric

from edged.common.load import LoadSnapshot


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge family, with its sample when the value is known (else none: "cannot tell")."""
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], float(value))
    return family


def device_families(snap: LoadSnapshot) -> Iterator[Metric]:
    def ratio(percent: float | None) -> float | None:
        return None if percent is None else percent / 100.0

    loads = [v for v in (snap.cpu_percent, snap.gpu_percent) if v is not None]
    yield gauge(
        "edged_local_load_ratio",
        "The local load routing weighs (the busier of CPU and GPU), 0 to 1",
        ratio(max(loads)) if loads else None,
    )
    yield gauge(
        "edged_device_cpu_utilization_ratio",
        "CPU utilization of the device, 0 to 1",
        ratio(snap.cpu_percent),
    )
    yield gauge(
        "edged_device_gpu_utilization_ratio",
        "GPU utilization of the device, 0 to 1",
        ratio(snap.gpu_percent),
    )
    yield gauge(
        "edged_device_memory_used_ratio",
        "Memory in use (Jetson: shared by CPU and GPU), 0 to 1",
        ratio(snap.memory_used_percent),
    )
    yield gauge(
        "edged_device_memory_available_bytes",
        "Memory available to edged (the cgroup's limit taken into account)",
        snap.memory_available,
    )
    yield gauge("edged_device_temperature_celsius", "The hottest thermal zone", snap.temperature_c)
    yield gauge("edged_device_power_watts", "Total input power (Jetson: VDD_IN)", snap.power_w)
    yield gauge(
        "edged_device_throttled",
        "1 while the device is throttled (over-current or thermal)",
        None if snap.throttled is None else float(snap.throttled),
    )
    yield gauge(
        "edged_device_clocks_pinned",
        "1 while jetson_clocks holds the clocks at their maximum",
        None if snap.clocks_pinned is None else float(snap.clocks_pinned),
    )
    mode = InfoMetricFamily("edged_device_power_mode", "The power mode (Jetson: nvpmodel)")
    if snap.power_mode is not None:
        mode.add_metric([], {"mode": snap.power_mode})
    yield mode


def cloud_families(state: dict[str, Any] | None) -> Iterator[Metric]:
    link = (state or {}).get("link") or {}
    up = None if state is None else float(bool(link.get("up")))
    yield gauge("edged_cloud_link_up", "1 while the link to the cloud tier is up", up)
    rtt = GaugeMetricFamily(
        "edged_cloud_link_rtt_seconds",
        "Round-trip time to the cloud tier: its moving average (ewma), p50 and p95",
        labels=["statistic"],
    )
    for statistic, key in (("ewma", "rtt_s"), ("p50", "rtt_p50_s"), ("p95", "rtt_p95_s")):
        if link.get(key) is not None:
            rtt.add_metric([statistic], link[key])
    yield rtt
    yield gauge(
        "edged_cloud_link_bandwidth_bytes_per_second",
        "Bandwidth to the cloud tier, measured on large payloads",
        link.get("bandwidth_bps"),
    )
    breaker = GaugeMetricFamily(
        "edged_cloud_breaker_state",
        "The cloud tier's circuit breaker: 1 for its state (closed, open, half_open)",
        labels=["state"],
    )
    if state is not None:
        for name in ("closed", "open", "half_open"):
            breaker.add_metric([name], float(state.get("breaker") == name))
    yield breaker
    yield gauge(
        "edged_cloud_breaker_error_ratio",
        "The share of cloud calls that failed in the breaker's window",
        None if state is None else state.get("error_rate"),
    )
    scale = (state or {}).get("scale_out") or {}
    yield gauge(
        "edged_cloud_scale_out",
        "1 while the cloud tier needs more capacity: more than cloud.scale_out_error_rate of"
        " its calls failed over cloud.scale_out_window_s (what an autoscaler reads)",
        None if "needed" not in scale else float(bool(scale["needed"])),
    )
    calls = scale.get("calls")
    yield gauge(
        "edged_cloud_scale_out_error_ratio",
        "The share of cloud calls that failed over cloud.scale_out_window_s",
        scale["failures"] / calls if calls else None,
    )


def tier_families(states: list[dict[str, Any]]) -> Iterator[Metric]:
    """Each cloud tier's link, breaker and scale-out signal, labelled by its name (the first
    tier's are also the unlabelled ``edged_cloud_*`` gauges)."""
    up = GaugeMetricFamily(
        "edged_cloud_tier_link_up", "1 while the link to this cloud tier is up", labels=["tier"]
    )
    breaker = GaugeMetricFamily(
        "edged_cloud_tier_breaker_state",
        "This cloud tier's circuit breaker: 1 for its state (closed, open, half_open)",
        labels=["tier", "state"],
    )
    scale = GaugeMetricFamily(
        "edged_cloud_tier_scale_out",
        "1 while this cloud tier needs more capacity (its scale-out signal)",
        labels=["tier"],
    )
    for state in states:
        tier = str(state.get("name", ""))
        up.add_metric([tier], float(bool((state.get("link") or {}).get("up"))))
        for name in ("closed", "open", "half_open"):
            breaker.add_metric([tier, name], float(state.get("breaker") == name))
        scale.add_metric([tier], float(bool((state.get("scale_out") or {}).get("needed"))))
    yield from (up, breaker, scale)
