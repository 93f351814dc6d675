"""Issue 44, points 1 and 2, end to end with a real Mosquitto (the fleet's ACLs and the
service's CRL), the real ``edgefleet serve`` with an issuing CA, and a real cloudsync enrolled
by token.

- **A revoked device does not come back by renewing** (found: n3, revoked while connected, kept
  publishing and renewed its certificate before the broker reloaded the CRL). Revoked by name:
  its open session is closed at once (the service takes it over), what it still publishes is
  dropped, its renewal is refused, its name cannot enrol again (with a token, by claim, by an
  approval) until an operator reinstates it; after the broker's reload its certificate cannot
  connect, and a session still open under its name (a stolen certificate, another client id)
  can neither publish nor receive (the service's ACL denies the name). The others are
  untouched.
- **An unreadable ACL base loses no revocation** (found: ``acl_base`` missing or not UTF-8 made
  ``POST /v1/revocations`` answer 500 after storing the revocation, without the kick or the
  audit entry): the CRL is still written, the session still kicked, the entry still audited,
  the answer says which file was not written (``unwritten``), the failure is counted, and the
  service's next full pass writes the ACL once its base can be read again.
- **Reserved names are never issued** (found: a token for ``operator`` enrolled a certificate
  with the operators' ACL, which wrote another node's desired state): the operators' CN and the
  service's own names get no token (409) and no certificate by claim.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from cryptography import x509

from cloudsync.protocol.enrol import make_csr, new_key, new_request_id
from cloudsync.protocol.envelope import Envelope, decode
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import client_id
from tests.conftest import wait_for
from tests.fleetservice import FleetService
from tests.integration.cloudsync.test_enrolment import Device, broker, online, service
from tests.mosquitto import OPERATOR, Broker

DROPPED = "edgefleet_revoked_messages_total"  # revoked nodes' messages, dropped
__all__ = ["broker", "service"]  # the fixtures: a broker with the service's CRL, its service


def answer(client: SyncClient, topic: str, request: str, payload: bytes) -> dict[str, object]:
    """The service's answer on ``topic`` to ``payload`` published on ``request``."""
    client.subscribe(topic)
    assert client.publish(request, payload).getName() == "Success", request
    wait_for(lambda: any(t == topic for t, _ in client.received), 20, f"an answer on {topic}")
    body = decode(next(p for t, p in client.received if t == topic)).body
    return dict(body)


def heartbeats(service: FleetService, node: str) -> int:
    return int(service.call("GET", f"/v1/nodes/{node}", role="viewer")[1]["heartbeats"])


def test_a_revoked_node_is_out_connected_or_not(
    tmp_path: Path, broker: Broker, service: FleetService, pki: Path
) -> None:
    token = service.call("POST", "/v1/enrolment-tokens", {"node": "n3"}, role="operator")[1]
    device = Device(tmp_path / "n3", broker, "n3", token["token"]).start()
    # Its certificate, copied by an adversary: a second session, under another client id.
    stolen = tmp_path / "stolen"
    stolen.mkdir()
    shutil.copy(pki / "ca.pem", stolen / "ca.pem")
    try:
        wait_for(lambda: online(service, "n3"), 30, "n3 enrolled and online", device.proc)
        shutil.copy(device.cert, stolen / "n3.pem")
        shutil.copy(device.key, stolen / "n3.key")
        thief = SyncClient(broker.port, stolen, "n3")
        assert thief.connect()

        # an operator may not cut a device off (nor let one back): an admin's call
        for method, path, body in (
            ("POST", "/v1/revocations", {"node": "n3"}),
            ("DELETE", "/v1/revocations/n3", None),
        ):
            assert service.call(method, path, body, role="operator") == (
                403,
                {"error": "role operator may not do this: admin needed"},
            )
        status, gone = service.call("POST", "/v1/revocations", {"node": "n3"}, role="admin")
        assert status == 200 and len(gone["revoked"]) == 1, gone
        # Its own session is closed at once: the service took it over (Mosquitto logs it).
        wait_for(
            lambda: "already connected, closing old connection" in broker.logs(),
            10,
            "n3's session taken over",
        )
        # What it still publishes (it reconnects: the broker has not reloaded) is dropped:
        # three of its messages counted as dropped, and none of its heartbeats counted since.
        before = heartbeats(service, "n3")
        first = service.counter(DROPPED)
        wait_for(lambda: service.counter(DROPPED) >= first + 3, 20, "n3's messages dropped")
        assert heartbeats(service, "n3") == before
        # Connected still, it asks for its next certificate: refused, saying why.
        why = "node 'n3' is revoked: an operator reinstates the name first"
        renewal = Envelope("n3", 1, {"csr": make_csr(new_key(), "n3")}).encode()
        got = answer(thief, "edge/v1/f1/n3/renew/cert", "edge/v1/f1/n3/renew", renewal)
        assert got["state"] == "refused" and why in str(got["error"]), got
        # Its name cannot come back: no token, no request by the claim credential.
        refused = service.call("POST", "/v1/enrolment-tokens", {"node": "n3"}, role="operator")
        assert refused[0] == 409 and why in refused[1]["error"], refused
        claim = SyncClient(broker.port, pki, "claim")
        assert claim.connect()
        rid = new_request_id()
        request = Envelope("n3", 1, {"csr": make_csr(new_key(), "n3")}).encode()
        got = answer(claim, f"edge/v1/f1/_enrol/{rid}/cert", f"edge/v1/f1/_enrol/{rid}", request)
        assert got["state"] == "refused" and why in str(got["error"]), got  # not pending
        claim.close()
        listed = service.edgefleet("enrol", "list", "--state", "pending")
        assert listed == []

        # The service wrote the name's denial into the broker's ACL; the broker reloads it and
        # the CRL. The thief's session, still open, can neither publish nor receive: Mosquitto
        # checks a user's denials on each publish and each delivery.
        assert "user n3\ntopic deny #\n" in (broker.workdir / "acl").read_text()
        watcher = SyncClient(broker.port, pki, OPERATOR)
        assert watcher.connect()
        watcher.subscribe("edge/v1/f1/n3/#")
        broker.reload()
        wait_for(
            lambda: thief.publish("edge/v1/f1/n3/heartbeat", b"{}").getName() == "Not authorized",
            10,
            "the thief's publish refused",
        )
        watcher.received.clear()  # what the thief published before the reload took
        assert thief.publish("edge/v1/f1/n3/events", b"[]").getName() == "Not authorized"
        assert watcher.publish("edge/v1/f1/n3/renew/cert", b"late").getName() == "Success"
        # the watcher's own message, published after the thief's, arrived: the thief's did not
        wait_for(lambda: any(p == b"late" for _, p in watcher.received), 10, "the late message")
        assert not [t for t, _ in watcher.received if t.endswith("/events")], watcher.received
        assert [p for t, p in watcher.received if t.endswith("/renew/cert")] == [b"late"]
        assert not [p for t, p in thief.received if p == b"late"], "the thief read a message"
        assert thief.client.is_connected()  # open all along: the ACL, not a disconnection
        watcher.close()
        # The certificate cannot connect again, the others can.
        thief.close()
        again = SyncClient(broker.port, stolen, "n3")
        assert not again.connect(timeout=5), "a revoked certificate connected"
        again.close()
        time.sleep(3)
        assert not online(service, "n3") or heartbeats(service, "n3") == before
        other = SyncClient(broker.port, pki, "n1")
        assert other.connect()
        other.close()

        # Reinstated, the name enrols again as a new device would (its old certificate stays
        # revoked); the audit log has both.
        assert service.edgefleet("enrol", "reinstate", "n3", role="admin") == {
            "node": "n3",
            "barred": False,
            "unwritten": [],
        }
        assert "user n3\n" not in (broker.workdir / "acl").read_text()
        assert (
            service.call("POST", "/v1/enrolment-tokens", {"node": "n3"}, role="operator")[0] == 201
        )
        listed = service.call("GET", "/v1/revocations", role="operator")[1]
        assert listed["barred"] == [] and [r["node"] for r in listed["revoked"]] == ["n3"]
        audit = service.call("GET", "/v1/audit", role="operator")[1]["entries"]
        actions = [(e["action"], e["target"], e["outcome"]) for e in audit]
        assert ("revoke certificate", "n3", "done") in actions
        assert ("reinstate node", "n3", "done") in actions
    finally:
        device.stop()


def test_an_unreadable_acl_base_loses_no_revocation(
    tmp_path: Path, broker: Broker, service: FleetService, pki: Path
) -> None:
    base, acl, crl = tmp_path / "acl.base", broker.workdir / "acl", tmp_path / "fleet.crl"
    rules = base.read_bytes()
    base.write_bytes(b"\xff\xfe not UTF-8 \x80\n")
    n1 = SyncClient(broker.port, pki, "n1", client_id=client_id("f1", "n1"))  # taken over

    assert n1.connect()
    try:
        status, gone = service.call("POST", "/v1/revocations", {"node": "n1"}, role="admin")
        assert (status, gone) == (200, {"revoked": [], "unwritten": ["acl_file"]})
        wait_for(
            lambda: "already connected, closing old connection" in broker.logs(),
            10,
            "n1's session taken over",
        )
        assert "user n1\n" not in acl.read_text()  # the broker's ACL as it was, not truncated
        assert "topic" in acl.read_text()
        # One certificate by its serial: the CRL is signed again though the ACL still fails.
        base.unlink()
        serial = format(
            x509.load_pem_x509_certificate((pki / "n1.pem").read_bytes()).serial_number, "x"
        )
        status, gone = service.call("POST", "/v1/revocations", {"serial": serial}, role="admin")
        assert (status, gone) == (200, {"revoked": [serial], "unwritten": ["acl_file"]})
        listed = x509.load_pem_x509_crl(crl.read_bytes())
        assert [r.serial_number for r in listed] == [int(serial, 16)]
        audit = service.call("GET", "/v1/audit", role="operator")[1]["entries"]
        done = [
            (e["target"], e["outcome"], e["detail"])
            for e in audit
            if e["action"] == "revoke certificate"
        ]
        assert done == [
            ("n1", "done", {"serials": [], "unwritten": ["acl_file"]}),
            (serial, "done", {"serials": [serial], "unwritten": ["acl_file"]}),
        ]
        metrics = service.call("GET", "/metrics", role=None)[1]
        assert 'edgefleet_broker_file_errors_total{file="acl_file"} 2.0' in metrics, metrics
        assert 'file="crl_file"' not in metrics
        # Readable again: the next full pass writes the ACL, the name denied.
        base.write_bytes(rules)
        wait_for(
            lambda: "user n1\ntopic deny #\n" in acl.read_text(),
            30,
            "the ACL written by the next full pass",
        )
    finally:
        n1.close()


def test_reserved_names_get_no_token_and_no_certificate(
    broker: Broker, service: FleetService, pki: Path
) -> None:
    # the operators' CN, operator-NAME, the service's identity: each refused, saying so
    for name in (OPERATOR, "operator-alice", "edgefleet"):
        status, body = service.call("POST", "/v1/enrolment-tokens", {"node": name}, role="operator")
        assert status == 409, (name, status, body)
        assert body["error"] == f"node {name!r}: a reserved name (the broker gives it other rights)"
    claim = SyncClient(broker.port, pki, "claim")
    assert claim.connect()
    try:
        rid = new_request_id()
        request = Envelope(OPERATOR, 1, {"csr": make_csr(new_key(), OPERATOR)}).encode()
        got = answer(claim, f"edge/v1/f1/_enrol/{rid}/cert", f"edge/v1/f1/_enrol/{rid}", request)
        assert got == {
            "state": "refused",
            "error": "node 'operator': a reserved name (the broker gives it other rights)",
        }
    finally:
        claim.close()
    # nothing waits for an operator's approval, so nothing can be approved by mistake
    assert service.edgefleet("enrol", "list", "--state", "pending") == []
