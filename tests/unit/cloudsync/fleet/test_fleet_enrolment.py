"""Enrolment's rules (issue 26), on a real SQLite file and a real PostgreSQL: a token is good
once, for its name, until it expires; a request sent again gets the same answer and another
CSR under its id is refused; a CSR must be for the name asked and signed by its key; at most
MAX_PENDING wait; an operator's decision is taken once; the device checks what it is given."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloudsync.agent.config import Config
from cloudsync.agent.enrol import settle
from cloudsync.fleet import enrolment
from cloudsync.fleet.enrolment import Enrolments, Issuer
from cloudsync.protocol.enrol import (
    EnrolError,
    check_csr,
    make_csr,
    new_key,
    new_request_id,
    public_der,
    read_answer,
)
from cloudsync.protocol.envelope import Envelope
from tests.pki import issue
from tests.postgres import fleet_store

NOW = 1_800_000_000_000


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ca")
    issue("fleet CA", None, directory, "ca")
    issue("another CA", None, directory, "other")
    return directory


@pytest.fixture(params=["sqlite", "postgresql"])
def enrolments(request: pytest.FixtureRequest, tmp_path: Path, ca: Path) -> Iterator[Enrolments]:
    cluster = request.getfixturevalue("postgres_cluster") if request.param != "sqlite" else None
    store = fleet_store(request.param, tmp_path, cluster)
    yield Enrolments(store, Issuer(ca / "ca.pem", ca / "ca.key", 30))
    store.close()


def ask(
    enrolments: Enrolments,
    node: str,
    csr: str,
    token: str | None = None,
    rid: str = "",
    at: int = NOW,
) -> tuple[str, dict[str, object]]:
    rid = rid or new_request_id()
    body: dict[str, object] = {"csr": csr} | ({"token": token} if token else {})
    with enrolments.store.transaction() as tx:
        done = enrolments.request(tx, rid, Envelope(node, 1, body).encode(), at)
    return rid, done.answer.body()


def test_a_token_is_good_once_for_its_name_until_it_expires(
    enrolments: Enrolments, ca: Path
) -> None:
    key = new_key()
    token = enrolments.make_token("n9", 600, "alice", NOW)
    _, wrong_name = ask(enrolments, "n8", make_csr(new_key(), "n8"), token)
    assert wrong_name["state"] == "refused"
    rid, answer = ask(enrolments, "n9", make_csr(key, "n9"), token)
    assert answer["state"] == "issued"
    trusted = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
    got = read_answer(answer, key, "n9", trusted)
    cert = x509.load_pem_x509_certificate(got.cert.encode())
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(
        days=30, minutes=5
    )
    _, twice = ask(enrolments, "n9", make_csr(new_key(), "n9"), token)
    why = "the token is unknown, used, expired or for another name"
    assert twice == {"state": "refused", "error": why}
    late = enrolments.make_token("n7", 60, "alice", NOW)
    _, expired = ask(enrolments, "n7", make_csr(new_key(), "n7"), late, at=NOW + 61_000)
    assert expired["state"] == "refused"
    rows = {r["rid"]: r for r in enrolments.list()}
    assert (rows[rid]["state"], rows[rid]["how"], rows[rid]["decided_by"]) == (
        "issued",
        "token",
        "token",
    )
    assert rows[rid]["serial"] == format(cert.serial_number, "x")


def test_a_request_again_gets_the_same_answer_another_csr_under_its_id_is_refused(
    enrolments: Enrolments,
) -> None:
    key = new_key()
    csr = make_csr(key, "n9")
    token = enrolments.make_token("n9", 600, "alice", NOW)
    rid, first = ask(enrolments, "n9", csr, token)
    _, again = ask(enrolments, "n9", csr, token, rid=rid)  # the token is used, the answer kept
    assert again == first and first["state"] == "issued"
    _, other = ask(enrolments, "n9", make_csr(new_key(), "n9"), rid=rid)
    assert other == {"state": "refused", "error": "another request has this id"}


def test_without_a_token_an_operator_decides_once(enrolments: Enrolments) -> None:
    rid, answer = ask(enrolments, "n10", make_csr(new_key(), "n10"))
    assert answer == {"state": "pending"}
    assert [r["rid"] for r in enrolments.list("pending")] == [rid]
    done = enrolments.decide(rid, True, "bob", NOW + 5)
    assert done is not None and done.answer.state == "issued"
    assert enrolments.decide(rid, False, "bob", NOW + 6) is None  # decided already
    rid2, _ = ask(enrolments, "n11", make_csr(new_key(), "n11"))
    refused = enrolments.decide(rid2, False, "bob", NOW + 7, "not ours")
    assert refused is not None and refused.answer.body() == {
        "state": "refused",
        "error": "not ours",
    }
    _, again = ask(enrolments, "n11", "", rid=rid2)
    assert again["state"] == "refused"  # another CSR under the id
    assert {r["state"] for r in enrolments.list()} == {"issued", "refused"}


def test_a_bad_csr_is_refused_naming_why(enrolments: Enrolments) -> None:
    key = new_key()
    _, other_name = ask(enrolments, "n9", make_csr(key, "n8"))
    assert other_name == {"state": "refused", "error": "csr: its CN must be the node's name, n9"}
    _, garbage = ask(enrolments, "n9", "-----BEGIN CERTIFICATE REQUEST-----\nxx\n")
    assert garbage["state"] == "refused" and str(garbage["error"]).startswith("csr: not a PEM")
    _, huge = ask(enrolments, "n9", "x" * 20_000)
    assert "at most 16384" in str(huge["error"])
    weak = ec.generate_private_key(ec.SECP192R1()) if hasattr(ec, "SECP192R1") else None
    if weak is not None:
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n9")]))
            .sign(weak, hashes.SHA256())
        )
        pem = csr.public_bytes(serialization.Encoding.PEM).decode()
        _, small = ask(enrolments, "n9", pem)
        assert "its key must be" in str(small["error"])
    with pytest.raises(EnrolError, match="32 hex"):
        ask(enrolments, "n9", make_csr(key, "n9"), rid="../../x")
    assert enrolments.list() == []  # nothing refused at the door was kept


def test_at_most_max_pending_wait(enrolments: Enrolments, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enrolment, "MAX_PENDING", 3)
    answers = [ask(enrolments, f"n{i}", make_csr(new_key(), f"n{i}"))[1] for i in range(5)]
    assert [a["state"] for a in answers] == ["pending"] * 3 + ["refused"] * 2
    assert "3 requests wait for an operator" in str(answers[-1]["error"])


def test_the_device_checks_what_it_is_given(enrolments: Enrolments, ca: Path) -> None:
    key = new_key()
    token = enrolments.make_token("n9", 600, "alice", NOW)
    _, answer = ask(enrolments, "n9", make_csr(key, "n9"), token)
    trusted = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
    other = x509.load_pem_x509_certificate((ca / "other.pem").read_bytes())
    with pytest.raises(EnrolError, match="not for this device's key"):
        read_answer(answer, new_key(), "n9", trusted)
    with pytest.raises(EnrolError, match="its CN is not n8"):
        read_answer(answer, key, "n8", trusted)
    with pytest.raises(EnrolError, match=r"not .*the fleet CA"):
        read_answer(answer, key, "n9", other)
    with pytest.raises(EnrolError, match="a state"):
        read_answer({"state": "maybe"}, key, "n9", trusted)
    assert read_answer({"state": "pending"}, key, "n9", trusted).state == "pending"
    assert check_csr(make_csr(key, "n9"), "n9").is_signature_valid


def test_a_renewal_cut_short_settles_on_the_pair_that_goes_together(
    tmp_path: Path, ca: Path
) -> None:
    issuer = Issuer(ca / "ca.pem", ca / "ca.key", 1)
    now = datetime.datetime.now(datetime.timezone.utc)
    old_key, new = new_key(), new_key()

    def pem_of(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def cert_of(key: ec.EllipticCurvePrivateKey) -> bytes:
        csr = check_csr(make_csr(key, "n9"), "n9")
        return issuer.issue(csr, "n9", now).public_bytes(serialization.Encoding.PEM)

    cert, key, nxt = tmp_path / "device.pem", tmp_path / "device.key", tmp_path / "device.pem.next"
    config = Config.model_validate({"mqtt": {"cert_file": str(cert), "key_file": str(key)}})
    # cut after the new key was written, before the certificate was renamed: the new pair
    cert.write_bytes(cert_of(old_key))
    key.write_bytes(pem_of(new))
    nxt.write_bytes(cert_of(new))
    settle(config)
    assert not nxt.exists() and cert.read_bytes() != cert_of(old_key)
    assert public_der(x509.load_pem_x509_certificate(cert.read_bytes()).public_key()) == public_der(
        new.public_key()
    )
    # cut before the key: the old pair stays, the stray certificate goes
    kept = cert_of(old_key)
    cert.write_bytes(kept)
    key.write_bytes(pem_of(old_key))
    nxt.write_bytes(cert_of(new_key()))
    settle(config)
    assert not nxt.exists() and cert.read_bytes() == kept


def renew(enrolments: Enrolments, node: str, at: int = NOW, seq: int = 1) -> dict[str, object]:
    payload = Envelope(node, seq, {"csr": make_csr(new_key(), node)}).encode()
    with enrolments.store.transaction() as tx:
        return enrolments.renew(tx, node, payload, at).answer.body()


def issued(enrolments: Enrolments, node: str) -> str:
    """A certificate for ``node`` by token: its serial."""
    _, answer = ask(
        enrolments, node, make_csr(new_key(), node), enrolments.make_token(node, 600, "alice", NOW)
    )
    assert answer["state"] == "issued", answer
    cert = x509.load_pem_x509_certificate(str(answer["cert"]).encode())
    return format(cert.serial_number, "x")


def test_reserved_names_are_never_issued(enrolments: Enrolments) -> None:
    """Issue 44: CN=operator has the operators' ACL on the broker; no token, request or
    approval may make one (nor operator-NAME, nor the service's own names)."""
    enrolments.reserved = ("operator", "operator-*", "edgefleet")
    for name in ("operator", "operator-alice", "edgefleet"):
        with pytest.raises(EnrolError, match=f"node '{name}': a reserved name"):
            enrolments.make_token(name, 600, "alice", NOW)
        rid, answer = ask(enrolments, name, make_csr(new_key(), name))
        assert answer == {
            "state": "refused",
            "error": f"node {name!r}: a reserved name (the broker gives it other rights)",
        }
        assert enrolments.decide(rid, True, "bob", NOW) is None  # nothing pending to approve
    assert renew(enrolments, "operator")["state"] == "refused"
    assert issued(enrolments, "operators") and issued(enrolments, "n-operator")  # not patterns


def test_a_node_revoked_by_name_gets_nothing_more_until_reinstated(
    enrolments: Enrolments,
) -> None:
    """Issue 44: a revoked node renewed its certificate (and could enrol again under its
    name). Revoked by name, it is barred: no renewal, no token, no request, no approval; its
    unused tokens and pending requests go; reinstated, it enrols again, its old certificates
    still revoked."""
    first = issued(enrolments, "n3")
    spare = enrolments.make_token("n3", 600, "alice", NOW)
    waiting, _ = ask(enrolments, "n3", make_csr(new_key(), "n3"))
    assert renew(enrolments, "n3")["state"] == "issued"
    assert len(enrolments.revoke("carol", NOW + 1, node="n3")) == 2  # the first and the renewed
    barred = (
        "node 'n3' is revoked: an operator reinstates the name first (edgefleet enrol reinstate)"
    )
    assert renew(enrolments, "n3", seq=2) == {"state": "refused", "error": barred}
    _, with_token = ask(enrolments, "n3", make_csr(new_key(), "n3"), spare)
    assert with_token == {"state": "refused", "error": barred}
    _, without = ask(enrolments, "n3", make_csr(new_key(), "n3"))
    assert without == {"state": "refused", "error": barred}
    assert enrolments.decide(waiting, True, "bob", NOW) is None  # refused by the revocation
    assert {r["rid"]: r["reason"] for r in enrolments.list()}[waiting] == "node 'n3' was revoked"
    with pytest.raises(EnrolError, match="is revoked"):
        enrolments.make_token("n3", 600, "alice", NOW)
    assert [b["node"] for b in enrolments.barred()] == ["n3"]
    assert enrolments.reinstate("n3") and not enrolments.reinstate("n3")
    assert issued(enrolments, "n3") not in {r["serial"] for r in enrolments.revoked()}
    assert first in {r["serial"] for r in enrolments.revoked()}


def test_the_brokers_acl_denies_each_barred_name_after_the_fleets_rules(
    enrolments: Enrolments, tmp_path: Path
) -> None:
    base, acl = tmp_path / "rules.acl", tmp_path / "broker.acl"
    base.write_text("pattern read edge/v1/+/%u/#")  # no newline at its end: one is added
    enrolments.revoke("carol", NOW, node="n3")
    enrolments.revoke("carol", NOW, node="a-1")
    enrolments.write_acl(base, acl)
    text = acl.read_text()
    assert text.startswith("pattern read edge/v1/+/%u/#\n\n# Barred by the fleet service")
    assert text.endswith("user a-1\ntopic deny #\nuser n3\ntopic deny #\n")
    assert oct(acl.stat().st_mode & 0o777) == "0o644"  # the broker reads it
    enrolments.reinstate("n3")
    enrolments.write_acl(base, acl)
    assert "user n3" not in acl.read_text() and "user a-1\n" in acl.read_text()
    # a name that is not one (it would be a line of the ACL's own) is never written
    with pytest.raises(ValueError, match="not a node's name"):
        enrolment.write_acl(base, ["n4\ntopic readwrite #"], acl)
    assert "readwrite" not in acl.read_text()


def test_a_node_whose_newest_certificate_is_revoked_renews_no_more(
    enrolments: Enrolments,
) -> None:
    old = issued(enrolments, "n4")
    assert renew(enrolments, "n4", NOW + 1)["state"] == "issued"
    assert enrolments.revoke("carol", NOW + 1, serial=old) == [old]  # an old one: renews on
    assert renew(enrolments, "n4", NOW + 2, seq=2)["state"] == "issued"
    newest = enrolments.list("issued")[0]["serial"]
    assert enrolments.revoke("carol", NOW + 3, serial=newest) == [newest]
    answer = renew(enrolments, "n4", NOW + 4, seq=3)
    assert answer == {
        "state": "refused",
        "error": f"node 'n4': its certificate {newest} is revoked: it enrols again",
    }
    assert issued(enrolments, "n4")  # not barred: a token enrols it again


def test_a_short_lifetime_is_back_dated_by_a_tenth_of_it(ca: Path) -> None:
    """Issue 44: a 35 s certificate back-dated by 5 minutes was due for renewal at once, and
    its node renewed in a loop."""
    issuer = Issuer(ca / "ca.pem", ca / "ca.key", 0.0004)
    now = datetime.datetime.fromtimestamp(NOW / 1000, datetime.timezone.utc)
    cert = issuer.issue(check_csr(make_csr(new_key(), "n5"), "n5"), "n5", now)
    lifetime = datetime.timedelta(days=0.0004)
    second = datetime.timedelta(seconds=1)  # X.509 times are whole seconds
    assert abs(cert.not_valid_before_utc - (now - lifetime / 10)) < second
    assert abs(cert.not_valid_after_utc - (now + lifetime)) < second
