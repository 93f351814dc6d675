"""Issue 44, point 4: what a device sent at QoS 1 while the broker was down reaches the fleet
service once, whichever of the two reconnects first (real Mosquitto, ``edgefleet serve``,
cloudsync, and Debian's Alertmanager).

Found: after a broker restart, the device came back first and published the alert it had
raised offline; the service came back 3 s later and never stored it. Mosquitto keeps no shared
subscription across its restart (persist__subs_save writes none), so until the service
subscribes again nobody has the device's topics: the broker answers PUBACK "No matching
subscribers" (reason code 16), which the device took as delivered and dropped from its outbox.
cloudsync now keeps such a record and sends it again until the broker has a subscriber.

Each order is made, not waited for: the one that must come second is stopped (SIGSTOP) while
the broker starts, and continued once the first is connected (the device: once the broker has
answered it; the service: once its health says the broker is there).
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cloudsync_agent import Agent
from tests.conftest import wait_for
from tests.fleetservice import FleetService
from tests.mosquitto import Broker
from tests.prometheus import Alertmanager, Pages

SENT = 'edgefleet_alertmanager_pushes_total{outcome="sent"}'  # the service's sends

NO_SUBSCRIBER = "the broker has no subscriber for the records"


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    yield broker
    broker.kill()


def pause(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def go_on(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def fleet_counter(service: FleetService, name: str, labels: str) -> float | None:
    text = service.call("GET", "/v1/fleet/metrics", role="viewer")[1]
    found = re.search(rf"^{name}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


@pytest.mark.parametrize("first", ["device", "service"])
def test_what_a_device_sent_while_the_broker_was_down_is_stored_once(
    first: str, tmp_path: Path, broker: Broker
) -> None:
    pages = Pages()
    manager = Alertmanager(tmp_path / "am", pages.url).start()
    ecs = tmp_path / "service" / "events.json"  # in the service's own directory
    # the default session_expiry_s = 0: the service keeps no session on the broker
    service = FleetService(
        tmp_path / "service",
        broker,
        sections=f'[alerts]\nalertmanagers = ["{manager.url}"]\nresend_s = 1\n'
        f'[events]\necs_file = "{ecs}"\n',
    )
    service.start_or(manager.stop, pages.close)
    agent = Agent(tmp_path / "agent", broker)
    # no edged on its socket: EdgedUnreachable fires 2 s after cloudsync starts, offline
    agent.config.write_text(agent.config.read_text() + "\n[alerts]\nfor_s = 2\n")
    assert service.proc is not None
    try:
        wait_for(
            lambda: service.call("GET", "/healthz", role=None)[0] == 200,
            20,
            "the service on the broker",
        )
        broker.stop()
        agent.start()
        local = agent.local
        records = [
            {
                "kind": "events",
                "id": "ev-offline-1",
                "priority": "event",
                "body": {"message": "written while the broker was down"},
            },
            {
                "kind": "telemetry",
                "id": "tm-offline-1",
                "body": {
                    "metrics": {
                        "models": [
                            {"model": "offline-model", "version": "1", "outcomes": {"success": 7}}
                        ]
                    }
                },
            },
        ]
        assert local.call("POST", "/v1/records", {"records": records})["stored"] == 2
        wait_for(
            lambda: agent.status()["outbox"]["depth"]["alert"] >= 1,
            30,
            "EdgedUnreachable fired offline, in the outbox",
        )
        assert manager.alerts() == []

        second = service.proc.pid if first == "device" else agent.proc.pid  # type: ignore[union-attr]
        pause(second)
        try:
            broker.start()
            if first == "device":
                # connected, and the broker has said no one has its topics (or, before the fix,
                # taken the records as delivered: the outbox empty)
                wait_for(
                    lambda: (
                        NO_SUBSCRIBER in agent.log.read_text()
                        or agent.status()["outbox"]["depth"]["alert"] == 0
                    ),
                    30,
                    "the device back first, the service not yet",
                )
            else:
                wait_for(
                    lambda: service.call("GET", "/healthz", role=None)[0] == 200,
                    60,
                    "the service back first",
                )
        finally:
            go_on(second)

        def named(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [a for a in alerts if a["labels"]["alertname"] == "EdgedUnreachable"]

        wait_for(lambda: named(manager.alerts()), 60, "EdgedUnreachable in Alertmanager")
        wait_for(
            lambda: agent.status()["outbox"]["depth"] == {"alert": 0, "event": 0, "telemetry": 0},
            30,
            "the outbox delivered",
        )
        sent = service.counter(SENT)  # three more sends of the service
        wait_for(lambda: service.counter(SENT) >= sent + 3, 30, "three more sends")
        [alert] = named(manager.alerts())  # once
        assert alert["labels"]["instance"] == "n1" and alert["status"]["state"] == "active"
        lines = [json.loads(line) for line in ecs.read_text().splitlines()]
        ids = [x["event"]["id"] for x in lines]
        assert ids.count("ev-offline-1") == 1, ids
        fired = [x for x in lines if x.get("rule", {}).get("name") == "EdgedUnreachable"]
        assert [x["event"]["action"] for x in fired] == ["firing"]
        requests = fleet_counter(service, "edged_inference_requests_total", 'model="offline-model"')
        assert requests == 7.0  # the telemetry record counted once
        if first == "device":
            assert NO_SUBSCRIBER in agent.log.read_text()
            assert "the fleet has the records again" in agent.log.read_text()
    finally:
        for proc in (agent.proc, service.proc):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
        service.stop()
        manager.stop()
        pages.close()
