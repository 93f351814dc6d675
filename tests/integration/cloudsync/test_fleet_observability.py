"""Seeing the fleet through the fleet service (issue 25), with real parts only: a real Mosquitto
(TLS, ACLs), the real ``edgefleet serve``, Debian's Prometheus scraping it and Debian's
Alertmanager taking its alerts, a real cloudsync and a real edged, all started here on loopback.

- Prometheus: a node's load and latency series are queryable within one scrape of the heartbeat
  that carries them (by Prometheus' own sample times), the shipped alert rules evaluate on the
  fleet path (EdgedLocalLoadHigh pending on a node at 95 %; promtool's rule tests in
  tests/unit/test_alerts.py time the 5 minutes), the dashboard's queries answer with the node's
  series, and an offline node's series end.
- Alertmanager: alerts a real cloudsync raises while the broker is down appear after the
  reconnect, once, with the node's labels, and resolve when the device resolves them; the
  webhook Alertmanager routes to is paged once per change.
- The ECS lines: edged's events, with the node, the fleet and the request's id.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloudsync.protocol.envelope import Envelope
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics
from tests.cloudsync_agent import Agent
from tests.conftest import Daemon, wait_for
from tests.fleetservice import TOKENS, FleetService
from tests.mosquitto import OPERATOR, Broker
from tests.prometheus import Alertmanager, Pages, Prometheus
from tests.unit.test_dashboard import DASHBOARD, to_promql

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "docs" / "monitoring" / "edged-alerts.rules.yml"
NODE = "sim-00001"

SENT = 'edgefleet_alertmanager_pushes_total{outcome="sent"}'  # the service's sends


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    yield broker
    broker.kill()


class Node:
    """A simulated node: what cloudsync would publish, with the figures the test chooses (the
    operator's certificate may write every node's topics)."""

    def __init__(self, broker: Broker, name: str = NODE) -> None:
        self.client = SyncClient(broker.port, broker.pki, OPERATOR, client_id=f"as-{name}")
        assert self.client.connect()
        self.topics, self.name, self.seq = Topics("f1", name), name, 0

    def publish(self, topic: str, body: dict[str, Any], retain: bool = False, **extra: Any) -> int:
        self.seq += 1
        ts = int(time.time() * 1000)
        payload = Envelope(self.name, self.seq, body, ts=ts, extra=extra).encode()
        info = self.client.client.publish(topic, payload, 1, retain)
        info.wait_for_publish(10)
        assert info.is_published()
        return ts

    def birth(self) -> None:
        self.publish(
            self.topics.status,
            {
                "state": "online",
                "labels": {"site": "berlin"},
                "software": {"cloudsync": "9.9", "edged": "9.9"},
            },
            retain=True,
        )

    def heartbeat(self, cpu: float, rtt_s: float) -> int:
        return self.publish(
            self.topics.heartbeat,
            {
                "load": {"cpu_percent": cpu, "memory_total": 8 << 30, "memory_available": 6 << 30},
                "link": {"up": True, "rtt_s": rtt_s, "rtt_p50_s": rtt_s, "rtt_p95_s": 2 * rtt_s},
                "breaker": "closed",
                "cloud_error_ratio": 0.0,
                "inflight": 1,
                "models": {"intent-classifier": "1"},
                "edged": {"reachable": True, "error": ""},
                "outbox": {
                    "depth": {"alert": 0, "event": 0, "telemetry": 0},
                    "bytes": 0,
                    "budget_bytes": 1 << 20,
                    "dead_letters": 0,
                    "disk_full": False,
                    "counters": {},
                    "oldest_age_s": None,
                },
            },
        )

    def telemetry(self, n: int, ident: str) -> None:
        row = {
            "model": "intent-classifier",
            "version": "1",
            "requests": n,
            "errors": 0,
            "outcomes": {"success": n},
            "buckets": {"0.01": n // 2, "0.05": n, "+Inf": n},
            "seconds": 0.02 * n,
        }
        body = {"metrics": {"models": [row], "routes": {"intent-classifier": {"local": n}}}}
        self.publish(self.topics.telemetry, body, id=ident, epoch="e1", priority="telemetry")

    def close(self) -> None:
        self.client.close()


def sample_ms(prom: Prometheus, expr: str, value: float) -> int | None:
    """When Prometheus scraped the sample of ``expr`` that has ``value`` (None: not yet)."""
    for row in prom.query(f"timestamp({expr}) and ({expr}) == {value}"):
        return int(float(row["value"][1]) * 1000)
    return None


def test_prometheus_sees_each_node_through_the_service(tmp_path: Path, broker: Broker) -> None:
    service = FleetService(tmp_path / "service", broker).start()
    prom = Prometheus(
        tmp_path / "prom",
        f"127.0.0.1:{service.port}",
        TOKENS["viewer"],
        interval_s=1.0,
        rules=[RULES],
    ).start()
    node = Node(broker)
    try:
        node.birth()
        node.heartbeat(95.0, 0.042)
        node.telemetry(40, "t1")
        loaded = f'edged_local_load_ratio{{instance="{NODE}", fleet="f1"}}'
        wait_for(lambda: prom.query(loaded), 30, "the node's load in Prometheus")
        [target] = prom.targets()
        assert target["health"] == "up", target
        assert service.call("GET", "/v1/fleet/metrics", role=None)[0] == 401  # a viewer's
        # within one scrape: the first scrape after the heartbeat is in the database has it
        sent = node.heartbeat(97.0, 0.05)
        wait_for(
            lambda: (
                service.call("GET", f"/v1/nodes/{NODE}")[1]["heartbeat"]["load"]["cpu_percent"]
                == 97.0
            ),
            10,
            "the heartbeat stored",
        )
        stored = int(time.time() * 1000)
        wait_for(lambda: sample_ms(prom, loaded, 0.97), 10, "the new load scraped")
        scraped = sample_ms(prom, loaded, 0.97)
        assert scraped is not None and scraped - stored <= 1000 + 250, (sent, stored, scraped)
        rtt = prom.query(f'edged_cloud_link_rtt_seconds{{instance="{NODE}"}}')
        assert {r["metric"]["statistic"]: float(r["value"][1]) for r in rtt} == {
            "ewma": 0.05,
            "p50": 0.05,
            "p95": 0.1,
        }
        # latency, from telemetry: the histogram the dashboard's quantiles read
        node.telemetry(60, "t2")
        bucket = (
            f'edged_inference_request_duration_seconds_bucket{{instance="{NODE}",'
            f' model="intent-classifier", version="1", le="0.01"}}'
        )
        wait_for(lambda: sample_ms(prom, bucket, 50), 10, "two records added up")
        p95 = prom.query(
            "histogram_quantile(0.95, sum by (instance, model, le) (rate("
            f'edged_inference_request_duration_seconds_bucket{{instance="{NODE}"}}[30s])))'
        )
        assert p95 and 0.01 < float(p95[0]["value"][1]) <= 0.05
        # the shipped rules evaluate on this path: load > 90 % is pending (its 5 minutes are
        # promtool's to time), and the node is connected
        pending = f'ALERTS{{alertname="EdgedLocalLoadHigh", instance="{NODE}"}}'
        wait_for(lambda: prom.query(pending), 10, "EdgedLocalLoadHigh pending")
        [alert] = prom.query(pending)
        assert alert["metric"]["alertstate"] == "pending" and alert["metric"]["fleet"] == "f1"
        assert not prom.query(f'ALERTS{{alertname="NodeOffline", instance="{NODE}"}}')
        # the dashboard's queries, as Grafana sends them for this node, answer
        answered = dashboard_answers(prom)
        for panel in (
            "Local load",
            "CPU and GPU utilization",
            "Memory used",
            "Latency p50 / p95 / p99 by model",
            "Requests by model and outcome",
            "Link round-trip time",
            "Link and circuit breaker",
            "Model versions",
            "Node status",
            "Outbox records by priority",
            "Decisions by route",
        ):
            assert answered[panel], f"{panel}: no series through the service"
        # the node goes: its figures end (no frozen load), its connection says 0
        node.publish(
            node.topics.status, {"state": "offline", "reason": "connection lost"}, retain=True
        )
        wait_for(lambda: not prom.query(loaded), 15, "the load series ended")
        connected = prom.query(f'cloudsync_mqtt_connected{{instance="{NODE}"}}')
        assert [float(r["value"][1]) for r in connected] == [0.0]
        info = prom.query(f'edgefleet_node_info{{instance="{NODE}"}}')
        assert info[0]["metric"]["state"] == "offline"
        assert info[0]["metric"]["cloudsync_version"] == "9.9"
    finally:
        node.close()
        prom.stop()
        service.stop()


def dashboard_answers(prom: Prometheus) -> dict[str, bool]:
    """Every panel of the dashboard: whether one of its queries returned a series for NODE."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {"instance": NODE, "__rate_interval": "30s", "__range": "5m"}
    answered: dict[str, bool] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            rows = prom.query(to_promql(target["expr"], variables))  # valid PromQL: success
            answered[panel["title"]] = answered.get(panel["title"], False) or bool(rows)
    return answered


def test_device_alerts_reach_alertmanager_once_and_resolve(
    tmp_path: Path, broker: Broker, make_daemon: type[Daemon]
) -> None:
    pages = Pages()
    manager = Alertmanager(tmp_path / "am", pages.url).start()
    ecs = tmp_path / "service" / "events.json"  # in the service's own directory
    service = FleetService(
        tmp_path / "service",
        broker,
        mqtt="session_expiry_s = 3600",  # a broker restart
        sections=f'[alerts]\nalertmanagers = ["{manager.url}"]\nresend_s = 1\n'
        f'[events]\necs_file = "{ecs}"\n',
    )
    service.start_or(manager.stop, pages.close)
    edged = make_daemon()
    agent = Agent(tmp_path / "agent", broker)
    agent.config.write_text(
        agent.config.read_text().replace(str(agent.workdir / "no-edged.sock"), str(edged.socket))
        + "\n[alerts]\nfor_s = 3\noffline_for_s = 2\n[telemetry]\ninterval_s = 1\n"
    )
    agent.start()
    try:
        wait_for(lambda: agent.status()["connected"], 20, "cloudsync connected")
        wait_for(lambda: service.call("GET", "/v1/nodes/n1")[0] == 200, 20, "n1 registered")
        assert service.call("PUT", "/v1/nodes/n1/labels", {"labels": {"site": "lab"}})[0] == 200
        broker.stop()  # the broker goes down; edged is not there either: both alerts fire
        wait_for(
            lambda: agent.status()["outbox"]["depth"]["alert"] >= 2,
            30,
            "NodeOffline and EdgedUnreachable fired offline, in the outbox",
        )
        assert manager.alerts() == []
        broker.start()

        def named(alerts: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
            return [a for a in alerts if a["labels"]["alertname"] == name]

        # the service's own reconnect backs off up to 30 s (paho's, 1 s doubling) while the
        # broker is away: the alert comes after both sessions are back, however long that is
        wait_for(
            lambda: named(manager.alerts(), "EdgedUnreachable"),
            90,
            "EdgedUnreachable in Alertmanager after the reconnect",
        )
        sent = service.counter(SENT)  # three more sends of the service: still one alert
        wait_for(lambda: service.counter(SENT) >= sent + 3, 30, "three more sends")
        [unreachable] = named(manager.alerts(), "EdgedUnreachable")
        assert unreachable["labels"] == {
            "alertname": "EdgedUnreachable",
            "severity": "critical",
            "instance": "n1",
            "fleet": "f1",
            "site": "lab",
        }
        assert unreachable["status"]["state"] == "active"
        assert unreachable["annotations"]["summary"].startswith("cloudsync has not reached")
        assert unreachable.get("generatorURL", "") == ""  # no [api] public_url here
        wait_for(lambda: named(pages.alerts("firing"), "EdgedUnreachable"), 15, "paged")

        # NodeOffline: raised offline, resolved by the device once it is back
        def offline_resolved() -> bool:  # the device resolves it within a heartbeat
            kept = named(service_alerts(service), "NodeOffline")
            return bool(kept) and all(a["state"] == "resolved" for a in kept)

        wait_for(offline_resolved, 30, "NodeOffline resolved by the device")
        wait_for(lambda: not named(manager.alerts(), "NodeOffline"), 15, "and in Alertmanager")
        # edged comes: the device resolves EdgedUnreachable, and Alertmanager with it
        edged.start()
        wait_for(
            lambda: not named(manager.alerts(), "EdgedUnreachable"),
            60,
            "EdgedUnreachable resolved in Alertmanager",
        )
        wait_for(
            lambda: named(pages.alerts("resolved"), "EdgedUnreachable"), 15, "the resolution paged"
        )
        fired = named(pages.alerts("firing"), "EdgedUnreachable")
        assert len({a["startsAt"] for a in fired}) == 1  # one alert, however often sent
        # the real node's own series through the service: its real load and models
        load = re.compile(r'^edged_local_load_ratio\{fleet="f1",instance="n1"\} ', re.M)
        wait_for(lambda: load.search(service_metrics(service)), 30, "edged's load, heartbeat")
        wait_for(
            lambda: (
                'edged_model_version_info{fleet="f1",instance="n1",model='
                in service_metrics(service)
            ),
            30,
            "edged's models in the heartbeat",
        )
        # ECS lines: the node's events as they came, once each
        lines = [json.loads(line) for line in ecs.read_text().splitlines()]
        alerts = [x for x in lines if x.get("rule", {}).get("name") == "EdgedUnreachable"]
        assert [x["event"]["action"] for x in alerts] == ["firing", "resolved"]
        assert all(x["host"]["name"] == "n1" and x["labels"]["fleet"] == "f1" for x in lines)
        assert len({x["event"]["id"] for x in lines}) == len(lines)
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
        service.stop()
        manager.stop()
        pages.close()


def service_alerts(service: FleetService) -> list[dict[str, Any]]:
    """The service's alert rows, as the console reads them (through its database)."""
    import sqlite3

    db = sqlite3.connect(service.workdir / "state" / "fleet.db")
    try:
        rows = db.execute("SELECT alertname, state FROM alerts WHERE node = 'n1'").fetchall()
    finally:
        db.close()
    return [{"labels": {"alertname": name}, "state": state} for name, state in rows]


def service_metrics(service: FleetService) -> str:
    status, text = service.call("GET", "/v1/fleet/metrics", role="viewer")
    assert status == 200
    return str(text)
