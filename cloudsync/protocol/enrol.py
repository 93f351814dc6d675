"""Enrolment: how a new device gets its own certificate with nothing placed by hand but the
claim credential (docs/PROTOCOL.md, "Enrolment"), as AWS IoT fleet provisioning by claim does.

1. The device makes its key (it never leaves the device) and a CSR whose CN is its node name.
2. With the claim certificate (whose CN holds a ``+``: the broker's node pattern gives it
   nothing; its ACL lets it write ``edge/v1/{fleet}/_enrol/{rid}`` and read ``.../cert`` only)
   it subscribes to the answer topic and publishes ``{"csr", "token"?}`` in an envelope whose
   ``node`` is the name it asks for, again every RETRY_S until it is answered.
3. The fleet service answers ``{"state": "issued", "cert", "ca"}`` at once for a one-time
   enrolment token made for that name (``edgefleet enrol token``), else ``{"state":
   "pending"}`` until an operator approves (``edgefleet enrol approve``) or refuses
   (``{"state": "refused", "error"}``). A request sent again gets the same answer.
4. The device checks the certificate (its key, its name, signed by the fleet CA it trusts),
   writes it beside its key and connects as itself.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

MAX_PEM = 16384  # characters of a CSR or a certificate chain in a message
RETRY_S = 30.0  # a device sends its request again this often until answered
STATES = ("issued", "pending", "refused")


class EnrolError(ValueError):
    """A request or an answer that is not what the contract says (the message names it)."""


def new_request_id() -> str:
    return secrets.token_hex(16)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(key: ec.EllipticCurvePrivateKey, node: str) -> str:
    """A CSR for ``node`` (its CN), signed by its key, as PEM."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def common_name(name: x509.Name) -> str | None:
    found = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(found[0].value) if len(found) == 1 else None


def check_csr(pem: Any, node: str) -> x509.CertificateSigningRequest:
    """The CSR of a request for ``node``: PEM, its signature good, its CN the node, its key
    an EC P-256/P-384, Ed25519 or RSA of at least 2048 bits (EnrolError naming what is not)."""
    if not isinstance(pem, str) or len(pem) > MAX_PEM:
        raise EnrolError(f"csr: a PEM certificate request of at most {MAX_PEM} characters")
    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except ValueError as exc:
        raise EnrolError(f"csr: not a PEM certificate request ({exc})") from None
    if not csr.is_signature_valid:
        raise EnrolError("csr: its signature does not verify")
    if common_name(csr.subject) != node:
        raise EnrolError(f"csr: its CN must be the node's name, {node}")
    key = csr.public_key()
    curves = ("secp256r1", "secp384r1")
    ok = (
        (isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in curves)
        or isinstance(key, ed25519.Ed25519PublicKey)
        or (isinstance(key, rsa.RSAPublicKey) and key.key_size >= 2048)
    )
    if not ok:
        raise EnrolError("csr: its key must be EC P-256 or P-384, Ed25519, or RSA >= 2048")
    return csr


def public_der(key: Any) -> bytes:
    return bytes(
        key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


@dataclass(frozen=True)
class Answer:
    state: str  # issued, pending or refused
    cert: str = ""  # PEM: the node's certificate
    ca: str = ""  # PEM: the CA that issued it
    error: str = ""

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state}
        if self.state == "issued":
            body |= {"cert": self.cert, "ca": self.ca}
        if self.error:
            body["error"] = self.error
        return body


def read_answer(
    body: Any, key: ec.EllipticCurvePrivateKey, node: str, trusted: x509.Certificate | None
) -> Answer:
    """The fleet's answer, checked: an issued certificate must be for this key and this name,
    within its validity, and signed by ``trusted`` (the fleet CA the device already has) when
    given (EnrolError otherwise)."""
    if not isinstance(body, dict) or body.get("state") not in STATES:
        raise EnrolError(f"answer: a state, one of {', '.join(STATES)}")
    if body["state"] != "issued":
        return Answer(body["state"], error=str(body.get("error", ""))[:500])
    pem = body.get("cert")
    if not isinstance(pem, str) or len(pem) > MAX_PEM:
        raise EnrolError("answer.cert: a PEM certificate")
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
    except ValueError as exc:
        raise EnrolError(f"answer.cert: not a PEM certificate ({exc})") from None
    if public_der(cert.public_key()) != public_der(key.public_key()):
        raise EnrolError("answer.cert: not for this device's key")
    if common_name(cert.subject) != node:
        raise EnrolError(f"answer.cert: its CN is not {node}")
    if trusted is not None:
        try:
            cert.verify_directly_issued_by(trusted)
        except (ValueError, TypeError) as exc:
            raise EnrolError(f"answer.cert: not issued by the fleet CA ({exc})") from None
        except Exception as exc:  # InvalidSignature
            raise EnrolError("answer.cert: not signed by the fleet CA") from exc
    ca = body.get("ca") if isinstance(body.get("ca"), str) else ""
    return Answer("issued", pem, str(ca)[:MAX_PEM])
