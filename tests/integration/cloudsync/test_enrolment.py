"""Enrolment (issue 26) with real parts: a real Mosquitto with the fleet's ACLs (the claim
credential's CN holds a +), the real ``edgefleet serve`` with the tests' CA as its issuing CA,
and real cloudsync processes that have nothing but the claim credential, the fleet CA and, for
one, a one-time token.

- A device with a token enrols at once (its key made on the device, 0600, never sent), then
  connects as itself and publishes under its own topics; the token is used up: a second device
  with it is refused and cloudsync exits 1 saying so.
- A device without a token waits, pending, until an operator approves it; then it is in.
- A revoked certificate (``edgefleet enrol revoke``: the service's CRL, the broker's crlfile,
  reloaded) cannot reconnect; the others can.
- A certificate renewed at its time while a program posts records: one reconnect, a new key,
  every record stored reaches the fleet.
- The claim credential can do nothing else: its publishes to a node's telemetry and to an
  answer topic are refused (PUBACK "Not authorized"), it is delivered nothing of a node's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloudsync.fleet.enrolment import Issuer, write_crl
from cloudsync.protocol.commands import sign
from cloudsync.protocol.enrol import public_der
from cloudsync.protocol.envelope import Envelope, decode
from cloudsync.protocol.mqtt import SyncClient
from edged.client import Client
from tests import asunit
from tests.conftest import wait_for
from tests.fleetservice import FleetService
from tests.mosquitto import ACL, OPERATOR, Broker, Stoppable, cloudsync_config


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    crl = tmp_path / "fleet.crl"  # the service's, from its start on; empty until then
    write_crl(Issuer(pki / "ca.pem", pki / "ca.key", 1), [], int(time.time() * 1000), crl)
    broker = Broker(tmp_path / "mosquitto", pki, crl_file=crl).start()
    yield broker
    broker.kill()


@pytest.fixture
def service(tmp_path: Path, broker: Broker, pki: Path) -> Iterator[FleetService]:
    base = tmp_path / "acl.base"  # the fleet's rules; the service writes the broker's ACL
    base.write_text(ACL)
    enrolment = (
        f'[enrolment]\nca_cert = "{pki}/ca.pem"\nca_key = "{pki}/ca.key"\n'
        f'cert_days = 30\ncrl_file = "{tmp_path / "fleet.crl"}"\n'
        f'acl_base = "{base}"\nacl_file = "{broker.workdir / "acl"}"\n'
    )
    service = FleetService(tmp_path / "service", broker, sections=enrolment)
    service.writes(tmp_path / "fleet.crl", broker.workdir / "acl")
    service.start()
    yield service
    service.kill()


class Device(Stoppable):
    """A new device: cloudsync with the claim credential and the fleet CA only."""

    def __init__(self, workdir: Path, broker: Broker, node: str, token: str | None) -> None:
        self.workdir, self.node, self.proc = workdir, node, None
        workdir.mkdir(parents=True)
        pki = self.broker_pki = broker.pki
        enrol = f'[enrol]\nclaim_cert = "{pki}/claim.pem"\nclaim_key = "{pki}/claim.key"\n'
        if token is not None:
            (workdir / "token").write_text(token + "\n")
            enrol += f'token_file = "{workdir / "token"}"\n'
        text = cloudsync_config(
            broker, workdir, "f1", node=node, more=f"[heartbeat]\ninterval_s = 1\n{enrol}"
        )
        self.cert, self.key = workdir / "device.pem", workdir / "device.key"
        text = text.replace(f'cert_file = "{pki}/{node}.pem"', f'cert_file = "{self.cert}"')
        text = text.replace(f'key_file = "{pki}/{node}.key"', f'key_file = "{self.key}"')
        self.config = workdir / "cloudsync.toml"
        self.config.write_text(text)
        self.log = workdir / "cloudsync.log"

    def start(self) -> Device:
        """cloudsync as its unit runs it (tests/asunit.py): edged's user, umask, limits."""
        unit: dict[str, Any] = {}
        account = asunit.account()
        if account is not None:
            self.log.touch()
            account.own(self.workdir)  # again at each start: what the test wrote meanwhile
            asunit.reachable(self.broker_pki)  # the claim credential and the CA
            unit = account.popen()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                **unit,
            )
        return self


def online(service: FleetService, node: str) -> bool:
    status, row = service.call("GET", f"/v1/nodes/{node}", role="viewer")
    return status == 200 and row["state"] == "online" and row["heartbeats"] > 0


def test_a_device_with_a_token_enrols_and_publishes_as_itself(
    tmp_path: Path, broker: Broker, service: FleetService, pki: Path
) -> None:
    status, made = service.call(
        "POST", "/v1/enrolment-tokens", {"node": "n9", "ttl_s": 600}, role="operator"
    )
    assert status == 201 and made["node"] == "n9" and made["token"].startswith("enrol_")
    watcher = SyncClient(broker.port, pki, OPERATOR)
    assert watcher.connect()
    watcher.subscribe("edge/v1/f1/#")
    device = Device(tmp_path / "n9", broker, "n9", made["token"]).start()
    try:
        wait_for(lambda: online(service, "n9"), 30, "n9 enrolled and online", device.proc)
        cert = x509.load_pem_x509_certificate(device.cert.read_bytes())
        ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "n9"
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert 29.9 < lifetime.total_seconds() / 86400 < 30.1
        assert device.key.stat().st_mode & 0o777 == 0o600
        assert not Path(f"{device.key}.request").exists()
        key_pem = device.key.read_bytes()  # the key never left the device: no message has it
        wait_for(
            lambda: any(t == "edge/v1/f1/n9/heartbeat" for t, _ in watcher.received),
            20,
            "n9's heartbeat under its own topic",
        )
        assert not any(key_pem.split(b"\n")[1] in p for _, p in watcher.received)
        enrolled = service.call("GET", "/v1/enrolments", role="operator")[1]["enrolments"]
        assert [(e["node"], e["state"], e["how"], e["decided_by"]) for e in enrolled] == [
            ("n9", "issued", "token", "token")
        ]
        # the token is used up: another device with it is refused, and says so
        again = Device(tmp_path / "n9-again", broker, "n9", made["token"]).start()
        assert again.proc is not None and again.proc.wait(30) == 1
        assert "the token is unknown, used, expired or for another name" in again.logs()
        assert not again.cert.exists()
        # revoked: into the broker's CRL; after its reload the certificate cannot reconnect
        gone = service.edgefleet("enrol", "revoke", "n9", role="admin")
        serial = format(cert.serial_number, "x")
        assert gone == {"revoked": [serial], "unwritten": []}
        crl = x509.load_pem_x509_crl((tmp_path / "fleet.crl").read_bytes())
        assert crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None
        assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
        # a command to it is refused by the service, not relayed to time out
        fleet = service.call("GET", "/v1/nodes/n9", role="operator")[1]["fleet"]
        _, payload = sign(Ed25519PrivateKey.generate(), "k1", "operator", f"{fleet}/n9", "ping", {})
        refused = service.call(
            "POST", "/v1/nodes/n9/commands", {"command": json.loads(payload)}, role="operator"
        )
        assert refused == (409, {"error": "node n9: revoked, it can receive no command"})
        broker.reload()
        device.stop()
        wait_for(lambda: not online(service, "n9"), 20, "n9 gone")
        device.start()  # with its certificate: no enrolment, a plain connect
        # its attempt refused (the broker said why, or closed first), and it is not online
        wait_for(
            lambda: (
                "alert certificate revoked" in device.logs()
                or "certificate verify failed" in broker.logs()
            ),
            30,
            "n9's connection refused",
        )
        assert not online(service, "n9"), "a revoked certificate reconnected"
        other = SyncClient(broker.port, pki, "n1")
        assert other.connect()  # the others are not touched
        other.close()
    finally:
        device.stop()
        watcher.close()


def test_without_a_token_an_operator_approves(
    tmp_path: Path, broker: Broker, service: FleetService
) -> None:
    device = Device(tmp_path / "n10", broker, "n10", None).start()
    try:

        def pending() -> list[dict[str, object]]:
            found = service.call("GET", "/v1/enrolments?state=pending", role="operator")[1]
            return list(found["enrolments"])

        wait_for(pending, 30, "n10's request pending", device.proc)
        [request] = pending()
        assert request["node"] == "n10" and request["how"] == "approval"
        time.sleep(1.5)
        assert not device.cert.exists() and not online(service, "n10")
        assert (
            service.call("POST", f"/v1/enrolments/{request['rid']}/approve", role="viewer")[0]
            == 403
        )
        listed = service.edgefleet("enrol", "list", "--state", "pending")
        assert [(r["rid"], r["node"]) for r in listed] == [(request["rid"], "n10")]
        done = service.edgefleet("enrol", "approve", str(request["rid"]))
        assert done == {"rid": request["rid"], "state": "issued"}
        wait_for(lambda: online(service, "n10"), 30, "n10 approved and online", device.proc)
        audit = service.call("GET", "/v1/audit", role="operator")[1]["entries"]
        assert ("approve enrolment", request["rid"], "done") in [
            (e["action"], e["target"], e["outcome"]) for e in audit
        ]
        again = service.call("POST", f"/v1/enrolments/{request['rid']}/approve", role="operator")
        assert again[0] == 404  # decided already
    finally:
        device.stop()


def test_the_claim_credential_can_only_enrol(broker: Broker, pki: Path) -> None:
    claim = SyncClient(broker.port, pki, "claim")
    node = SyncClient(broker.port, pki, "n1")
    assert claim.connect() and node.connect()
    try:
        body = Envelope("n1", 1, {"metrics": {}}).encode()
        answer = f"edge/v1/f1/_enrol/{'a' * 32}/cert"
        for topic in (
            "edge/v1/f1/n1/telemetry",
            "edge/v1/f1/n1/status",
            answer,
            "edge/v1/f1/_fleet/status",
        ):
            assert claim.publish(topic, body).getName() == "Not authorized", topic
        claim.subscribe("edge/v1/f1/n1/#")
        node.publish("edge/v1/f1/n1/telemetry", body)
        time.sleep(1)
        assert claim.received == []  # granted, and nothing delivered (read is checked per message)
    finally:
        claim.close()
        node.close()


def test_a_rotation_during_traffic_loses_no_acknowledged_record(
    tmp_path: Path, broker: Broker, pki: Path
) -> None:
    """A certificate of 35 s renewed at 40 % of its life (the tenth of it that it is back-dated
    included: about 12 s after it is issued) while a program posts records: one reconnect a
    renewal, with the new key and certificate, the session resumed, and every record stored
    reaches the fleet."""
    enrolment = (
        f'[enrolment]\nca_cert = "{pki}/ca.pem"\nca_key = "{pki}/ca.key"\ncert_days = 0.0004\n'
    )
    service = FleetService(tmp_path / "service", broker, sections=enrolment).start()
    watcher = SyncClient(broker.port, pki, OPERATOR, client_id="rotation-watcher")
    assert watcher.connect()
    watcher.subscribe("edge/v1/f1/n12/#")
    token = service.call("POST", "/v1/enrolment-tokens", {"node": "n12"}, role="operator")[1]
    device = Device(tmp_path / "n12", broker, "n12", token["token"])
    device.config.write_text(device.config.read_text() + "renew_after = 0.4\n")
    device.start()
    stored: list[str] = []
    try:
        wait_for(lambda: online(service, "n12"), 30, "n12 enrolled", device.proc)
        first = x509.load_pem_x509_certificate(device.cert.read_bytes())
        local = Client(str(device.workdir / "cloudsync.sock"), timeout=10)
        deadline = time.monotonic() + 25
        renewed = False
        while time.monotonic() < deadline and not (renewed and len(stored) > 100):
            ident = f"r{len(stored):05d}"
            done = local.call(
                "POST",
                "/v1/records",
                {"records": [{"kind": "events", "body": {"n": len(stored)}, "id": ident}]},
            )
            if done["stored"] == 1:
                stored.append(ident)
            renewed = (
                renewed
                or x509.load_pem_x509_certificate(device.cert.read_bytes()).serial_number
                != first.serial_number
            )
            time.sleep(0.05)
        assert renewed, device.logs()[-3000:]
        wait_for(
            lambda: local.call("GET", "/v1/status")["outbox"]["pending"] == 0,
            30,
            "the outbox delivered",
            device.proc,
        )
        got = {decode(p).id for t, p in watcher.received if t.endswith("/events")}
        assert set(stored) <= got, sorted(set(stored) - got)[:10]
        second = x509.load_pem_x509_certificate(device.cert.read_bytes())
        assert public_der(second.public_key()) != public_der(first.public_key())  # a new key
        assert second.not_valid_after_utc > first.not_valid_after_utc
        issued = service.call("GET", "/v1/enrolments", role="operator")[1]["enrolments"]
        hows = [e["how"] for e in issued if e["state"] == "issued"]  # newest first
        assert hows[-1] == "token" and set(hows[:-1]) == {"renewal"}, hows
        # one reconnect a renewal (its life is short: it may renew again in the test), each
        # resuming the persistent session
        logs = device.logs()  # JSON lines: a message is its "message" (and log.original)
        assert logs.count('"message":"reconnecting with the renewed certificate"') == len(hows) - 1
        assert logs.count("(session resumed)") >= len(hows) - 1
        assert online(service, "n12")
    finally:
        device.stop()
        watcher.close()
        service.kill()
