"""The alerts, both ways: the shipped Prometheus rules (checked and unit-tested by the real
promtool) and the device's evaluator (cloudsync.agent.alerts) fire at the same minutes on the same
series."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from cloudsync.agent.alerts import RULES, Evaluator, Facts, prometheus_rules, record_id
from cloudsync.agent.config import AlertsConfig
from tests.conftest import skip_or_fail

ROOT = Path(__file__).resolve().parents[4]
RULES_FILE = ROOT / "docs" / "monitoring" / "edged-alerts.rules.yml"
PROMTOOL = Path(
    os.environ.get("PROMTOOL", ROOT / "build" / "promtool" / "usr" / "bin" / "promtool")
)
MINUTES = 12


def promtool() -> Path:
    if not PROMTOOL.is_file():
        skip_or_fail(f"promtool is not at {PROMTOOL} (make {PROMTOOL.relative_to(ROOT)})")
    return PROMTOOL


# Each scenario: a rule, series sampled every minute (a value per minute, None: no sample),
# and the minutes at which the rule's alert must be firing (for each label set, by model).
SCENARIOS: list[tuple[str, dict[str, list[float | None]], dict[str, list[int]]]] = [
    ("EdgedLocalLoadHigh", {"edged_local_load_ratio": [0.95] * MINUTES}, {"": [5, 6, 11]}),
    ("EdgedLocalLoadHigh", {"edged_local_load_ratio": [0.85] * MINUTES}, {"": []}),
    (  # up for 4 minutes, a dip, then 5 minutes more: the dip restarts the 5 minutes
        "EdgedLocalLoadHigh",
        {"edged_local_load_ratio": [0.95] * 4 + [0.5] + [0.95] * 7},
        {"": [10, 11]},
    ),
    (  # 10% of calls fail: a 5m rate needs 2 samples, so pending from minute 1, firing at 6
        "EdgedCloudErrorsHigh",
        {
            'edged_cloud_requests_total{outcome="error"}': [10.0 * m for m in range(MINUTES)],
            'edged_cloud_requests_total{outcome="success"}': [90.0 * m for m in range(MINUTES)],
        },
        {"": [6, 7, 11]},
    ),
    (
        "EdgedCloudErrorsHigh",
        {
            'edged_cloud_requests_total{outcome="error"}': [2.0 * m for m in range(MINUTES)],
            'edged_cloud_requests_total{outcome="success"}': [98.0 * m for m in range(MINUTES)],
        },
        {"": []},
    ),
    ("NodeOffline", {"cloudsync_mqtt_connected": [1.0] * 2 + [0.0] * 10}, {"": [7, 8, 11]}),
    ("NodeOffline", {"cloudsync_mqtt_connected": [1.0, 0.0, 0.0, 0.0, 1.0] * 2 + [1, 1]}, {"": []}),
    ("EdgedUnreachable", {"cloudsync_edged_up": [0.0] * MINUTES}, {"": [5, 11]}),
    (
        "OutboxStale",
        {"cloudsync_outbox_oldest_age_seconds": [3300.0 + 60 * m for m in range(MINUTES)]},
        {"": [6, 7, 11]},
    ),
    (  # a rollback of "ocr" at minute 2 (at 120 s): firing for 10 minutes
        "ModelRolledBack",
        {'cloudsync_model_last_rollback_timestamp_seconds{model="ocr"}': [None] * 2 + [120.0] * 10},
        {"ocr": [2, 3, 11]},
    ),
]


def device_firing(rule: str, series: dict[str, list[float | None]]) -> dict[str, list[int]]:
    """The minutes at which the device's evaluator has the rule firing, per model label."""
    evaluator = Evaluator(AlertsConfig(), [r for r in RULES if r.name == rule])
    offline_since: float | None = None
    firing: dict[str, list[int]] = {}
    for minute in range(MINUTES):
        at = 60.0 * minute
        value = {name: values[minute] for name, values in series.items()}
        facts = Facts(at)
        facts.local_load = value.get("edged_local_load_ratio")
        errors = value.get('edged_cloud_requests_total{outcome="error"}')
        success = value.get('edged_cloud_requests_total{outcome="success"}')
        if errors is not None and success is not None:
            facts.cloud_errors, facts.cloud_calls = errors, errors + success
        if value.get("cloudsync_mqtt_connected") == 0.0:
            offline_since = at if offline_since is None else offline_since
        elif "cloudsync_mqtt_connected" in value:
            offline_since = None
        facts.offline_s = 0.0 if offline_since is None else at - offline_since + 1e-9
        facts.edged_up = value.get("cloudsync_edged_up", 1.0) == 1.0
        facts.outbox_age_s = value.get("cloudsync_outbox_oldest_age_seconds")
        for name, found in value.items():
            model = re.search(r'model="(\w+)"', name)
            if model and found is not None:
                facts.rollbacks[model.group(1)] = at - found  # seconds since
        evaluator.evaluate(facts)
        for alert in evaluator.firing():
            firing.setdefault(dict(alert.labels).get("model", ""), []).append(minute)
    return firing


@pytest.mark.parametrize(("rule", "series", "expected"), SCENARIOS)
def test_the_device_fires_where_the_scenario_says(
    rule: str, series: dict[str, list[float | None]], expected: dict[str, list[int]]
) -> None:
    found = device_firing(rule, series)
    for labels, minutes in expected.items():
        assert all(m in found.get(labels, []) for m in minutes), (labels, found)
        first = min(minutes, default=MINUTES)
        assert all(m >= first for m in found.get(labels, [])), (labels, found)


def test_prometheus_fires_at_the_same_minutes_as_the_device(tmp_path: Path) -> None:
    """The same scenarios as a promtool rule unit test: every minute, the alerts promtool
    expects are exactly those the device's evaluator has firing."""
    texts = {rule.name: rule.texts(AlertsConfig()) for rule in RULES}
    tests = []
    for rule, series, _ in SCENARIOS:
        input_series = [
            {
                "series": name if "{" in name else name + "{}",
                "values": " ".join("_" if v is None else repr(v) for v in values),
            }
            for name, values in series.items()
        ]
        found = device_firing(rule, series)
        checks = []
        for minute in range(MINUTES):
            expected = []
            for model, minutes in found.items():
                if minute in minutes:
                    labels = {"severity": next(r.severity for r in RULES if r.name == rule)}
                    labels |= {"model": model} if model else {}
                    summary, description = texts[rule]
                    expected.append(
                        {
                            "exp_labels": labels,
                            "exp_annotations": {"summary": summary, "description": description},
                        }
                    )
            checks.append({"eval_time": f"{minute}m", "alertname": rule, "exp_alerts": expected})
        tests.append({"interval": "1m", "input_series": input_series, "alert_rule_test": checks})
    spec = tmp_path / "alerts.test.yml"  # JSON is YAML
    spec.write_text(json.dumps({"rule_files": [str(RULES_FILE)], "tests": tests}, indent=1))
    result = subprocess.run(
        [promtool(), "test", "rules", spec], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_on_the_fleet_services_series(tmp_path: Path) -> None:
    """The series as the fleet service exports them (``instance``, ``fleet``, the scrape job
    ``edgefleet``; cloudsync.fleet.exporter): a node at 95 % load fires EdgedLocalLoadHigh at
    minute 5 with its labels; when it goes offline at minute 7 its load series ends (a stale
    marker, not a frozen value: the alert resolves at once) and ``cloudsync_mqtt_connected 0``
    fires NodeOffline 5 minutes later."""
    node = 'instance="sim-00001", fleet="f1", job="edgefleet"'
    # the scrape after the node goes has no load: Prometheus writes a stale marker
    load = " ".join(["0.95"] * 7 + ["stale"] + ["_"] * 8)
    connected = " ".join(["1"] * 7 + ["0"] * 9)
    labels = {"instance": "sim-00001", "fleet": "f1", "job": "edgefleet"}
    texts = {rule.name: rule.texts(AlertsConfig()) for rule in RULES}

    def alert(name: str, severity: str) -> list[dict[str, object]]:
        summary, description = texts[name]
        return [
            {
                "exp_labels": {**labels, "severity": severity},
                "exp_annotations": {"summary": summary, "description": description},
            }
        ]

    checks = [
        {"eval_time": "4m", "alertname": "EdgedLocalLoadHigh", "exp_alerts": []},
        {
            "eval_time": "5m",
            "alertname": "EdgedLocalLoadHigh",
            "exp_alerts": alert("EdgedLocalLoadHigh", "warning"),
        },
        {"eval_time": "7m", "alertname": "EdgedLocalLoadHigh", "exp_alerts": []},
        {"eval_time": "11m", "alertname": "NodeOffline", "exp_alerts": []},
        {
            "eval_time": "12m",
            "alertname": "NodeOffline",
            "exp_alerts": alert("NodeOffline", "critical"),
        },
    ]
    spec = tmp_path / "fleet.test.yml"
    spec.write_text(
        json.dumps(
            {
                "rule_files": [str(RULES_FILE)],
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [
                            {"series": f"edged_local_load_ratio{{{node}}}", "values": load},
                            {"series": f"cloudsync_mqtt_connected{{{node}}}", "values": connected},
                        ],
                        "alert_rule_test": checks,
                    }
                ],
            }
        )
    )
    result = subprocess.run(
        [promtool(), "test", "rules", spec], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_shipped_rules_are_the_generated_ones_and_promtool_accepts_them() -> None:
    assert RULES_FILE.read_text() == prometheus_rules(), "run: make monitoring"
    result = subprocess.run(
        [promtool(), "check", "rules", RULES_FILE], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in result.stdout


def test_an_alert_fires_once_resolves_once_and_its_record_ids_are_stable() -> None:
    config = AlertsConfig(for_s=2.0)
    evaluator = Evaluator(config)
    states, bodies = [], []
    for second, load in enumerate([0.95, 0.95, 0.95, 0.97, 0.2, 0.2]):
        for state, alert in evaluator.evaluate(Facts(float(second), local_load=load)):
            states.append((state, alert.rule.name, alert.value))
            bodies.append(evaluator.event(state, alert, second * 1000, 0))
    assert states == [
        ("firing", "EdgedLocalLoadHigh", 0.95),
        ("resolved", "EdgedLocalLoadHigh", 0.97),  # the last value seen while it held
    ]
    body = bodies[0]
    assert body["summary"] == "Local load above 90% for 2s"
    assert record_id(body) == record_id(dict(body, value=0.5))  # same change, same record
    assert record_id(body) != record_id(dict(body, state="resolved"))


def test_an_edged_restart_does_not_read_as_a_burst_of_cloud_errors() -> None:
    evaluator = Evaluator(AlertsConfig(for_s=0.0, window_s=60.0))
    fired = []
    # edged "a" made 1000 calls; edged "b" made 1100 by the next read (1% failed): its counters
    # start from 0, so the difference with "a"'s would read as 11 errors in 100 calls
    reads = [("a", 0, 1000), ("a", 1, 1100), ("b", 11, 1100), ("b", 12, 1200)]
    for t, (epoch, errors, calls) in enumerate(reads):
        facts = Facts(10.0 * t, epoch, cloud_errors=float(errors), cloud_calls=float(calls))
        fired += evaluator.evaluate(facts)
    assert fired == []


def test_alerts_firing_survive_a_restart_resolved_once_not_fired_twice() -> None:
    config = AlertsConfig(offline_for_s=1.0)
    before = Evaluator(config)
    assert before.evaluate(Facts(100.0, offline_s=0.5)) == []
    assert [s for s, _ in before.evaluate(Facts(101.0, offline_s=1.5))] == ["firing"]
    saved = before.saved(101.0, 50_000)
    # the agent starts again (its monotonic clock too): still offline, then back
    after = Evaluator(config)
    after.restore(saved, 7.0, 52_000)
    (alert,) = after.firing()
    assert alert.rule.name == "NodeOffline" and alert.since == pytest.approx(7.0 - 3.0)
    assert after.evaluate(Facts(8.0, offline_s=0.2)) == []  # holds: not announced again
    assert [s for s, _ in after.evaluate(Facts(9.0))] == ["resolved"]
    assert after.firing() == [] and json.loads(after.saved(9.0, 54_000)) == []
