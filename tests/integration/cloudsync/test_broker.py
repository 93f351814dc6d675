"""The fleet's broker configuration (tests/mosquitto.py, given to operators in docs/PROTOCOL.md)
on a real Mosquitto: TLS 1.3 with client certificates, and ACLs that keep a node inside its own
topics. What the broker refused is observed from the client side (PUBACK reason codes, messages
that never arrive, connections that never get a CONNACK) and in the broker's log."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator

import pytest

from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics
from tests.conftest import skip_or_fail, wait_for
from tests.mosquitto import OPERATOR, Broker, make_pki

N1, N2 = Topics("f1", "n1"), Topics("f1", "n2")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    why = Broker.available()
    if why:
        skip_or_fail(why)
    work = tmp_path_factory.mktemp("broker")
    pki = make_pki(work / "pki", ["n1", "n2"])
    broker = Broker(work / "mosquitto", pki).start()
    yield broker
    broker.stop()


def client(broker: Broker, stem: str | None, **kw: object) -> SyncClient:
    return SyncClient(broker.port, broker.pki, stem, **kw)  # type: ignore[arg-type]


def test_a_node_stays_inside_its_own_topics(broker: Broker) -> None:
    n1, n2, operator = client(broker, "n1"), client(broker, "n2"), client(broker, OPERATOR)
    assert n1.connect() and n2.connect() and operator.connect()
    try:
        assert operator.subscribe("edge/v1/f1/+/telemetry")[0].value == 1  # granted QoS 1
        # n1 listens on n2's subtree: the broker grants the subscription (Mosquitto checks
        # read access per message) but must deliver nothing of n2's
        assert n1.subscribe(N2.everything)[0].value == 1
        assert not n1.publish(N1.telemetry, b"mine").is_failure
        assert not n2.publish(N2.telemetry, b"n2's own").is_failure
        refused = n1.publish(N2.telemetry, b"forged as n2")
        assert refused.is_failure and refused.getName() == "Not authorized"
        assert n1.publish(N2.cmd("x"), b"a command to n2").getName() == "Not authorized"
        seen = operator.wait_messages(2, 5)
        assert sorted(payload for _, payload in seen) == [b"mine", b"n2's own"]
        time.sleep(0.3)  # what the broker would have sent n1 with the operator's copy has come
        assert n1.received == []  # n2's message never reached n1
    finally:
        for c in (n1, n2, operator):
            c.close()


@pytest.mark.parametrize(
    "stem, max_version, why",
    [
        ("n1", ssl.TLSVersion.TLSv1_2, "unsupported protocol"),
        (None, None, "peer did not return a certificate"),
        ("rogue", None, "certificate verify failed"),  # n1's name, another CA
    ],
)
def test_tls_1_2_no_certificate_and_a_foreign_ca_cannot_connect(
    broker: Broker, stem: str | None, max_version: ssl.TLSVersion | None, why: str
) -> None:
    refused = client(broker, stem, max_version=max_version)
    try:
        assert not refused.connect(timeout=2)
    finally:
        refused.close()
    wait_for(lambda: why in broker.logs(), 5, f"'{why}' in the broker's log")
