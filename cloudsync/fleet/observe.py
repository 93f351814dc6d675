"""What nodes report beyond their state, as the registry's writer stores it (in the batch's
transaction, once whatever a broker or a reconnect repeats):

- **events**: every record of a node's ``events`` stream, kept for ``[events] keep_days`` (the
  console's recent events) and written once as an ECS JSON line (``EventLog``) for Filebeat or
  any shipper;
- **alerts**: an event that is a device alert (``cloudsync.agent.alerts``: ``{"alert", "state":
  "firing"|"resolved", "labels", "active_since_ms", "at_ms", ...}``) sets the alert's row, keyed
  by the node, the alert's name and labels; the newer change wins (a duplicate, or an older
  change arriving after a newer one, changes nothing). ``cloudsync.fleet.alerting`` sends them to
  Alertmanager;
- **counters**: edged's metrics in each ``telemetry`` record are added to the node's counters
  (requests by outcome, the latency histogram, routes, cloud calls, the calls of A/B tests
  by arm and whether they were good: what ``cloudsync.fleet.abtests`` adds up), once a
  record (its id is kept a day), so the fleet's series (``cloudsync.fleet.exporter``) are the
  node's own.

Everything is checked before it is written: a field that is not what the contract says is a
ValueError naming it (the registry counts the message as poison and drops it).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import logging.handlers
import math
import re
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ecs_logging

from cloudsync.fleet.store import Tx, dumps
from cloudsync.protocol import envelope

log = logging.getLogger("edgefleet.observe")
LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_EVENT_BODY = 16384  # bytes of an event's body the database keeps (the rest: its keys)
MAX_LABELS = 32
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]{0,62}\Z")  # Prometheus' and Alertmanager's
MAX_ROWS = 256  # model versions, routes, buckets or outcomes in one telemetry record
MAX_NODE_COUNTERS = 2000  # a node's counters (its series from telemetry) at most
BUCKETS = 5040  # of nodes, for shards of the series (divisible by every count up to 10, 12...)


def text(value: Any, limit: int = 500) -> str:
    """A sender's text as a column keeps it: escaped (lone surrogates, NUL, which PostgreSQL's
    text cannot hold) and capped."""
    return envelope.printable(str(value), limit).replace("\x00", "\\x00")


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise ValueError(f"{what}: a count, not {text(value, 40)}")
    return value


def _mapping(value: Any, what: str, limit: int = MAX_ROWS) -> Mapping[str, Any]:
    if not isinstance(value, dict) or len(value) > limit:
        raise ValueError(f"{what}: an object of at most {limit} keys")
    return value


def bucket_of(node: str) -> int:
    """A node's bucket, 0 to BUCKETS - 1: a shard of the fleet's series is the nodes whose
    bucket modulo the shards is the shard's number (stable: the name's CRC-32)."""
    return zlib.crc32(node.encode(errors="surrogatepass")) % BUCKETS


@functools.lru_cache(maxsize=4096)
def label_name(key: str) -> str:
    """A label's name as Prometheus and Alertmanager take it (``.``, ``/``, ``-`` as ``_``)."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)[:63]
    return name if LABEL_NAME.match(name) else f"_{name}"[:63]


@dataclass(frozen=True)
class Event:
    """An event stored for the first time (what the ECS log writes)."""

    node: str
    id: str
    ts: int
    arrived: int
    seq: int
    priority: str
    level: str
    message: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Alert:
    name: str
    state: str  # firing or resolved
    severity: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_ms: int
    changed_ms: int

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(dumps([self.name, self.labels]).encode()).hexdigest()[:16]


def alert_of(body: Mapping[str, Any]) -> Alert | None:
    """The device alert an event is, if it is one (ValueError: one that breaks the contract)."""
    name, state = body.get("alert"), body.get("state")
    if not isinstance(name, str) or state is None:
        return None  # an event (an edged error is an alert by priority, not a rule's alert)
    if state not in ("firing", "resolved") or not LABEL_NAME.match(name):
        raise ValueError("events.alert: a rule's name and a state, firing or resolved")
    labels = {}
    for key, value in _mapping(body.get("labels") or {}, "events.labels", MAX_LABELS).items():
        if not LABEL_NAME.match(key) or key in ("alertname", "instance", "fleet", "severity"):
            raise ValueError(f"events.labels: {text(key, 64)!r} is not a label of its own")
        labels[key] = text(value, 128)
    annotations = {k: text(body[k], 2000) for k in ("summary", "description") if k in body}
    if isinstance(body.get("value"), (int, float)) and not isinstance(body["value"], bool):
        annotations["value"] = f"{float(body['value']):.6g}"
    return Alert(
        name,
        state,
        text(body.get("severity") or "warning", 32),
        labels,
        annotations,
        _count(body.get("active_since_ms"), "events.active_since_ms"),
        _count(body.get("at_ms"), "events.at_ms"),
    )


def level_of(body: Mapping[str, Any], alert: Alert | None) -> str:
    if alert is not None:
        return (
            "info"
            if alert.state == "resolved"
            else ("critical" if alert.severity == "critical" else "warning")
        )
    level = body.get("level")
    return level if level in LEVELS else "info"


def message_of(body: Mapping[str, Any], alert: Alert | None) -> str:
    if alert is not None:
        return text(f"{alert.name} {alert.state}: {alert.annotations.get('summary', '')}", 2000)
    if isinstance(body.get("message"), str):
        return text(body["message"], 2000)
    step = body.get("delivery")
    if isinstance(step, dict):
        return text(f"{step.get('model')} v{step.get('version')}: {step.get('step')}", 2000)
    return text(dumps(body), 500)


def keep_event(tx: Tx, node: str, env: envelope.Envelope, arrived_ms: int) -> Event | None:
    """Store a node's event (and the alert it is); the event if it was new."""
    body = env.body
    alert = alert_of(body)
    priority = env.extra.get("priority")
    priority = priority if priority in ("alert", "event") else "event"
    kept = dumps(body)
    if len(kept) > MAX_EVENT_BODY:
        kept = dumps({"truncated": sorted(text(k, 64) for k in body)[:64]})
    event = Event(
        node,
        text(env.id, 64),
        env.ts,
        arrived_ms,
        env.seq,
        priority,
        level_of(body, alert),
        message_of(body, alert),
        json.loads(kept),
    )
    made = tx.execute(
        "INSERT INTO events (node, id, ts, arrived, priority, level, message, body)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        (node, event.id, event.ts, arrived_ms, priority, event.level, event.message, kept),
    )
    if made.rowcount != 1:
        return None  # seen before: a QoS 1 duplicate, or the outbox sent it again
    if alert is not None:
        tx.execute(
            "INSERT INTO alerts (node, fingerprint, alertname, severity, labels, annotations,"
            " state, starts_ms, ends_ms, changed_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (node, fingerprint) DO UPDATE SET severity = excluded.severity,"
            " annotations = excluded.annotations, state = excluded.state,"
            " starts_ms = excluded.starts_ms, ends_ms = excluded.ends_ms,"
            " changed_ms = excluded.changed_ms WHERE excluded.changed_ms > alerts.changed_ms",
            (
                node,
                alert.fingerprint,
                alert.name,
                alert.severity,
                dumps(alert.labels),
                dumps(alert.annotations),
                alert.state,
                alert.starts_ms,
                alert.changed_ms if alert.state == "resolved" else None,
                alert.changed_ms,
            ),
        )
    return event


def count_telemetry(tx: Tx, node: str, env: envelope.Envelope, arrived_ms: int) -> int:
    """Add a telemetry record's figures to the node's counters, once a record; how many
    counters it moved."""
    metrics = env.body.get("metrics")
    if not isinstance(metrics, dict):
        return 0  # what programs post
    rows = counter_rows(metrics)
    made = tx.execute(
        "INSERT INTO records (node, id, arrived) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        (node, text(env.id, 64), arrived_ms),
    )
    if made.rowcount != 1 or not rows:
        return 0
    ordered = sorted((node, name, labels, value) for (name, labels), value in rows.items())
    bucket = bucket_of(node)
    held = int(tx.rows("SELECT COUNT(*) AS n FROM counters WHERE node = ?", (node,))[0]["n"])
    if held + len(rows) <= MAX_NODE_COUNTERS:
        tx.executemany(
            "INSERT INTO counters (node, name, labels, value, bucket) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (node, name, labels) DO UPDATE SET"
            " value = counters.value + excluded.value",
            [(*row, bucket) for row in ordered],
        )
    else:  # the node's series are bounded: what it has goes on counting, nothing new
        log.warning("node %s: %d counters: no new series", node, held)
        tx.executemany(
            "UPDATE counters SET value = value + ? WHERE node = ? AND name = ? AND labels = ?",
            [(value, node, name, labels) for node, name, labels, value in ordered],
        )
    return len(rows)


def counter_rows(metrics: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """(sample name, labels as JSON) -> what to add, from a telemetry record's ``metrics``."""
    rows: dict[tuple[str, str], float] = {}

    def add(name: str, labels: dict[str, str], value: float) -> None:
        key = (name, dumps(labels))
        rows[key] = rows.get(key, 0.0) + value

    models = metrics.get("models") or []
    if not isinstance(models, list) or len(models) > MAX_ROWS:
        raise ValueError(f"telemetry.models: a list of at most {MAX_ROWS}")
    for row in models:
        row = _mapping(row, "telemetry.models[]")
        version = {"model": text(row.get("model"), 128), "version": text(row.get("version"), 32)}
        for outcome, n in _mapping(row.get("outcomes") or {}, "telemetry.outcomes").items():
            add(
                "edged_inference_requests_total",
                {**version, "outcome": text(outcome, 32)},
                _count(n, "telemetry.outcomes"),
            )
        buckets = _mapping(row.get("buckets") or {}, "telemetry.buckets")
        for le, n in buckets.items():
            if le != "+Inf" and not math.isfinite(_le(le)):
                raise ValueError(f"telemetry.buckets: {text(le, 40)} is not a bound")
            add(
                "edged_inference_request_duration_seconds_bucket",
                {**version, "le": le},
                _count(n, "telemetry.buckets"),
            )
        if buckets:
            seconds = row.get("seconds", 0.0)
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))
                or not (0 <= seconds < 1e12)
            ):
                raise ValueError("telemetry.seconds: a number of seconds")
            add("edged_inference_request_duration_seconds_sum", version, float(seconds))
            add(
                "edged_inference_request_duration_seconds_count",
                version,
                _count(buckets.get("+Inf", 0), "telemetry.buckets"),
            )
    for model, routes in _mapping(metrics.get("routes") or {}, "telemetry.routes").items():
        for route, n in _mapping(routes, "telemetry.routes[]").items():
            add(
                "edged_route_decisions_total",
                {"model": text(model, 128), "route": text(route, 32)},
                _count(n, "telemetry.routes"),
            )
    for model, arms in _mapping(metrics.get("cloud") or {}, "telemetry.cloud").items():
        for arm, figures in _mapping(arms, "telemetry.cloud[]").items():
            figures = _mapping(figures, "telemetry.cloud[][]")
            outcomes = figures.get("outcomes")
            if outcomes is None:  # a node before outcomes: its errors and the rest
                requests = _count(figures.get("requests", 0), "telemetry.cloud.requests")
                errors = _count(figures.get("errors", 0), "telemetry.cloud.errors")
                outcomes = {"error": errors, "success": max(0, requests - errors)}
            for outcome, n in _mapping(outcomes, "telemetry.cloud.outcomes").items():
                labels = {
                    "model": text(model, 128),
                    "cloud_model": text(arm, 128),
                    "outcome": text(outcome, 32),
                }
                add("edged_cloud_requests_total", labels, _count(n, "telemetry.cloud"))
    for model, arms in _mapping(metrics.get("cloud_ab") or {}, "telemetry.cloud_ab").items():
        for arm, figures in _mapping(arms, "telemetry.cloud_ab[]").items():
            figures = _mapping(figures, "telemetry.cloud_ab[][]")
            calls = _count(figures.get("calls", 0), "telemetry.cloud_ab.calls")
            good = _count(figures.get("good", 0), "telemetry.cloud_ab.good")
            if good > calls:
                raise ValueError("telemetry.cloud_ab.good: more good calls than calls")
            labels = {"model": text(model, 128), "cloud_model": text(arm, 128)}
            add("edged_cloud_ab_calls_total", {**labels, "good": "true"}, good)
            add("edged_cloud_ab_calls_total", {**labels, "good": "false"}, calls - good)
    return rows


def _le(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


class EventLog:
    """Nodes' events as ECS JSON lines (Elastic Common Schema, by Elastic's ecs-logging), one
    per event, in a file a shipper tails (reopened when logrotate moves it) or on stdout
    (``-``): the node (``host.name``), the fleet (``labels.fleet``), the request
    (``http.request.id``, as edged's own logs), the record's id (``event.id``), when it happened
    (``@timestamp``) and when the service got it (``event.ingested``)."""

    def __init__(self, path: str, fleet: str) -> None:
        self.fleet = fleet
        handler: logging.Handler
        if path == "-":
            handler = logging.StreamHandler(sys.stdout)
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            handler = logging.handlers.WatchedFileHandler(path, encoding="utf-8")
        handler.setFormatter(
            ecs_logging.StdlibFormatter(
                exclude_fields=("log.origin", "process", "log.original"), ensure_ascii=False
            )
        )
        self.logger = logging.Logger("edgefleet.device-events")  # not the service's own log
        self.logger.addHandler(handler)
        self.handler = handler

    def write(self, event: Event) -> None:
        level = logging.getLevelName(event.level.upper())
        record = self.logger.makeRecord(
            str(event.body.get("source") or event.body.get("from") or "device"),
            level if isinstance(level, int) else logging.INFO,
            "",
            0,
            "%s",
            (event.message,),
            None,
        )
        record.created = event.ts / 1000
        record.msecs = event.ts % 1000
        fields: dict[str, Any] = {
            "host.name": event.node,
            "labels.fleet": self.fleet,
            "event.id": event.id,
            "event.kind": "alert" if event.priority == "alert" else "event",
            "event.dataset": "edgefleet.device",
            "event.sequence": event.seq,
            "event.ingested": iso(event.arrived),
        }
        if isinstance(event.body.get("request_id"), str):
            fields["http.request.id"] = event.body["request_id"]
        for key in ("model", "route", "reason"):
            if isinstance(event.body.get(key), str):
                fields[f"edged.{key}"] = event.body[key]
        alert = event.body.get("alert")
        if isinstance(alert, str):
            fields["rule.name"] = alert
            fields["event.action"] = str(event.body.get("state") or "raised")
        step = event.body.get("delivery")
        if isinstance(step, dict):
            fields["event.action"] = f"delivery {text(step.get('step'), 32)}"
        for key, value in fields.items():
            setattr(record, key, value)
        self.logger.handle(record)

    def close(self) -> None:
        self.handler.close()


def iso(ms: int) -> str:
    """Milliseconds since the epoch as RFC 3339, UTC (``2026-12-04T21:03:11.120Z``)."""
    at = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def prune(tx: Tx, now_ms: int, keep_ms: int) -> int:
    """Events and resolved alerts older than ``keep_ms`` forgotten, and telemetry record ids
    older than a day (a record the outbox sends again comes within hours): how many rows."""
    done = tx.execute("DELETE FROM events WHERE arrived < ?", (now_ms - keep_ms,)).rowcount
    done += tx.execute(
        "DELETE FROM alerts WHERE state = 'resolved' AND ends_ms < ?", (now_ms - keep_ms,)
    ).rowcount
    return int(
        done + tx.execute("DELETE FROM records WHERE arrived < ?", (now_ms - 86_400_000,)).rowcount
    )
