"""The fleet's trust over MQTT, with real parts: a real Mosquitto (TLS, the ACL) and cloudsync
as a process. A trust document rotates the fleet's keys (signed by the threshold of the keys in
force and by the new ones), is kept across a restart, is refused when it is older, forged or
signed by a retired key, and revokes the broker's certificate: the node refuses that broker
until it presents another one."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol import envelope, trust
from cloudsync.protocol.commands import sign
from cloudsync.protocol.mqtt import SyncClient
from tests.cloudsync_agent import NODE, Agent, bodies, operator
from tests.conftest import skip_or_fail, wait_for
from tests.mosquitto import OPERATOR, Broker, edgefleet, make_pki
from tests.pki import issue


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Broker, Agent]]:
    why = Broker.available()
    if why:
        skip_or_fail(why)
    pki = make_pki(tmp_path / "pki", ["n1"])
    broker = Broker(tmp_path / "mosquitto", pki)
    agent = Agent(tmp_path / "agent", broker)
    yield broker, agent
    if agent.proc is not None and agent.proc.poll() is None:
        agent.proc.kill()
        agent.proc.wait()
    broker.kill()


def ping(consumer: SyncClient, key: Ed25519PrivateKey, kid: str) -> dict[str, Any]:
    """A ping signed by ``kid``: the node's result."""
    cmd_id, payload = sign(key, kid, OPERATOR, "f1/n1", "ping")
    assert not consumer.publish(NODE.cmd(cmd_id), payload).is_failure
    result: dict[str, Any] = {}

    def answered() -> bool:
        for topic, body in list(consumer.received):
            if topic == NODE.cmd_result(cmd_id):
                result.update(envelope.decode(body).body)
        return bool(result)

    wait_for(answered, 10, f"the result of {cmd_id}")
    return result


def publish(consumer: SyncClient, doc: dict[str, Any]) -> None:
    payload = envelope.Envelope(OPERATOR, int(time.time() * 1000), doc).encode()
    assert not consumer.publish(NODE.desired_trust, payload, retain=True).is_failure


def reports(consumer: SyncClient, after: int = 0) -> list[dict[str, Any]]:
    """The node's trust events and refusals, in order."""
    found = [
        e.body
        for e in bodies(list(consumer.received), "events")
        if "trust" in e.body or e.body.get("alert") == "trust refused"
    ]
    return found[after:]


def wait_report(consumer: SyncClient, after: int) -> dict[str, Any]:
    wait_for(lambda: reports(consumer, after), 10, "the node's trust report")
    return reports(consumer, after)[0]


def test_a_trust_document_rotates_the_keys_survives_a_restart_and_revokes_the_broker(
    world: tuple[Broker, Agent], tmp_path: Path
) -> None:
    broker, agent = world
    old = agent.trust()  # fleet-1, provisioned in trust_dir
    new = Ed25519PrivateKey.generate()
    broker.start()
    agent.start()
    consumer = operator(broker)
    wait_for(lambda: agent.status()["connected"], 10, "connected")
    assert ping(consumer, old, "fleet-1")["ok"]

    # fleet-1 retires, fleet-2 takes over: signed by the key in force and the new one
    rotation = trust.make(1, {"fleet-2": (new.public_key(), None)}, 1)
    refusals = [
        (trust.sign(rotation, {"fleet-1": old}), "by its own keys, 1 needed"),  # no fleet-2
        (trust.sign(rotation, {"fleet-2": new}), "by the keys in force, 1 needed"),
        (
            {
                **trust.sign(rotation, {"fleet-1": old, "fleet-2": new}),
                "signed": {**rotation, "version": 5},
            },
            "does not verify",
        ),  # altered
        (trust.sign({**rotation, "expires": 1}, {"fleet-1": old, "fleet-2": new}), "expired"),
    ]
    for doc, says in refusals:
        seen = len(reports(consumer))
        publish(consumer, doc)
        refused = wait_report(consumer, seen)
        assert refused["alert"] == "trust refused" and says in refused["why"], refused
    assert ping(consumer, old, "fleet-1")["ok"]  # nothing changed

    seen = len(reports(consumer))
    publish(consumer, trust.sign(rotation, {"fleet-1": old, "fleet-2": new}))
    assert wait_report(consumer, seen)["trust"] == {
        "version": 1,
        "keys": ["fleet-2"],
        "threshold": 1,
        "revoked": 0,
    }
    assert "is not a trust anchor" in ping(consumer, old, "fleet-1")["error"]
    assert ping(consumer, new, "fleet-2")["ok"]
    (kept,) = json.loads((agent.workdir / "trust.json").read_text())["chain"]
    assert kept["signed"]["version"] == 1 and list(kept["signed"]["keys"]) == ["fleet-2"]

    # a restart keeps it (the retained document again is not a new one); the retired key
    # cannot sign the next one, nor can an older one come back
    agent.signal(signal.SIGTERM)
    seen = len(reports(consumer))
    agent.start()
    wait_for(lambda: agent.status()["connected"], 10, "connected again")
    assert "is not a trust anchor" in ping(consumer, old, "fleet-1")["error"]
    assert ping(consumer, new, "fleet-2")["ok"]
    assert reports(consumer, seen) == []
    back = trust.make(2, {"fleet-1": (old.public_key(), None)}, 1)
    publish(consumer, trust.sign(back, {"fleet-1": old}))
    refused = wait_report(consumer, seen)
    assert "0 valid signature(s) by the keys in force" in refused["why"], refused

    # the broker's certificate is revoked (made and published with edgefleet): the node
    # leaves and refuses that broker; the same broker with a new certificate takes it back
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "fleet-2.key").write_bytes(
        new.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (keys / "fleet-2.pub").write_bytes(
        new.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    out = tmp_path / "trust-3.json"
    made = edgefleet(
        broker,
        "trust",
        "make",
        "--version",
        "3",
        "--key",
        f"fleet-2={keys / 'fleet-2.pub'}",
        "--revoke",
        str(broker.pki / "broker.pem"),
        "--sign",
        f"fleet-2={keys / 'fleet-2.key'}",
        "--out",
        str(out),
    )
    assert made.returncode == 0, made.stderr
    assert (
        made.stdout.strip() == f"{out}: trust version 3, keys ['fleet-2'], threshold 1, 1 revoked"
    )
    seen = len(reports(consumer))
    published = edgefleet(broker, "trust", "publish", str(out), "--node", "n1")
    assert published.returncode == 0, published.stderr
    assert wait_report(consumer, seen)["trust"]["revoked"] == 1
    broker.stop()  # the session ends; at the next connection the certificate is checked
    broker.start()
    wait_for(
        lambda: "is revoked by the fleet's trust document" in agent.log.read_text(),
        20,
        "the node refusing the revoked broker",
    )
    assert not agent.status()["connected"]
    ca = x509.load_pem_x509_certificate((broker.pki / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((broker.pki / "ca.key").read_bytes(), None)
    issue("localhost", (ca, ca_key), broker.pki, "broker", server=True)  # type: ignore[arg-type]
    broker.stop()
    broker.start()
    wait_for(lambda: agent.status()["connected"], 30, "connected to the new certificate")
    consumer.close()
