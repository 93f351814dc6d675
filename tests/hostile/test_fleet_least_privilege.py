"""Issue 44, point 5 (the smaller fleet findings), with a real Mosquitto and ``edgefleet serve``.

- A device could publish its own retained ``desired/models``, which the service subscribes to
  and took as the node's desired state: the broker's ACL (tests/mosquitto.py, the one
  docs/PROTOCOL.md gives operators) now lets a node write only what it sends (status,
  heartbeat, telemetry, events, command results, its renewal) and read the rest of its subtree.
- The API's JSON answers lacked ``X-Content-Type-Options: nosniff``, errors included.
- Signing out of the console did not end the session: the cookie was the API token.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from cloudsync.fleet.console import COOKIE, csrf_of
from cloudsync.protocol.envelope import Envelope
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics
from tests.conftest import wait_for
from tests.fleetservice import TOKENS, FleetService
from tests.mosquitto import OPERATOR, Broker


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    yield broker
    broker.kill()


def test_a_node_writes_only_what_it_sends(broker: Broker, pki: Path) -> None:
    node, operator = SyncClient(broker.port, pki, "n1"), SyncClient(broker.port, pki, OPERATOR)
    assert node.connect() and operator.connect()
    try:
        mine = Topics("f1", "n1")
        body = Envelope("n1", 1, {"models": []}).encode()
        for topic in (
            mine.desired_models,
            mine.desired_trust,
            mine.cmd("c1"),
            mine.renew_answer,
            "edge/v1/f1/n1/anything",
        ):
            assert node.publish(topic, body).getName() == "Not authorized", topic
        for topic in (
            mine.status,
            mine.heartbeat,
            mine.telemetry,
            mine.events,
            mine.cmd_result("c1"),
            mine.renew,
        ):
            assert node.publish(topic, body).getName() in ("Success", "No matching subscribers")
        # what the fleet tells it, it still reads
        node.subscribe("edge/v1/f1/n1/#")
        operator.publish(mine.desired_models, body)
        wait_for(
            lambda: any(t == mine.desired_models for t, _ in node.received),
            10,
            "the desired state at the node",
        )
    finally:
        node.close()
        operator.close()


def test_every_api_answer_says_nosniff(tmp_path: Path, broker: Broker) -> None:
    service = FleetService(tmp_path / "service", broker).start()
    try:
        for path, token, status in (
            ("/v1/nodes", TOKENS["viewer"], 200),
            ("/v1/nodes", None, 401),
            ("/v1/nope", TOKENS["viewer"], 404),
            ("/healthz", None, 200),
        ):
            request = urllib.request.Request(service.url + path)
            if token:
                request.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    got, headers = reply.status, reply.headers
            except urllib.error.HTTPError as exc:
                got, headers = exc.code, exc.headers
            assert got == status, path
            assert headers["X-Content-Type-Options"] == "nosniff", (path, dict(headers))
    finally:
        service.stop()


def test_signing_out_ends_the_console_session(tmp_path: Path, broker: Broker) -> None:
    """The console's cookie was the API token itself: signing out deleted it in the browser,
    and a copy of it went on working (it still does as a bearer token: it is the API's). Now
    the cookie is a session's id, which signing out ends on the server."""
    service = FleetService(tmp_path / "service", broker).start()

    def call(method: str, path: str, cookie: str = "", body: str = "") -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=30)
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        if cookie:
            headers["Cookie"] = f"{COOKIE}={cookie}"
        connection.request(method, path, body or None, headers)
        reply = connection.getresponse()
        reply.read()
        connection.close()
        return reply.status, reply.headers

    try:
        status, headers = call(
            "POST", "/console/login", body=urlencode({"token": TOKENS["operator"]})
        )
        assert status == 303
        session = SimpleCookie(headers["Set-Cookie"])[COOKIE].value
        assert session != TOKENS["operator"] and len(session) >= 40
        assert call("GET", "/console/nodes", session)[0] == 200
        assert call("GET", "/console/nodes", TOKENS["operator"])[0] == 303  # a token: no session
        body = urlencode({"csrf": csrf_of(session)})
        assert call("POST", "/console/logout", session, body)[0] == 303
        status, headers = call("GET", "/console/nodes", session)  # the copy kept
        assert status == 303 and headers["Location"].startswith("/console/login")
        audit = service.call("GET", "/v1/audit", role="admin")[1]["entries"]
        assert ("console sign-out", "done") in [(e["action"], e["outcome"]) for e in audit]
    finally:
        service.stop()
