"""Enrolment on the fleet's side (cloudsync.protocol.enrol): the issuing CA, one-time tokens,
requests and their answers, kept in the database.

- ``Issuer``: the fleet's issuing CA (``[enrolment] ca_cert``, ``ca_key``: PEM) signs a node's
  CSR into a client certificate: CN the node, ``cert_days`` long, clientAuth only, not a CA.
- ``Enrolments.request`` (the writer, in the batch's transaction): a request is checked (its
  CSR: signature, CN = the name asked for, key type), kept by its id, and answered: issued at
  once when it carries a token made for that name, unused and unexpired (the token is used up
  in the same transaction: two requests cannot both use it), refused for a token that is not,
  else pending until an operator decides. The same request again gets the same answer; another
  CSR under a known id is refused. At most MAX_PENDING requests wait.
- ``approve`` / ``refuse``: an operator's decision on a pending request (the API's, audited
  there); ``make_token``: a token for one node name, returned once, kept as its SHA-256.
- ``revoke``: a node's certificates (or one, by serial) into the CRL. A node revoked by name is
  *barred*: it is issued nothing more (no renewal, no enrolment under its name, no token; its
  unused tokens and pending requests are dropped) until an operator ``reinstate``s the name, and
  the service refuses what it still publishes (cloudsync.fleet.registry). A node whose newest
  certificate is revoked by serial renews no more either: it enrols again.
- Reserved names (``[enrolment] reserved``, shell patterns, and the service's own identities):
  never issued, whatever the token or the approval: the broker's ACL gives them other rights.
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import secrets
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloudsync.fleet.store import Store, Tx
from cloudsync.protocol import envelope
from cloudsync.protocol.enrol import Answer, EnrolError, check_csr, public_der
from cloudsync.protocol.topics import NAME, TopicError, check_name, enrol_answer
from edged.common.atomic import write_atomic

MAX_PENDING = 1000  # requests waiting for an operator; more are refused
MAX_TOKEN_S = 30 * 86400


class Issuer:
    """The fleet's issuing CA."""

    def __init__(self, cert_file: Path, key_file: Path, days: float) -> None:
        self.cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        key = serialization.load_pem_private_key(key_file.read_bytes(), None)
        if not isinstance(
            key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey, ed25519.Ed25519PrivateKey)
        ):
            raise OSError(f"{key_file}: not an EC, RSA or Ed25519 private key")
        if public_der(key.public_key()) != public_der(self.cert.public_key()):
            raise OSError(f"{key_file} is not the key of {cert_file}")
        self.key, self.days = key, days
        self.ca_pem = self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(
        self, csr: x509.CertificateSigningRequest, node: str, now: datetime.datetime
    ) -> x509.Certificate:
        key = csr.public_key()
        lifetime = datetime.timedelta(days=self.days)
        # Valid from a little before now (a node's clock may lag), by at most a tenth of the
        # lifetime: a node renews at a share of not_before..not_after, and a back-dating
        # longer than that share had it renew again at once, in a loop.
        backdate = min(datetime.timedelta(minutes=5), lifetime / 10)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
            .issuer_name(self.cert.subject)
            .public_key(key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - backdate)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key),
                critical=False,
            )
        )
        algorithm = None if isinstance(self.key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
        return builder.sign(self.key, algorithm)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode(errors="surrogatepass")).hexdigest()


@dataclass
class Decision:
    """An answer to publish on a request's answer topic (a renewal's: its node's)."""

    rid: str
    answer: Answer
    node: str = ""  # a renewal: the node whose renew/cert topic gets the answer


CRL_DAYS = 7  # a CRL's nextUpdate: the service signs a new one daily, and at each revocation


def write_crl(issuer: Issuer, revoked: list[dict[str, Any]], now_ms: int, path: Path) -> None:
    """The CRL of ``revoked`` (serial, revoked_ts), signed by the issuing CA, written
    atomically (0644: the broker reads it; ``crlfile`` in mosquitto.conf, reloaded on SIGHUP)."""
    now = datetime.datetime.fromtimestamp(now_ms / 1000, datetime.timezone.utc)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        .next_update(now + datetime.timedelta(days=CRL_DAYS))
    )
    for row in revoked:
        when = datetime.datetime.fromtimestamp(row["revoked_ts"] / 1000, datetime.timezone.utc)
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(int(row["serial"], 16))
            .revocation_date(when)
            .build()
        )
    algorithm = None if isinstance(issuer.key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    crl = builder.sign(issuer.key, algorithm)
    write_atomic(path, crl.public_bytes(serialization.Encoding.PEM), 0o644)


ACL_BARRED = """
# Barred by the fleet service (revoked by name; `edgefleet enrol reinstate NAME` lifts it):
# nothing in, nothing out, whatever the session's client id. Written by the service: edit
# [enrolment] acl_base instead.
"""


def write_acl(base: Path, barred: Iterable[str], path: Path) -> None:
    """The broker's ACL: ``base``'s rules, then a ``topic deny #`` section per barred name
    (Mosquitto checks a user's denials before any rule or pattern, on each publish and each
    delivery, and a reload applies them to open sessions), written atomically (0644)."""
    names = sorted(set(barred))
    for name in names:  # names are checked where they come in: never a line of their own
        if not NAME.match(name):
            raise ValueError(f"{name!r}: not a node's name")
    text = base.read_text(encoding="utf-8")
    if not text.endswith("\n"):
        text += "\n"
    text += ACL_BARRED + "".join(f"user {name}\ntopic deny #\n" for name in names)
    write_atomic(path, text.encode(), 0o644)


class Enrolments:
    def __init__(self, store: Store, issuer: Issuer | None, reserved: Collection[str] = ()) -> None:
        self.store, self.issuer = store, issuer
        self.reserved = tuple(reserved)  # shell patterns of names never issued

    def refusal(self, tx: Tx, node: str) -> str | None:
        """Why ``node`` may have no certificate (a reserved name, a barred node), or None."""
        if any(fnmatch.fnmatchcase(node, pattern) for pattern in self.reserved):
            return f"node {node!r}: a reserved name (the broker gives it other rights)"
        if tx.rows("SELECT node FROM barred WHERE node = ?", (node,)):
            return (
                f"node {node!r} is revoked: an operator reinstates the name first"
                " (edgefleet enrol reinstate)"
            )
        return None

    def request(self, tx: Tx, rid: str, payload: bytes, now_ms: int) -> Decision:
        """A device's request (ValueError: one that is not an envelope of the contract)."""
        env = envelope.decode(payload)
        try:
            node = check_name("node", env.node)
            enrol_answer("x", rid)  # a request id of the contract
        except TopicError as exc:
            raise EnrolError(str(exc)) from None
        if self.issuer is None:
            return Decision(rid, Answer("refused", error="this fleet service enrols no one"))
        found = tx.rows("SELECT * FROM enrolments WHERE rid = ?", (rid,))
        csr_text = env.body.get("csr")
        if found:  # the same request again: the same answer
            row = found[0]
            if row["csr"] != csr_text or row["node"] != node:
                return Decision(rid, Answer("refused", error="another request has this id"))
            return Decision(rid, self.answer_of(row))
        try:
            csr = check_csr(csr_text, node)
        except EnrolError as exc:
            return Decision(rid, Answer("refused", error=str(exc)))
        token = env.body.get("token")
        how, state, reason = "approval", "pending", self.refusal(tx, node)
        if reason is not None:  # kept, refused: the same request again gets the same answer
            state = "refused"
        elif token is not None:
            how = "token"
            used = tx.execute(
                "UPDATE enrol_tokens SET used_ts = ?, used_by = ? WHERE sha256 = ? AND node = ?"
                " AND used_ts IS NULL AND expires > ?",
                (now_ms, rid, token_hash(str(token)), node, now_ms),
            )
            state, reason = (
                ("issued", None)
                if used.rowcount == 1
                else ("refused", "the token is unknown, used, expired or for another name")
            )
        elif (
            int(tx.rows("SELECT COUNT(*) AS n FROM enrolments WHERE state = 'pending'")[0]["n"])
            >= MAX_PENDING
        ):
            state, reason = "refused", f"{MAX_PENDING} requests wait for an operator already"
        tx.execute(
            "INSERT INTO enrolments (rid, node, csr, state, how, requested_ts, reason)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rid, node, csr_text, "pending" if state == "issued" else state, how, now_ms, reason),
        )
        if state == "issued":
            return Decision(rid, self._issue(tx, rid, node, csr, now_ms, "token"))
        return Decision(rid, Answer(state, error=reason or ""))

    def renew(self, tx: Tx, node: str, payload: bytes, now_ms: int) -> Decision:
        """A node's request for its next certificate, on its own topic (the broker let only
        that node publish there): issued at once for a CSR for its name; the same request
        again (its envelope id) gets the same answer."""
        env = envelope.decode(payload)
        rid = hashlib.sha256(f"renew/{node}/{env.id}".encode()).hexdigest()[:32]
        if self.issuer is None:
            return Decision(rid, Answer("refused", error="this fleet service issues no one"), node)
        found = tx.rows("SELECT * FROM enrolments WHERE rid = ?", (rid,))
        if found:
            return Decision(rid, self.answer_of(found[0]), node)
        try:
            csr = check_csr(env.body.get("csr"), node)
        except EnrolError as exc:
            return Decision(rid, Answer("refused", error=str(exc)), node)
        # The node's newest certificate, revoked by serial: the one it holds is no credential.
        newest = tx.rows(
            "SELECT e.serial, r.serial AS revoked FROM enrolments e LEFT JOIN revoked r"
            " ON r.serial = e.serial WHERE e.node = ? AND e.state = 'issued'"
            " ORDER BY e.decided_ts DESC, e.not_after DESC LIMIT 1",
            (node,),
        )
        why = self.refusal(tx, node) or (
            f"node {node!r}: its certificate {newest[0]['serial']} is revoked: it enrols again"
            if newest and newest[0]["revoked"]
            else None
        )
        if why is not None:
            tx.execute(
                "INSERT INTO enrolments (rid, node, csr, state, how, requested_ts, decided_ts,"
                " decided_by, reason) VALUES (?, ?, ?, 'refused', 'renewal', ?, ?, 'service', ?)",
                (rid, node, env.body["csr"], now_ms, now_ms, why),
            )
            return Decision(rid, Answer("refused", error=why), node)
        tx.execute(
            "INSERT INTO enrolments (rid, node, csr, state, how, requested_ts) VALUES"
            " (?, ?, ?, 'pending', 'renewal', ?)",
            (rid, node, env.body["csr"], now_ms),
        )
        return Decision(rid, self._issue(tx, rid, node, csr, now_ms, "renewal"), node)

    def _issue(
        self, tx: Tx, rid: str, node: str, csr: x509.CertificateSigningRequest, now_ms: int, by: str
    ) -> Answer:
        assert self.issuer is not None
        now = datetime.datetime.fromtimestamp(now_ms / 1000, datetime.timezone.utc)
        cert = self.issuer.issue(csr, node, now)
        pem = cert.public_bytes(serialization.Encoding.PEM).decode()
        tx.execute(
            "UPDATE enrolments SET state = 'issued', decided_ts = ?, decided_by = ?, cert = ?,"
            " serial = ?, not_after = ? WHERE rid = ?",
            (
                now_ms,
                by,
                pem,
                format(cert.serial_number, "x"),
                int(cert.not_valid_after_utc.timestamp() * 1000),
                rid,
            ),
        )
        return Answer("issued", pem, self.issuer.ca_pem)

    def answer_of(self, row: dict[str, Any]) -> Answer:
        if row["state"] == "issued" and self.issuer is not None:
            return Answer("issued", row["cert"], self.issuer.ca_pem)
        return Answer(row["state"], error=row["reason"] or "")

    def decide(
        self, rid: str, approve: bool, actor: str, now_ms: int, why: str = ""
    ) -> Decision | None:
        """An operator's decision on a pending request (None: no such request pending)."""
        with self.store.transaction() as tx:
            found = tx.rows("SELECT * FROM enrolments WHERE rid = ? AND state = 'pending'", (rid,))
            if not found:
                return None
            row = found[0]
            if approve and self.issuer is None:
                return None
            # reserved, or barred since it was asked: refused, whoever approves
            barred = self.refusal(tx, row["node"]) if approve else None
            if not approve or barred is not None:
                reason = barred or why or f"refused by {actor}"
                tx.execute(
                    "UPDATE enrolments SET state = 'refused', decided_ts = ?, decided_by = ?,"
                    " reason = ? WHERE rid = ?",
                    (now_ms, actor, reason, rid),
                )
                return Decision(rid, Answer("refused", error=reason))
            csr = check_csr(row["csr"], row["node"])
            return Decision(rid, self._issue(tx, rid, row["node"], csr, now_ms, actor))

    def make_token(self, node: str, ttl_s: float, actor: str, now_ms: int) -> str:
        """A one-time token for ``node``, valid ``ttl_s``: returned once, kept as its hash
        (EnrolError: a name that may have none, saying why)."""
        check_name("node", node)
        token = "enrol_" + secrets.token_urlsafe(24)
        with self.store.transaction() as tx:
            why = self.refusal(tx, node)
            if why is not None:
                raise EnrolError(why)
            tx.execute(
                "INSERT INTO enrol_tokens (sha256, node, expires, created_by, created_ts)"
                " VALUES (?, ?, ?, ?, ?)",
                (token_hash(token), node, now_ms + int(ttl_s * 1000), actor, now_ms),
            )
        return token

    def revoke(
        self, actor: str, now_ms: int, node: str | None = None, serial: str | None = None
    ) -> list[str]:
        """Revoke every certificate issued to ``node`` and bar the name, or revoke the one
        certificate with ``serial`` (hex, any the fleet CA signed): the serials newly revoked."""
        with self.store.transaction() as tx:
            if node is not None:
                found = tx.rows(
                    "SELECT serial, node FROM enrolments WHERE node = ? AND state = 'issued'",
                    (node,),
                )
                tx.execute(
                    "INSERT INTO barred (node, barred_ts, barred_by) VALUES (?, ?, ?)"
                    " ON CONFLICT DO NOTHING",
                    (node, now_ms, actor),
                )
                tx.execute("DELETE FROM enrol_tokens WHERE node = ? AND used_ts IS NULL", (node,))
                tx.execute(
                    "UPDATE enrolments SET state = 'refused', decided_ts = ?, decided_by = ?,"
                    " reason = ? WHERE node = ? AND state = 'pending'",
                    (now_ms, actor, f"node {node!r} was revoked", node),
                )
            else:
                issued = tx.rows("SELECT node FROM enrolments WHERE serial = ?", (serial,))
                found = [{"serial": serial, "node": issued[0]["node"] if issued else "?"}]
            done = []
            for row in found:
                made = tx.execute(
                    "INSERT INTO revoked (serial, node, revoked_ts, revoked_by) VALUES"
                    " (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (row["serial"], row["node"], now_ms, actor),
                )
                if made.rowcount == 1:
                    done.append(str(row["serial"]))
        return done

    def reinstate(self, node: str) -> bool:
        """Lift the bar on ``node``'s name (its revoked certificates stay in the CRL): it may
        enrol again, with a token or an approval. False: it was not barred."""
        with self.store.transaction() as tx:
            return tx.execute("DELETE FROM barred WHERE node = ?", (node,)).rowcount == 1

    def revoked(self) -> list[dict[str, Any]]:
        return self.store.query("SELECT * FROM revoked ORDER BY revoked_ts, serial")

    def barred(self) -> list[dict[str, Any]]:
        return self.store.query("SELECT * FROM barred ORDER BY barred_ts, node")

    def is_barred(self, node: str) -> bool:
        """Whether ``node`` was revoked (and not reinstated)."""
        return bool(self.store.query("SELECT 1 FROM barred WHERE node = ?", (node,)))

    def write_crl(self, path: Path, now_ms: int) -> None:
        if self.issuer is not None:
            write_crl(self.issuer, self.revoked(), now_ms, path)

    def write_acl(self, base: Path, path: Path) -> None:
        write_acl(base, [row["node"] for row in self.barred()], path)

    def list(self, state: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The latest requests, newest first (``state``: pending, issued or refused only)."""
        columns = (
            "SELECT rid, node, state, how, requested_ts, decided_ts, decided_by, reason,"
            " serial, not_after FROM enrolments"
        )
        if state is None:
            return self.store.query(f"{columns} ORDER BY requested_ts DESC LIMIT ?", (limit,))
        return self.store.query(
            f"{columns} WHERE state = ? ORDER BY requested_ts DESC LIMIT ?", (state, limit)
        )
