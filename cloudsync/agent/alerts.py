"""Alerts, defined once: as Prometheus alerting rules for the fleet's Prometheus
(docs/monitoring/edged-alerts.rules.yml is generated from ``RULES``), and evaluated on the device
by the agent, so that they fire while the node is offline and reach the fleet as events through
the outbox when it is back.

Each rule has its PromQL expression and the same condition over the device's own figures
(``Facts``, read every heartbeat interval). Evaluation follows Prometheus: a condition that
holds makes its alert *pending*; held for the rule's ``for`` it *fires*; when it stops holding
the alert is *resolved*. A rule may hold for several label sets at once (a rollback per model).
The thresholds come from ``[alerts]`` in cloudsync.toml; the shipped rules use the defaults.

    python -m cloudsync.agent.alerts > docs/monitoring/edged-alerts.rules.yml
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cloudsync.agent.config import AlertsConfig

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
Active = dict[Labels, float]  # the label sets a rule holds for now, with the value seen


@dataclass
class Facts:
    """What the device knows at one evaluation (None: it cannot tell now)."""

    at: float  # time.monotonic()
    epoch: str = ""  # edged's run (its counters start again with a new one)
    local_load: float | None = None  # edged_local_load_ratio
    cloud_errors: float | None = None  # edged_cloud_requests_total{outcome="error"}, summed
    cloud_calls: float | None = None  # edged_cloud_requests_total, summed
    edged_up: bool = True
    offline_s: float = 0.0  # how long the broker has been unreachable (0: connected)
    outbox_age_s: float | None = None  # the oldest record waiting
    rollbacks: dict[str, float] = field(default_factory=dict)  # model -> seconds since the last


@dataclass
class History:
    """Counter samples over the rate window (Prometheus' range vector)."""

    samples: deque[tuple[float, float, float]] = field(default_factory=deque)  # at, errors, calls
    epoch: str = ""  # the run of edged the samples are from

    def error_ratio(self, facts: Facts, window: float) -> float | None:
        """Errors over calls between the oldest sample in the window and now; None when no
        call was made (Prometheus: 0/0 is NaN, which no comparison holds for)."""
        if facts.cloud_errors is None or facts.cloud_calls is None:
            self.samples.clear()
            return None
        if facts.epoch != self.epoch or (self.samples and facts.cloud_calls < self.samples[-1][2]):
            self.samples.clear()  # edged restarted: its counters start again (as rate() does)
            self.epoch = facts.epoch
        self.samples.append((facts.at, facts.cloud_errors, facts.cloud_calls))
        while len(self.samples) > 2 and facts.at - self.samples[1][0] >= window:
            self.samples.popleft()
        _, errors, calls = self.samples[0]
        if facts.cloud_calls <= calls:
            return None
        return (facts.cloud_errors - errors) / (facts.cloud_calls - calls)


@dataclass(frozen=True)
class Rule:
    """One alert: its PromQL and its condition on the device."""

    name: str
    severity: str
    summary: str  # may name {threshold}, {threshold_duration} and {for}
    description: str
    expr: str  # PromQL; {threshold} and {window} are filled in from the config
    check: Callable[[Facts, AlertsConfig, History], Active]
    threshold: str = ""  # the AlertsConfig field compared with
    hold: str = ""  # the AlertsConfig field giving ``for``
    window: str = ""  # the AlertsConfig field giving the range of rate()

    def promql(self, config: AlertsConfig) -> str:
        window = _duration(getattr(config, self.window)) if self.window else ""
        return self.expr.format(threshold=f"{self._threshold(config):g}", window=window)

    def for_s(self, config: AlertsConfig) -> float:
        return float(getattr(config, self.hold)) if self.hold else 0.0

    def _threshold(self, config: AlertsConfig) -> float:
        return float(getattr(config, self.threshold)) if self.threshold else 0.0

    def texts(self, config: AlertsConfig) -> tuple[str, str]:
        """The summary and the description, with the figures of ``config``."""
        threshold = self._threshold(config)
        summary = self.summary.format(
            threshold=threshold,
            threshold_duration=_duration(threshold),
            **{"for": _duration(self.for_s(config))},
        )
        return summary, self.description


def _when(holds: bool, value: float | None) -> Active:
    return {(): float(value or 0.0)} if holds else {}


def _load(f: Facts, c: AlertsConfig, h: History) -> Active:
    return _when(f.local_load is not None and f.local_load > c.local_load_ratio, f.local_load)


def _cloud(f: Facts, c: AlertsConfig, h: History) -> Active:
    ratio = h.error_ratio(f, c.window_s)
    return _when(ratio is not None and ratio > c.cloud_error_ratio, ratio)


def _offline(f: Facts, c: AlertsConfig, h: History) -> Active:
    return _when(f.offline_s > 0, f.offline_s)


def _edged(f: Facts, c: AlertsConfig, h: History) -> Active:
    return _when(not f.edged_up, 0.0)


def _outbox(f: Facts, c: AlertsConfig, h: History) -> Active:
    age = f.outbox_age_s
    return _when(age is not None and age > c.outbox_max_age_s, age)


def _rollbacks(f: Facts, c: AlertsConfig, h: History) -> Active:
    return {
        (("model", model),): ago for model, ago in f.rollbacks.items() if ago < c.rollback_window_s
    }


RULES = (
    Rule(
        "EdgedLocalLoadHigh",
        "warning",
        "Local load above {threshold:.0%} for {for}",
        "The busier of CPU and GPU has been above the threshold: routing sends work to the"
        " cloud where it may, and local answers slow down. Look at the routes and the queues.",
        "edged_local_load_ratio > {threshold}",
        _load,
        threshold="local_load_ratio",
        hold="for_s",
    ),
    Rule(
        "EdgedCloudErrorsHigh",
        "warning",
        "Cloud calls failing above {threshold:.0%} for {for}",
        "Calls to the cloud tier fail: the circuit breaker may be open and work falls back to"
        " the device. Check the gateway, the cloud server and the link.",
        "sum without (model, cloud_model, outcome)"
        ' (rate(edged_cloud_requests_total{{outcome="error"}}[{window}]))'
        " / sum without (model, cloud_model, outcome)"
        " (rate(edged_cloud_requests_total[{window}])) > {threshold}",
        _cloud,
        threshold="cloud_error_ratio",
        hold="for_s",
        window="window_s",
    ),
    Rule(
        "NodeOffline",
        "critical",
        "The node has been out of the fleet for {for}",
        "The node's MQTT connection to the fleet's broker is down (on the device: the broker is"
        " unreachable). Telemetry and events wait in the node's outbox and arrive when it is"
        " back.",
        'cloudsync_mqtt_connected == 0 or up{{job="cloudsync"}} == 0',
        _offline,
        hold="offline_for_s",
    ),
    Rule(
        "EdgedUnreachable",
        "critical",
        "cloudsync has not reached edged for {for}",
        "edged does not answer on its socket: it is stopped, restarting or stuck (systemd's"
        " watchdog restarts a stuck one). Look at its journal.",
        'cloudsync_edged_up == 0 or up{{job="edged"}} == 0',
        _edged,
        hold="for_s",
    ),
    Rule(
        "OutboxStale",
        "warning",
        "Records have waited in the outbox for over {threshold_duration}",
        "The oldest record in the node's outbox is older than the threshold: the node has been"
        " offline for long, or the broker refuses its records. The outbox drops telemetry"
        " past its TTL and everything past its disk budget.",
        "cloudsync_outbox_oldest_age_seconds > {threshold}",
        _outbox,
        threshold="outbox_max_age_s",
    ),
    Rule(
        "ModelRolledBack",
        "warning",
        "A model version was rolled back on the node in the last {threshold_duration}",
        "A model version was taken back (its health watch saw it fail more than the version"
        " before, or an operator rolled it back). The delivery events say why.",
        "time() - cloudsync_model_last_rollback_timestamp_seconds < {threshold}",
        _rollbacks,
        threshold="rollback_window_s",
    ),
)


def _duration(seconds: float) -> str:
    """Prometheus' duration: 5m, 1h, 90s."""
    whole = int(seconds)
    for unit, size in (("h", 3600), ("m", 60)):
        if whole and whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


@dataclass
class Alert:
    """One alert instance (a rule and a label set) and where it stands."""

    rule: Rule
    labels: Labels
    since: float  # when the condition began to hold (monotonic)
    value: float
    firing: bool = False


class Evaluator:
    """The rules over successive ``Facts``; ``evaluate`` returns what changed."""

    def __init__(self, config: AlertsConfig, rules: Iterable[Rule] = RULES) -> None:
        self.config = config
        self.rules = tuple(rules)
        self.history = {rule.name: History() for rule in self.rules}
        self.alerts: dict[tuple[str, Labels], Alert] = {}

    def evaluate(self, facts: Facts) -> list[tuple[str, Alert]]:
        """("firing" | "resolved", alert) for each alert that changed state now."""
        changes: list[tuple[str, Alert]] = []
        for rule in self.rules:
            active = rule.check(facts, self.config, self.history[rule.name])
            for labels, value in active.items():
                alert = self.alerts.setdefault(
                    (rule.name, labels), Alert(rule, labels, facts.at, value)
                )
                alert.value = value
                if not alert.firing and facts.at - alert.since >= rule.for_s(self.config):
                    alert.firing = True
                    changes.append(("firing", alert))
            for key in [k for k in self.alerts if k[0] == rule.name and k[1] not in active]:
                alert = self.alerts.pop(key)
                if alert.firing:
                    changes.append(("resolved", alert))
        return changes

    def firing(self) -> list[Alert]:
        """The alerts firing now (a copy: scrapes read it from other threads)."""
        return [a for a in list(self.alerts.values()) if a.firing]

    def saved(self, now: float, now_ms: int) -> str:
        """The firing alerts as text, kept in the outbox's state with their events: after a
        restart the first evaluation resolves what no longer holds, and does not fire again
        what still does."""
        return json.dumps(
            [
                {
                    "alert": a.rule.name,
                    "labels": list(map(list, a.labels)),
                    "since_ms": now_ms - int((now - a.since) * 1000),
                    "value": a.value,
                }
                for a in self.firing()
            ]
        )

    def restore(self, text: str | None, now: float, now_ms: int) -> None:
        """The alerts ``saved`` by the agent's previous run, firing again (not announced)."""
        rules = {rule.name: rule for rule in self.rules}
        for doc in json.loads(text or "[]"):
            rule = rules.get(doc["alert"])
            if rule is not None:
                labels = tuple((str(k), str(v)) for k, v in doc["labels"])
                since = now - (now_ms - doc["since_ms"]) / 1000
                self.alerts[(rule.name, labels)] = Alert(rule, labels, since, doc["value"], True)

    def event(self, state: str, alert: Alert, now_ms: int, since_ms: int) -> dict[str, Any]:
        """An alert's change as the body of an ``events`` record."""
        summary, description = alert.rule.texts(self.config)
        return {
            "alert": alert.rule.name,
            "state": state,
            "severity": alert.rule.severity,
            "labels": dict(alert.labels),
            "value": round(alert.value, 6),
            "summary": summary,
            "description": description,
            "active_since_ms": since_ms,
            "at_ms": now_ms,
        }


def record_id(body: dict[str, Any]) -> str:
    """The outbox id of an alert's change: the same change is stored once."""
    key = json.dumps([body["alert"], body["labels"], body["state"], body["active_since_ms"]])
    return "alert-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _quoted(text: str) -> str:
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def prometheus_rules(config: AlertsConfig | None = None) -> str:
    """``RULES`` as a Prometheus rule file (YAML)."""
    config = config or AlertsConfig()
    lines = [
        "# Generated by `python -m cloudsync.agent.alerts` from cloudsync/agent/alerts.py: edit",
        "# that, not this. The same alerts are evaluated on each device (cloudsync, [alerts]).",
        "groups:",
        "  - name: edged",
        "    rules:",
    ]
    for rule in RULES:
        summary, description = rule.texts(config)
        lines += [f"      - alert: {rule.name}", f"        expr: {_quoted(rule.promql(config))}"]
        if rule.for_s(config):
            lines.append(f"        for: {_duration(rule.for_s(config))}")
        lines += [
            "        labels:",
            f"          severity: {rule.severity}",
            "        annotations:",
            f"          summary: {_quoted(summary)}",
            f"          description: {_quoted(description)}",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(prometheus_rules())
