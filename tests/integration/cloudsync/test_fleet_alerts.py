"""Alerts evaluated on the device fire while the broker is down and reach the fleet when it is
back (a real Mosquitto, stopped and started); cloudsync's metrics say so meanwhile."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.peer import free_port
from cloudsync.protocol.envelope import Envelope
from tests.cloudsync_agent import Agent, bodies, operator
from tests.conftest import wait_for
from tests.mosquitto import Broker


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "mosquitto", pki)
    yield broker
    broker.kill()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def firing(text: str) -> set[str]:
    return {
        dict(labels)["alertname"]
        for (name, labels), value in samples(text).items()
        if name == "cloudsync_alerts_firing" and value == 1
    }


def alerts_of(received: list[tuple[str, bytes]]) -> list[Envelope]:
    return [e for e in bodies(received, "events") if "state" in e.body and "alert" in e.body]


def test_an_alert_raised_while_the_broker_is_down_arrives_after_the_reconnect(
    tmp_path: Path, broker: Broker
) -> None:
    port = free_port()
    agent = Agent(tmp_path / "agent", broker)
    agent.config.write_text(
        agent.config.read_text()
        + f"\n[metrics]\nport = {port}\n[alerts]\nfor_s = 1\noffline_for_s = 2\n"
    )
    broker.start()
    consumer = operator(broker)  # a persistent session: the broker queues for it
    consumer.close()
    agent.start()
    try:
        local = agent.local
        wait_for(lambda: agent.status()["connected"], 20, "cloudsync connected")
        # no edged on its socket: EdgedUnreachable fires (after for_s), while online
        wait_for(lambda: "EdgedUnreachable" in firing(local.metrics()), 20, "EdgedUnreachable")
        assert "NodeOffline" not in firing(local.metrics())

        broker.stop()
        alert_queued = ("cloudsync_outbox_records", (("priority", "alert"),))

        def offline_alert_queued() -> bool:  # it fires, then it is stored in the outbox
            text = local.metrics()
            return "NodeOffline" in firing(text) and samples(text).get(alert_queued, 0) >= 1

        wait_for(offline_alert_queued, 30, "NodeOffline, offline, in the outbox")
        # offline, the agent waits quietly: no error a turn (paho logs one for each loop
        # without a socket)
        assert "Client is not connected" not in agent.log.read_text()
        text = local.metrics()
        values = samples(text)
        assert values[("cloudsync_mqtt_connected", ())] == 0.0
        assert values[("cloudsync_outbox_oldest_age_seconds", ())] >= 0
        # the same metrics on the TCP port, loopback only
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert "NodeOffline" in firing(reply.read().decode())

        broker.start()
        consumer = operator(broker)
        try:
            wait_for(
                lambda: any(
                    e.body["alert"] == "NodeOffline" and e.body["state"] == "resolved"
                    for e in alerts_of(consumer.received)
                ),
                30,
                "NodeOffline's firing and resolved events at the fleet",
            )
            got = {(e.body["alert"], e.body["state"]): e for e in alerts_of(consumer.received)}
            fired = got[("NodeOffline", "firing")]
            assert fired.body["severity"] == "critical"
            assert fired.body["summary"] == "The node has been out of the fleet for 2s"
            assert fired.body["value"] >= 2  # seconds offline when it fired
            assert fired.body["active_since_ms"] < fired.body["at_ms"]
            resolved = got[("NodeOffline", "resolved")]
            assert resolved.body["at_ms"] > fired.body["at_ms"]
            assert ("EdgedUnreachable", "firing") in got
            assert "NodeOffline" not in firing(local.metrics())
        finally:
            consumer.close()
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
