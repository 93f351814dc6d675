"""cloudsync as a test runs it: the agent as a process (as its unit runs it), the fleet's
consumer with a persistent session, and what it received; the fixtures that make them are in
tests/conftest.py (``pki``, ``broker``, ``agent``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol import envelope
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics, parse
from edged.client import Client
from tests import asunit
from tests.conftest import wait_for
from tests.mosquitto import OPERATOR, Broker, cloudsync_config

NODE = Topics("f1", "n1")


@dataclass
class Agent:
    """cloudsync as a process: its config, local API socket, log; run as cloudsync.service
    runs it (edged's user, the tests' ``edged-test``: tests/asunit.py) unless ``as_unit`` is
    false."""

    workdir: Path
    broker: Broker
    proc: subprocess.Popen[bytes] | None = None
    as_unit: bool = True

    def __post_init__(self) -> None:
        self.account = asunit.account() if self.as_unit else None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket = self.workdir / "cloudsync.sock"
        self.log = self.workdir / "cloudsync.log"
        self.config = self.workdir / "cloudsync.toml"
        self.config.write_text(
            'log_level = "debug"\n'
            + cloudsync_config(
                self.broker,
                self.workdir,
                "f1",
                more="[heartbeat]\ninterval_s = 1",
                mqtt="keepalive_s = 5\nreconnect_max_s = 2",
            )
        )

    def trust(self) -> Ed25519PrivateKey:
        """A fleet key whose public half this node trusts (kid "fleet-1")."""
        key = Ed25519PrivateKey.generate()
        (self.workdir / "trust").mkdir(exist_ok=True)
        (self.workdir / "trust" / "fleet-1.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return key

    def start(self) -> Agent:
        unit: dict[str, Any] = {}
        if self.account is not None:
            self.log.touch()
            self.account.own(self.workdir)  # again at each start: what the test wrote meanwhile
            asunit.reachable(self.broker.pki)  # its certificate and key (0644 here)
            unit = self.account.popen()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                **unit,
            )
        wait_for(lambda: self.socket.exists(), 20, "cloudsync's local API", self.proc)
        return self

    @property
    def local(self) -> Client:
        return Client(str(self.socket), timeout=30)

    def post(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(self.local.call("POST", "/v1/records", {"records": records}))

    def status(self) -> dict[str, Any]:
        return dict(self.local.call("GET", "/v1/status"))

    def signal(self, sig: signal.Signals) -> int:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        return self.proc.wait(20)


def operator(broker: Broker) -> SyncClient:
    """The fleet's consumer, with a persistent session subscribed to node n1's subtree."""
    client = SyncClient(broker.port, broker.pki, OPERATOR, client_id="fleet-consumer")
    assert client.connect()
    assert not client.subscribe(NODE.everything)[0].is_failure
    return client


def bodies(messages: list[tuple[str, bytes]], kind: str) -> list[envelope.Envelope]:
    return [envelope.decode(p) for t, p in messages if parse(t).kind == kind and p]


def last_status(client: SyncClient) -> str | None:
    found = [envelope.decode(p).body["state"] for t, p in client.received if t == NODE.status]
    return found[-1] if found else None


@contextlib.contextmanager
def online(broker: Broker, agent: Agent) -> Iterator[tuple[Ed25519PrivateKey, SyncClient]]:
    """The broker and the agent up, the fleet's signing key trusted, and the operator's
    consumer connected once the birth is out (it follows the agent's subscription to its
    commands on the same connection)."""
    key = agent.trust()
    broker.start()
    agent.start()
    consumer = operator(broker)
    try:
        wait_for(lambda: last_status(consumer) == "online", 10, "the birth")
        yield key, consumer
    finally:
        consumer.close()
