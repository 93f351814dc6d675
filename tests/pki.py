"""Certificates for the tests' TLS: a CA and the certificates it issues, made with
``cryptography`` (ECDSA P-256, valid for a day), written as ``{stem}.pem`` and ``{stem}.key``."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue(
    subject: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    directory: Path,
    stem: str,
    server: bool = False,
    names: tuple[str, ...] = ("localhost", "127.0.0.1"),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``subject`` (``server``: for the host ``names``, DNS names or IP
    addresses), issued by ``issuer`` or self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(issuer[0].subject if issuer else name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([alternative_name(n) for n in names]),
            critical=False,
        )
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


def alternative_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def gateway_pki(directory: Path) -> Path:
    """An API gateway's PKI in ``directory``: ca, gateway (for localhost), device (from the
    CA: edge-node-1) and rogue (from another CA)."""
    ca = issue("fleet CA", None, directory, "ca")
    issue("localhost", ca, directory, "gateway", server=True)
    issue("edge-node-1", ca, directory, "device")
    other = issue("someone else's CA", None, directory, "other-ca")
    issue("edge-node-rogue", other, directory, "rogue")
    return directory
