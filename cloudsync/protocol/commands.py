"""Signed commands: only the fleet's keys give orders, each order once, for a short while.

A command is an envelope (``cloudsync.protocol.envelope``) on ``.../cmd/{id}`` whose ``id`` is the
command id and whose body is ``{"name", "args", "target": "{fleet}/{node}", "exp", "nonce"}``;
beside the body, ``kid`` names the signing key and ``sig`` is the Ed25519 signature (base64) of
the canonical bytes of the envelope without ``sig``. A node runs it only when:

- ``kid`` is one of its trust anchors (``{trust_dir}/{kid}.pub``, a PEM Ed25519 public key);
- the signature verifies (forged, or altered in any byte: refused);
- the key may give this command: a key with a scope file beside it (``{kid}.commands``, the
  command names it may sign, one per line) gives only those, and signs no manifest (the fleet
  service's deploy key: ``rollback``); a key without one gives every command;
- ``target`` is this node (a command for another node cannot be replayed here);
- it has not expired (``exp``, ms since the epoch), its ``ts`` is not in the future beyond the
  allowed clock skew, and ``exp - ts`` is at most ``max_lifetime_s``;
- its ``nonce`` was never seen (nonces are kept on disk until their command expires, so a
  replay after a restart is refused too).

Anything else is refused, and the refusal is reported (a result with ``ok: false`` and the
reason, and an alert), never run.
"""

from __future__ import annotations

import base64
import binascii
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cloudsync.protocol.envelope import Envelope, EnvelopeError, canonical, decode, new_id, now_ms

# the commands a node runs (docs/PROTOCOL.md lists them; the operators' tools offer these)
COMMANDS = (
    "ping, status, models, versions, activate, rollback, cloud-ab, routing, set-routing,"
    " reset-routing, reload, drain, resume, logs"
)
MAX_LIFETIME_S = 3600.0
CLOCK_SKEW_S = 60.0


class Refused(Exception):
    """A command that must not run; the message says why."""


@dataclass(frozen=True)
class Command:
    id: str
    name: str
    args: dict[str, Any]
    issuer: str  # the envelope's node: the operator
    kid: str


def sign(
    key: Ed25519PrivateKey,
    kid: str,
    issuer: str,
    target: str,
    name: str,
    args: dict[str, Any] | None = None,
    lifetime_s: float = 300.0,
    cmd_id: str | None = None,
) -> tuple[str, bytes]:
    """A signed command for ``target`` (``fleet/node``): (its id, the payload to publish)."""
    ts = now_ms()
    body = {
        "name": name,
        "args": args or {},
        "target": target,
        "exp": ts + int(1000 * lifetime_s),
        "nonce": new_id(),
    }
    env = Envelope(issuer, ts, body, cmd_id or new_id(), ts, extra={"kid": kid})
    signature = key.sign(canonical(env.as_dict()))
    signed = Envelope(
        env.node,
        env.seq,
        env.body,
        env.id,
        env.ts,
        extra={"kid": kid, "sig": base64.b64encode(signature).decode()},
    )
    return signed.id, signed.encode()


def load_anchors(trust_dir: Path) -> dict[str, Ed25519PublicKey]:
    """The trust anchors: every ``{kid}.pub`` (PEM Ed25519 public key) in ``trust_dir``."""
    anchors: dict[str, Ed25519PublicKey] = {}
    if not trust_dir.is_dir():
        return anchors
    for path in sorted(trust_dir.glob("*.pub")):
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except ValueError:
            raise OSError(f"trust anchor {path}: not a PEM public key") from None
        if isinstance(key, Ed25519PublicKey):
            anchors[path.stem] = key
    return anchors


def load_scopes(trust_dir: Path) -> dict[str, frozenset[str]]:
    """The scoped keys: ``{kid}.commands`` beside ``{kid}.pub``, the commands that key may sign
    (one name per line, ``#`` comments); a key with a scope signs no manifest."""
    scopes: dict[str, frozenset[str]] = {}
    if not trust_dir.is_dir():
        return scopes
    for path in sorted(trust_dir.glob("*.commands")):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise OSError(f"key scope {path}: not UTF-8 text") from None
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        scopes[path.stem] = frozenset(line for line in lines if line)
    return scopes


class Verifier:
    """Checks commands for one node; remembers nonces in a SQLite table until they expire."""

    def __init__(
        self,
        target: str,
        anchors: dict[str, Ed25519PublicKey],
        db_path: Path,
        max_lifetime_s: float = MAX_LIFETIME_S,
        scopes: dict[str, frozenset[str]] | None = None,
    ) -> None:
        self.target = target
        self.anchors = anchors
        self.scopes = scopes or {}
        self.max_lifetime_ms = int(1000 * max_lifetime_s)
        self._lock = threading.Lock()
        try:
            self.db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS nonces (nonce TEXT PRIMARY KEY, exp INTEGER NOT NULL)"
            )
        except sqlite3.Error as exc:
            raise OSError(f"cannot open the command nonces at {db_path}: {exc}") from None

    def close(self) -> None:
        self.db.close()

    def check(self, topic_cmd_id: str, payload: bytes) -> Command:
        """The command, or Refused with the reason."""
        try:
            env = decode(payload)
        except EnvelopeError as exc:
            raise Refused(f"not a command envelope: {exc}") from None
        kid, sig = env.extra.get("kid"), env.extra.get("sig")
        if not isinstance(kid, str) or not isinstance(sig, str):
            raise Refused("unsigned: a command needs 'kid' and 'sig'")
        key = self.anchors.get(kid)
        if key is None:
            raise Refused(f"key '{kid}' is not a trust anchor of this node")
        unsigned = {k: v for k, v in env.as_dict().items() if k != "sig"}
        try:
            key.verify(base64.b64decode(sig, validate=True), canonical(unsigned))
        except (InvalidSignature, binascii.Error, ValueError):
            raise Refused("the signature does not verify: forged or altered") from None
        if env.id != topic_cmd_id:
            raise Refused("the command id is not the topic's")
        body = env.body
        name, args, target = body.get("name"), body.get("args", {}), body.get("target")
        exp, nonce = body.get("exp"), body.get("nonce")
        if not isinstance(name, str) or not isinstance(args, dict):
            raise Refused("a command needs 'name' (a string) and 'args' (an object)")
        scope = self.scopes.get(kid)
        if scope is not None and name not in scope:
            allowed = ", ".join(sorted(scope)) or "no command"
            raise Refused(f"key '{kid}' may sign only: {allowed}")
        if target != self.target:
            raise Refused(f"the command is for '{target}', this is '{self.target}'")
        if not isinstance(exp, int) or not isinstance(nonce, str) or not nonce:
            raise Refused("a command needs 'exp' (ms) and a 'nonce'")
        now = now_ms()
        if exp <= now:
            raise Refused(f"expired {(now - exp) / 1000:.1f} s ago")
        if env.ts > now + int(1000 * CLOCK_SKEW_S):
            raise Refused("issued in the future (beyond the clock skew allowed)")
        if exp - env.ts > self.max_lifetime_ms:
            raise Refused(f"valid for more than {self.max_lifetime_ms // 1000} s")
        with self._lock:
            try:
                self.db.execute("DELETE FROM nonces WHERE exp < ?", [now])
                self.db.execute("INSERT INTO nonces VALUES (?, ?)", [nonce, exp])
            except sqlite3.IntegrityError:
                raise Refused("replayed: this nonce was already used") from None
            except sqlite3.Error as exc:  # a full disk: unless the nonce is kept, no replay check
                raise Refused(f"its nonce cannot be kept ({exc}): not run") from None
        return Command(env.id, name, args, env.node, kid)

    def manifest_anchors(self) -> dict[str, Ed25519PublicKey]:
        """The keys that may sign manifests: those without a command scope."""
        return {kid: key for kid, key in self.anchors.items() if kid not in self.scopes}
