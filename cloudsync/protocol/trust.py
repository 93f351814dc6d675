"""The fleet's trust, updated over MQTT: which keys sign for the fleet (added and retired with
threshold signatures, as TUF rotates its root keys), and which certificates of the fleet's
endpoints (the broker, the download servers) nodes no longer accept.

A trust document, retained on a node's ``desired/trust``::

    {"signed": {"type": "trust", "spec": 1, "version": 4, "threshold": 2,
                "keys": {"fleet-2": {"public": "<base64 of the raw Ed25519 key>"},
                         "ops-1": {"public": "...", "commands": ["drain", "resume"]}},
                "revoked": ["<SHA-256 of a certificate's DER, hex>", ...],
                "expires": 1765000000000},
     "signatures": [{"kid": "fleet-1", "sig": "..."}, ...]}

A node takes it when its ``version`` is above the one in force (0: the keys provisioned in
``trust_dir`` and ``[delivery] threshold``), it has not expired, and it is signed by the
threshold of the keys in force **and** by its own threshold of its own keys (a new key proves
that someone holds it; a set no one can sign for is never taken). Only keys without a
``commands`` scope sign manifests and trust documents, as in ``trust_dir``. From then on the
document's keys, scopes and threshold replace the provisioned ones (commands, manifests, the
next trust document), and a TLS peer whose certificate is in ``revoked`` is refused
(``refuse_revoked``). What a node took is kept (``TrustState``: the chain of documents), so a
restart keeps it and an older document is never taken again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import ssl
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from cloudsync.protocol.envelope import now_ms
from cloudsync.protocol.manifest import MAX_SIGNATURES, ManifestError, signers
from cloudsync.protocol.manifest import sign as sign  # a trust document is signed as a manifest
from edged.common.atomic import write_atomic

log = logging.getLogger(__name__)

SPEC = 1
TRUST_FILE = "trust.json"  # beside the outbox: the document in force
MAX_KEYS = 64
MAX_CHAIN = 1000  # documents a node keeps (each verified again at every start)
MAX_REVOKED = 1000  # endpoints (brokers, download servers): well under an envelope
KID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
COMMAND = re.compile(r"^[a-z][a-z0-9-]{0,31}\Z")
FINGERPRINT = re.compile(r"^[0-9a-f]{64}\Z")


class TrustError(Exception):
    """A trust document that must not be taken; the message says why."""


@dataclass(frozen=True)
class Trust:
    """The keys in force, their scopes, the threshold, and the revoked certificates."""

    version: int
    anchors: dict[str, Ed25519PublicKey]
    scopes: dict[str, frozenset[str]] = field(default_factory=dict)
    threshold: int = 1
    revoked: frozenset[str] = frozenset()

    @property
    def signing(self) -> dict[str, Ed25519PublicKey]:
        """The keys that sign manifests and trust documents: those without a command scope."""
        return {kid: key for kid, key in self.anchors.items() if kid not in self.scopes}


def raw(key: Ed25519PublicKey) -> str:
    return base64.b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def fingerprint(der: bytes) -> str:
    """A certificate's SHA-256 (of its DER), as ``revoked`` lists it."""
    return hashlib.sha256(der).hexdigest()


def make(
    version: int,
    keys: dict[str, tuple[Ed25519PublicKey, list[str] | None]],
    threshold: int,
    revoked: list[str] | None = None,
    lifetime_s: float = 30 * 24 * 3600.0,
) -> dict[str, Any]:
    """The ``signed`` part of a trust document (kid -> (key, its command scope or None)),
    checked as a node checks it."""
    signed = {
        "type": "trust",
        "spec": SPEC,
        "version": version,
        "threshold": threshold,
        "keys": {
            kid: {"public": raw(key), **({"commands": scope} if scope is not None else {})}
            for kid, (key, scope) in keys.items()
        },
        "revoked": sorted(set(revoked or [])),
        "expires": now_ms() + int(1000 * lifetime_s),
    }
    parse_signed(signed)
    return signed


def _version(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**53:
        raise TrustError(f"'{what}' must be a positive integer")
    return value


def parse_signed(signed: Any) -> Trust:
    """The ``signed`` part's fields, checked; TrustError names what is wrong."""
    if not isinstance(signed, dict):
        raise TrustError("'signed' must be an object")
    if signed.get("type") != "trust" or signed.get("spec") != SPEC:
        raise TrustError(f"not a trust document of spec {SPEC}")
    version = _version(signed.get("version"), "version")
    threshold = _version(signed.get("threshold"), "threshold")
    keys, revoked = signed.get("keys"), signed.get("revoked", [])
    if not isinstance(keys, dict) or not 1 <= len(keys) <= MAX_KEYS:
        raise TrustError(f"'keys' must hold 1 to {MAX_KEYS} keys by kid")
    anchors: dict[str, Ed25519PublicKey] = {}
    scopes: dict[str, frozenset[str]] = {}
    for kid, row in keys.items():
        if not KID.fullmatch(kid) or not isinstance(row, dict) or set(row) - {"public", "commands"}:
            raise TrustError(f"key '{kid[:64]}': a kid and {{public, commands}}")
        try:
            data = base64.b64decode(row.get("public", ""), validate=True)
            anchors[kid] = Ed25519PublicKey.from_public_bytes(data)
        except (TypeError, ValueError, binascii.Error):
            raise TrustError(f"key '{kid}': 'public' is not a base64 raw Ed25519 key") from None
        if "commands" in row:
            scope = row["commands"]
            if not isinstance(scope, list) or not all(
                isinstance(c, str) and COMMAND.fullmatch(c) for c in scope
            ):
                raise TrustError(f"key '{kid}': 'commands' must be a list of command names")
            scopes[kid] = frozenset(scope)
    signing = {raw(k) for kid, k in anchors.items() if kid not in scopes}
    if len(signing) < threshold:
        raise TrustError(
            f"threshold {threshold} with {len(signing)} distinct signing key(s): no one could"
            " sign for the fleet"
        )
    if not isinstance(revoked, list) or len(revoked) > MAX_REVOKED:
        raise TrustError(f"'revoked' must list at most {MAX_REVOKED} certificate fingerprints")
    if not all(isinstance(r, str) and FINGERPRINT.fullmatch(r) for r in revoked):
        raise TrustError("'revoked': each a certificate's SHA-256, 64 lowercase hex digits")
    expires = signed.get("expires")
    if isinstance(expires, bool) or not isinstance(expires, int):
        raise TrustError("'expires' must be ms since the epoch")
    return Trust(version, anchors, scopes, threshold, frozenset(revoked))


def verify(doc: Any, current: Trust, now: int | None = None) -> Trust:
    """The trust document's content when a node with ``current`` must take it; TrustError says
    why not."""
    if not isinstance(doc, dict) or not isinstance(doc.get("signatures"), list):
        raise TrustError('a trust document is {"signed": {...}, "signatures": [...]}')
    if len(doc["signatures"]) > MAX_SIGNATURES:
        raise TrustError(f"more than {MAX_SIGNATURES} signatures")
    new = parse_signed(doc.get("signed"))
    if new.version <= current.version:
        raise TrustError(f"version {new.version} is not above {current.version}, in force here")
    now = now_ms() if now is None else now
    if int(doc["signed"]["expires"]) <= now:
        raise TrustError("expired: a trust document replayed after its time (freeze)")
    for keys, threshold, whose in (
        (current.signing, current.threshold, "the keys in force"),
        (new.signing, new.threshold, "its own keys"),
    ):
        try:
            good, why = signers(doc, keys)
        except ManifestError as exc:
            raise TrustError(str(exc)) from None
        if len(good) < threshold:
            detail = f" ({'; '.join(why)})" if why else ""
            raise TrustError(
                f"{len(good)} valid signature(s) by {whose}, {threshold} needed{detail}"
            )
    return new


class TrustState:
    """The trust in force on a node: the provisioned keys, then each document it took, in
    order (``{path}``: ``{"chain": [document, ...]}``, written whole before the new one is
    used). The chain is verified again at every start, from the provisioned keys (so a root
    program, edged-updater, can rely on it without trusting whoever wrote the file). A file
    that cannot be read or does not verify gives no keys at all (nothing signed is taken) until
    it is repaired or removed: falling back to the provisioned keys would bring retired keys
    back."""

    def __init__(self, path: Path, provisioned: Trust) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.error = ""
        self.current = provisioned
        self.chain: list[Any] = []
        try:
            kept = json.loads(path.read_bytes())
            chain = kept.get("chain") if isinstance(kept, dict) else None
            if not isinstance(chain, list) or len(chain) > MAX_CHAIN:
                raise TrustError(f'not {{"chain": [at most {MAX_CHAIN} documents]}}')
            for doc in chain:  # expiry was checked when each was taken
                self.current = verify(doc, self.current, now=0)
            self.chain = chain
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TrustError) as exc:
            self.error = (
                f"the trust file {path} cannot be used ({exc}): nothing signed is taken until it"
                " is repaired or removed"
            )
            log.error("%s", self.error)
            self.current = Trust(provisioned.version, {}, {}, 1, provisioned.revoked)

    def offer(self, doc: Any) -> Trust | None:
        """Take ``doc`` when it verifies (the new trust), None when it is the one in force
        (a retained message again); TrustError when it is refused; OSError when it cannot be
        kept (not taken)."""
        with self.lock:
            signed = doc.get("signed") if isinstance(doc, dict) else None
            if isinstance(signed, dict) and signed.get("version") == self.current.version:
                return None
            if len(self.chain) >= MAX_CHAIN:
                raise TrustError(f"{MAX_CHAIN} documents taken: start again from trust_dir")
            new = verify(doc, self.current)
            write_atomic(self.path, json.dumps({"chain": [*self.chain, doc]}) + "\n")
            self.chain.append(doc)
            self.current = new
            self.error = ""
            return new

    def revoked(self) -> frozenset[str]:
        return self.current.revoked


def refuse_revoked(
    context: ssl.SSLContext, revoked: Callable[[], Collection[str]]
) -> ssl.SSLContext:
    """``context``, whose TLS connections end at the handshake when the peer's certificate is
    one that ``revoked()`` lists (paho and urllib both call ``do_handshake``)."""

    class Checked(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            super().do_handshake(block)
            der = self.getpeercert(binary_form=True)
            if der is not None and fingerprint(der) in revoked():
                raise ssl.SSLCertVerificationError(
                    f"the certificate of {self.server_hostname} (SHA-256 {fingerprint(der)[:16]})"
                    " is revoked by the fleet's trust document"
                )

    context.sslsocket_class = Checked
    return context
