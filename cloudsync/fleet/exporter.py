"""Every node's series for Prometheus, from what the fleet service keeps (``GET
/v1/fleet/metrics``): devices behind NAT or a cellular link, which only MQTT leaves, are
monitored through the service as if Prometheus scraped each one.

The names, labels and units are those of edged's and cloudsync's own ``/metrics`` (made by the
same functions: ``edged.common.gauges``, ``cloudsync.protocol.series``), with ``instance`` the
node's name and ``fleet`` the fleet, so docs/monitoring's dashboard and rules work on both paths
(Prometheus keeps these labels with ``honor_labels: true``):

- from the node's **last heartbeat**: the load (``edged_local_load_ratio``,
  ``edged_device_*``), the cloud link and breaker (``edged_cloud_link_*``,
  ``edged_cloud_breaker_*``), requests in flight, the ready model versions, edged's
  reachability and the outbox (``cloudsync_*``); and the heartbeats the service counted;
- from its **telemetry**, added up by the service: ``edged_inference_requests_total``, the
  latency histogram ``edged_inference_request_duration_seconds``,
  ``edged_route_decisions_total`` (by model and route) and ``edged_cloud_requests_total``;
- from its **alerts**: ``cloudsync_alerts_firing``.

A node that is offline, or online without a heartbeat for ``offline_after_s`` (stale), has only
``cloudsync_mqtt_connected 0`` and its ``edgefleet_node_*`` series: its figures are not shown
frozen, they end (Prometheus marks them stale at the next scrape). Every node has
``edgefleet_node_info`` (state, software) and ``edgefleet_node_labels`` (its labels, names
made Prometheus': ``label_<name>``) to join on ``instance``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from cloudsync.fleet.observe import bucket_of, label_name
from cloudsync.fleet.store import Store
from cloudsync.protocol import envelope
from cloudsync.protocol.series import alerts_family, outbox_families, session_families
from edged.common.gauges import cloud_families, device_families
from edged.common.load import LoadSnapshot

log = logging.getLogger("edgefleet.exporter")
HISTOGRAM = "edged_inference_request_duration_seconds"
MAX_SHARDS = 64
COUNTERS = {  # a telemetry counter's family: its type and help, as edged's own
    "edged_inference_requests": ("counter", "Inference requests by model, version and outcome"),
    HISTOGRAM: ("histogram", "Time from receipt to response, by model and version"),
    "edged_route_decisions": (
        "counter",
        "Routing decisions by model and route (through the fleet service: without the reason)",
    ),
    "edged_cloud_requests": (
        "counter",
        "Calls to the cloud tier by model, the cloud model called and outcome",
    ),
    "edged_cloud_ab_calls": (
        "counter",
        "Calls an A/B test of a cloud model counted, by the arm called (cloud_model) and"
        " whether its rule called them good",
    ),
}
_LOAD_FIELDS = {f.name: f.type for f in dataclasses.fields(LoadSnapshot)}


def _label(value: Any, limit: int = 128) -> str:
    return envelope.printable(str(value), limit)


def load_snapshot(load: Any) -> LoadSnapshot:
    """A heartbeat's ``load`` as edged's snapshot: the fields of the right type only (a node
    says what it likes; a figure it got wrong is absent, as one it cannot tell)."""
    if not isinstance(load, dict):
        return LoadSnapshot()
    kept: dict[str, Any] = {}
    for key, value in load.items():
        kind = _LOAD_FIELDS.get(key)
        if kind is None or value is None or key in ("taken", "sources"):
            continue
        if "bool" in kind and isinstance(value, bool):
            kept[key] = value
        elif "str" in kind and "dict" not in kind and isinstance(value, str):
            kept[key] = _label(value, 64)
        elif (
            ("float" in kind or "int" in kind)
            and not isinstance(value, bool)
            and isinstance(value, (int, float))
            and math.isfinite(value)
            and abs(value) < 1e18
        ):
            kept[key] = value
    return LoadSnapshot(**kept)


def heartbeat_families(hb: Mapping[str, Any]) -> Iterator[Metric]:
    """The families a node's last heartbeat gives (as the node's own /metrics would)."""
    yield from device_families(load_snapshot(hb.get("load")))
    link = hb.get("link")
    if isinstance(link, dict):
        ratio = hb.get("cloud_error_ratio")
        scale = hb.get("cloud_scale_out")
        yield from cloud_families(
            {
                "link": {k: v for k, v in link.items() if k == "up" or _finite(v)},
                "breaker": hb.get("breaker"),
                "error_rate": ratio if _finite(ratio) else None,
                "scale_out": {"needed": scale} if isinstance(scale, bool) else None,
            }
        )
    inflight = GaugeMetricFamily(
        "edged_requests_in_flight", "API requests being answered (REST and gRPC)"
    )
    if _finite(hb.get("inflight")):
        inflight.add_metric([], float(hb["inflight"]))
    yield inflight
    versions = InfoMetricFamily(
        "edged_model_version",
        "The model versions ready on the node (its heartbeat's)",
        labels=["model", "version", "state"],
    )
    models = hb.get("models")
    for model, version in models.items() if isinstance(models, dict) else []:
        versions.add_metric([_label(model), _label(version, 32), "READY"], {})
    yield versions
    edged = hb.get("edged")
    reachable = edged.get("reachable") if isinstance(edged, dict) else None
    yield from session_families(True, reachable if isinstance(reachable, bool) else None)
    outbox = hb.get("outbox")
    if isinstance(outbox, dict):
        stats: dict[str, Any] = {
            "depth": {_label(k, 32): v for k, v in _numbers(outbox.get("depth")).items()},
            "counters": {_label(k, 32): v for k, v in _numbers(outbox.get("counters")).items()},
        }
        for key in ("bytes", "budget_bytes", "dead_letters", "disk_full"):
            value = outbox.get(key)
            if not _finite(value) and not isinstance(value, bool):
                break
            stats[key] = value
        else:
            oldest: Any = outbox.get("oldest_age_s")
            yield from outbox_families(stats, float(oldest) if _finite(oldest) else None)


def _finite(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) < 1e18
    )


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in list(value.items())[:64] if _finite(v)}


class Exposition:
    """Families gathered node by node, written in Prometheus' text format (0.0.4) at the end:
    each family's HELP and TYPE once, then every node's samples, the node's own labels written
    once a node (prometheus_client's generate_latest costs 2 to 3 times as much here: it checks
    and escapes every label of every sample)."""

    def __init__(self) -> None:
        self.heads: dict[str, str] = {}
        self.lines: dict[str, list[str]] = {}
        self.pairs: dict[tuple[str, str], str] = {}

    def add(self, family: Metric, prefix: str = "") -> None:
        """``family``'s samples, each labelled ``prefix`` (``k="v",...``, written) first."""
        lines = self.lines.get(family.name)
        if lines is None:
            self.heads[family.name] = _head(family)
            lines = self.lines[family.name] = []
        for sample in family.samples:
            own = ",".join(self.pair(k, v) for k, v in sample.labels.items())
            labels = f"{prefix},{own}" if prefix and own else prefix or own
            value = floatToGoString(sample.value)
            lines.append(
                f"{sample.name}{{{labels}}} {value}\n" if labels else f"{sample.name} {value}\n"
            )

    def pair(self, name: str, value: str) -> str:
        found = self.pairs.get((name, value))
        if found is None:
            escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
            found = self.pairs[(name, value)] = f'{name}="{escaped}"'
        return found

    def text(self) -> bytes:
        return "".join(self.heads[n] + "".join(lines) for n, lines in self.lines.items()).encode()


class Counted:
    """The telemetry counters' lines, written straight from their rows: a fleet's nodes share
    a few label sets (the same models, versions, buckets) and many values, so each set's JSON
    is parsed and its pairs written once a scrape, each value formatted once, not once a row
    (issue 48: at 10,000 nodes, 437,780 rows)."""

    def __init__(self, out: Exposition) -> None:
        self.out = out
        self.families: dict[str, list[str] | None] = {}  # a counter's name: its family's lines
        self.labels: dict[str, str | None] = {}  # a row's labels (JSON): written, or None
        self.values: dict[float, str] = {}

    def lines(self, name: str) -> list[str] | None:
        """The lines of the family of counter ``name`` (None: not one of COUNTERS)."""
        if name not in self.families:
            base = next((f for f in COUNTERS if name.startswith(f"{f}_")), None)
            found = None
            if base is not None:
                found = self.out.lines.get(base)
                if found is None:
                    kind, doc = COUNTERS[base]
                    self.out.heads[base] = _head(Metric(base, doc, kind))
                    found = self.out.lines[base] = []
            self.families[name] = found
        return self.families[name]

    def pairs(self, text: str) -> str | None:
        """``k="v",...`` of a row's labels; None when they are not an object of text."""
        found = self.labels.get(text, "")
        if found == "":
            try:
                labels = json.loads(text)
            except ValueError:
                labels = None
            ok = isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())
            found = self.labels[text] = (
                ",".join(self.out.pair(str(k), v) for k, v in labels.items()) if ok else None
            )
        return found

    def add(self, rows: list[dict[str, Any]], prefix: str) -> None:
        """A node's counter rows, as edged's families, labelled ``prefix`` first."""
        values = self.values
        for row in rows:
            name = row["name"]
            lines = self.lines(name)
            own = self.pairs(row["labels"]) if lines is not None else None
            if lines is None or own is None:
                continue
            value = row["value"]
            shown = values.get(value)
            if shown is None:
                shown = values[value] = floatToGoString(value)
            lines.append(
                f"{name}{{{prefix},{own}}} {shown}\n" if own else f"{name}{{{prefix}}} {shown}\n"
            )


def _head(family: Metric) -> str:
    """A family's HELP and TYPE lines, as prometheus_client writes them."""
    name, kind = family.name, family.type
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name, kind = name + "_info", "gauge"
    elif kind == "unknown":
        kind = "untyped"
    doc = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class NodeSeries:
    """The fleet's series, read from the database at each scrape."""

    def __init__(
        self, store: Store, fleet: str, offline_after_ms: int, clock: Callable[[], int]
    ) -> None:
        self.store, self.fleet, self.offline_after_ms, self.clock = (
            store,
            fleet,
            offline_after_ms,
            clock,
        )

    def render(self, shard: int = 0, shards: int = 1) -> bytes:
        """The text exposition format of the nodes of ``shard`` (0 to ``shards`` - 1: each
        node is in one, by ``observe.bucket_of``), from one read of the database."""
        if not 0 <= shard < shards <= MAX_SHARDS:
            raise ValueError(f"shard: 0 to shards - 1, shards: 1 to {MAX_SHARDS}")
        now = self.clock()
        nodes = [
            raw
            for raw in self.store.query(
                "SELECT node, state, last_seen, heartbeats, heartbeat_ts, heartbeat, software,"
                " node_labels, labels FROM nodes ORDER BY node"
            )
            if shards == 1 or bucket_of(raw["node"]) % shards == shard
        ]
        counters: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in self.store.query(
            "SELECT node, name, labels, value FROM counters WHERE bucket % ? = ?", (shards, shard)
        ):
            counters[row["node"]].append(row)
        firing: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
        for row in self.store.query(
            "SELECT node, alertname, severity, COUNT(*) AS n FROM alerts WHERE state = 'firing'"
            " GROUP BY node, alertname, severity"
        ):
            firing[row["node"]][(row["alertname"], row["severity"])] = int(row["n"])
        out = Exposition()
        counted = Counted(out)
        fleet = out.pair("fleet", self.fleet)
        for raw in nodes:
            node = raw["node"]
            here = f"{fleet},{out.pair('instance', node)}"
            fresh = raw["state"] == "online" and raw["last_seen"] >= now - self.offline_after_ms
            for family in self._registry(raw, fresh):
                out.add(family, here)
            if not (fresh and raw["heartbeat"]):
                for family in session_families(False, None):
                    out.add(family, here)
                continue
            try:
                found = list(heartbeat_families(json.loads(raw["heartbeat"])))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:  # its own loss
                log.debug("node %s: heartbeat not shown: %s", node, exc)
                found = list(session_families(True, None))
            for family in found:
                out.add(family, here)
            counted.add(counters.get(node, []), here)
            out.add(alerts_family(firing.get(node, {})), here)
        return out.text()

    @staticmethod
    def _registry(raw: dict[str, Any], fresh: bool) -> Iterator[Metric]:
        """What the registry knows of a node (every node has them)."""
        state = raw["state"] if fresh or raw["state"] != "online" else "stale"
        software = json.loads(raw["software"])
        info = InfoMetricFamily(
            "edgefleet_node",
            "Every node the service knows: its state"
            " (online, stale, offline, unknown) and software",
        )
        info.add_metric(
            [],
            {
                "state": state,
                **{
                    f"{label_name(k)}_version": _label(v, 64)
                    for k, v in software.items()
                    if isinstance(k, str) and v is not None
                },
            },
        )
        yield info
        own = {**json.loads(raw["node_labels"]), **json.loads(raw["labels"])}
        labels = InfoMetricFamily(
            "edgefleet_node_labels",
            "Every node's labels (its own and the operators'), as label_<name>",
        )
        labels.add_metric([], {f"label_{label_name(k)}": v for k, v in own.items()})
        yield labels
        last = GaugeMetricFamily(
            "edgefleet_node_last_heartbeat_timestamp_seconds",
            "When the node sent its last heartbeat (Unix time, its clock)",
        )
        if raw["heartbeat_ts"]:
            last.add_metric([], raw["heartbeat_ts"] / 1000)
        yield last
        beats = CounterMetricFamily(
            "cloudsync_heartbeats", "Heartbeats the fleet service counted from the node"
        )
        if fresh and raw["heartbeat"]:
            beats.add_metric([], float(raw["heartbeats"]))
        yield beats
