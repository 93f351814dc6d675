"""Model manifests: what a model version is, signed by the fleet's keys (as TUF signs targets).

A manifest is ``{"signed": {...}, "signatures": [{"kid", "sig"}, ...]}``. ``signed`` holds:

- ``type`` ``"model"`` and ``spec`` 1;
- ``model`` (a model name) and ``version`` (a positive integer: versions only go up);
- ``files``: ``[{"path", "sha256", "length"}]``, paths relative to the version directory
  (no ``..``, no absolute path, no hidden file), each file's exact length and digest. A
  ``config.pbtxt`` among them is the version's own configuration (edged loads the version with
  it, and a rollback goes back to the one before's); a model the node does not have needs one;
- ``remove`` (optional, ``false`` when absent): ``true`` removes the model from the node, with
  no files and no smoke cases; ``version`` is the version floor from then on (a removal is
  refused where a newer version is installed, and no version up to it installs afterwards);
- ``targets``: who takes it: ``fleet``, ``hardware`` (machine names such as ``aarch64``),
  ``nodes`` (names); an absent key matches every node;
- ``smoke``: test cases ``[{"inputs": [OIP JSON inputs], "outputs": [{"name", "data",
  "atol"}]}]`` the new version must pass before it serves;
- ``expires``: ms since the epoch; an expired manifest is refused (an attacker replaying an old
  manifest forever, TUF's freeze attack).

Each signature is Ed25519 over the canonical bytes of ``signed`` (compact JSON, sorted keys) by a
trust anchor (``{trust_dir}/{kid}.pub``, the same keys as commands); signatures by ``threshold``
distinct keys must verify: one key filed under two kids counts once. The version floor (no
version below one already accepted or installed: TUF's rollback attack) and the files' lengths
and digests (endless data, corruption) are checked by delivery, which knows what is installed
and what arrived.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from cloudsync.protocol.envelope import canonical, now_ms
from edged.common.digest import sha256_of
from edged.common.names import is_model_name

SPEC = 1
MAX_FILES = 64
MAX_SIGNATURES = 16  # each is an Ed25519 verification: bounded
MAX_FILE_BYTES = 8 << 30
FILE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}\Z")
SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
DEB_VERSION = re.compile(r"^(?:[0-9]+:)?[0-9][A-Za-z0-9.+~-]{0,63}\Z")
PACKAGE_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+~-]{0,127}\.deb")  # no directory, no ":"


class ManifestError(Exception):
    """A manifest that must not be installed; the message says why."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    sha256: str
    length: int


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    files: tuple[FileEntry, ...]
    expires: int
    targets: dict[str, Any] = field(default_factory=dict)
    smoke: list[dict[str, Any]] = field(default_factory=list)
    kids: tuple[str, ...] = ()  # the anchors whose signatures verified and counted
    remove: bool = False  # the model goes from the node (no files)
    kind: str = "model"  # or "package": a .deb of the software (``model`` names the package)
    deb_version: str = ""  # a package's Debian version

    @property
    def key(self) -> str:
        """What it is delivered as: the model's name, or ``package:{name}`` for a package (a
        model may be called edged too: the two never share a delivery state or a rollout)."""
        return key_of(self.kind, self.model)

    @property
    def configured(self) -> bool:
        """Whether the version carries its own config.pbtxt (a new model must)."""
        return any(f.path == "config.pbtxt" for f in self.files)

    @property
    def size(self) -> int:
        return sum(f.length for f in self.files)

    def for_node(self, fleet: str, node: str, machine: str) -> str:
        """Why this node is not a target ("" when it is)."""
        targets = self.targets
        if "fleet" in targets and targets["fleet"] != fleet:
            return f"for fleet '{targets['fleet']}', this node is in '{fleet}'"
        if "hardware" in targets and machine not in targets["hardware"]:
            return f"for hardware {', '.join(targets['hardware'])}, this node is {machine}"
        if "nodes" in targets and node not in targets["nodes"]:
            return "this node is not among its nodes"
        return ""


def key_of(kind: Any, model: Any) -> str:
    """A manifest's delivery key from its signed fields (``Manifest.key``)."""
    return f"package:{model}" if kind == "package" else str(model)


def is_key(value: Any) -> bool:
    """Whether ``value`` is a delivery key (``key_of``): a model name or ``package:{name}``."""
    if isinstance(value, str) and value.startswith("package:"):
        value = value[len("package:") :]
    return is_model_name(value)


def file_entry(path: Path, name: str | None = None) -> dict[str, Any]:
    """A ``files`` row for a local file (read once, streamed)."""
    digest = sha256_of(path).hexdigest()
    return {"path": name or path.name, "sha256": digest, "length": path.stat().st_size}


def make(
    model: str,
    version: int,
    files: list[dict[str, Any]],
    lifetime_s: float = 7 * 24 * 3600.0,
    targets: dict[str, Any] | None = None,
    smoke: list[dict[str, Any]] | None = None,
    remove: bool = False,
    deb_version: str = "",
) -> dict[str, Any]:
    """The ``signed`` part of a new manifest (checked as a node would check it); ``remove``: a
    removal of the model (no ``files``); ``deb_version``: a package manifest (``model`` names
    the package, ``files`` is its .deb)."""
    signed = {
        "type": "package" if deb_version else "model",
        **({"deb_version": deb_version} if deb_version else {}),
        "spec": SPEC,
        "model": model,
        "version": version,
        "files": files,
        "targets": targets or {},
        "smoke": smoke or [],
        "expires": now_ms() + int(1000 * lifetime_s),
        **({"remove": True} if remove else {}),
    }
    parse_signed(signed)
    return signed


def sign(signed: dict[str, Any], keys: dict[str, Ed25519PrivateKey]) -> dict[str, Any]:
    """The manifest: ``signed`` with a signature by each key (kid -> key)."""
    message = canonical(signed)
    signatures = [
        {"kid": kid, "sig": base64.b64encode(key.sign(message)).decode()}
        for kid, key in sorted(keys.items())
    ]
    return {"signed": signed, "signatures": signatures}


def _check_path(path: Any) -> str:
    if not isinstance(path, str):
        raise ManifestError("a file's 'path' must be text")
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or str(PurePosixPath(*parts)) != path:
        raise ManifestError(f"file path '{path}' is not a plain relative path")
    for part in parts:
        if not FILE_PART.fullmatch(part):
            raise ManifestError(
                f"file path '{path}': '{part}' may hold only letters, digits, '_', '.', '+',"
                " '-', and may not start with '.' or '-'"
            )
    return path


def parse_signed(signed: Any) -> Manifest:
    """The ``signed`` part's fields, checked; ManifestError names what is wrong."""
    if not isinstance(signed, dict):
        raise ManifestError("'signed' must be an object")
    kind = signed.get("type")
    if kind not in ("model", "package") or signed.get("spec") != SPEC:
        raise ManifestError(f"not a model or package manifest of spec {SPEC}")
    model, version = signed.get("model"), signed.get("version")
    if not isinstance(model, str) or not is_model_name(model):
        raise ManifestError("'model' must be a model name (letters, digits, '_', '.', '-')")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**53:
        raise ManifestError("'version' must be a positive integer")
    remove, files = signed.get("remove", False), signed.get("files")
    if not isinstance(remove, bool):
        raise ManifestError("'remove' must be true or false")
    if remove and (files != [] or signed.get("smoke", []) != []):
        raise ManifestError("a removal ('remove': true) has no files and no smoke cases")
    if not remove and (not isinstance(files, list) or not 1 <= len(files) <= MAX_FILES):
        raise ManifestError(f"'files' must list 1 to {MAX_FILES} files")
    assert isinstance(files, list)
    entries = []
    for row in files:
        if not isinstance(row, dict):
            raise ManifestError("each file must be {path, sha256, length}")
        path, digest, length = _check_path(row.get("path")), row.get("sha256"), row.get("length")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            raise ManifestError(f"file '{path}': 'sha256' must be 64 lowercase hex digits")
        if isinstance(length, bool) or not isinstance(length, int):
            raise ManifestError(f"file '{path}': 'length' must be an integer")
        if not 0 <= length <= MAX_FILE_BYTES:
            raise ManifestError(f"file '{path}': 'length' must be 0 to {MAX_FILE_BYTES}")
        entries.append(FileEntry(path, digest, length))
    if len({e.path for e in entries}) != len(entries):
        raise ManifestError("a file is listed twice")
    targets, smoke = signed.get("targets", {}), signed.get("smoke", [])
    expires = signed.get("expires")
    if not isinstance(targets, dict) or set(targets) - {"fleet", "hardware", "nodes"}:
        raise ManifestError("'targets' may hold only 'fleet', 'hardware' and 'nodes'")
    for key in ("hardware", "nodes"):
        value = targets.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ManifestError(f"'targets.{key}' must be a list of names")
    if not isinstance(smoke, list) or not all(isinstance(c, dict) for c in smoke):
        raise ManifestError("'smoke' must be a list of test cases")
    if isinstance(expires, bool) or not isinstance(expires, int):
        raise ManifestError("'expires' must be ms since the epoch")
    deb_version = signed.get("deb_version", "")
    if kind == "package":
        if not isinstance(deb_version, str) or not DEB_VERSION.fullmatch(deb_version):
            raise ManifestError("'deb_version' must be a Debian version (a package manifest)")
        if remove or len(entries) != 1 or not PACKAGE_FILE.fullmatch(entries[0].path):
            raise ManifestError("a package manifest lists one file, the .deb (a plain name)")
    elif "deb_version" in signed:
        raise ManifestError("'deb_version' is for package manifests")
    return Manifest(
        model,
        version,
        tuple(entries),
        expires,
        targets,
        smoke,
        remove=remove,
        kind=str(kind),
        deb_version=str(deb_version),
    )


def signers(
    doc: dict[str, Any], anchors: dict[str, Ed25519PublicKey]
) -> tuple[list[str], list[str]]:
    """The kids of the distinct ``anchors`` keys whose signatures of ``doc["signed"]`` verify,
    and why each other signature does not count. Keys are told apart by their raw public bytes,
    not by kid: one key filed under two kids (two trust files) is one signer."""
    signed = doc.get("signed")
    try:
        message = canonical(signed) if isinstance(signed, dict) else b""
    except ValueError as exc:  # text UTF-8 cannot encode, NaN: nothing a fleet key signed
        raise ManifestError(f"'signed' is not JSON that can be signed: {exc}") from None
    good: list[str] = []  # a kid for each distinct key that verified
    seen: dict[bytes, str] = {}  # a key's raw public bytes -> the kid it first counted under
    why: list[str] = []
    for row in doc["signatures"]:
        kid, sig = (row.get("kid"), row.get("sig")) if isinstance(row, dict) else (None, None)
        key = anchors.get(kid) if isinstance(kid, str) else None
        if key is None or not isinstance(kid, str):
            why.append(f"'{kid}' is not a trust anchor")
            continue
        if not isinstance(sig, str):
            why.append(f"{kid}'s signature is not base64 text")
            continue
        try:
            key.verify(base64.b64decode(sig, validate=True), message)
        except (InvalidSignature, binascii.Error, ValueError):
            why.append(f"{kid}'s signature does not verify")
            continue
        raw = key.public_bytes(Encoding.Raw, PublicFormat.Raw)
        if raw not in seen:
            seen[raw] = kid
            good.append(kid)
        elif seen[raw] != kid:
            why.append(f"'{kid}' is the same key as '{seen[raw]}'")
    return good, why


def verify(
    doc: Any,
    anchors: dict[str, Ed25519PublicKey],
    threshold: int = 1,
    now: int | None = None,
) -> Manifest:
    """The manifest, when ``threshold`` distinct trust anchor keys signed it (``signers``) and
    it has not expired."""
    if not isinstance(doc, dict) or not isinstance(doc.get("signatures"), list):
        raise ManifestError('a manifest is {"signed": {...}, "signatures": [...]}')
    if len(doc["signatures"]) > MAX_SIGNATURES:
        raise ManifestError(f"more than {MAX_SIGNATURES} signatures")
    good, why = signers(doc, anchors)
    if len(good) < threshold:
        detail = f" ({'; '.join(why)})" if why else ""
        raise ManifestError(
            f"{len(good)} valid signature(s) by distinct trust anchor keys, {threshold}"
            f" needed{detail}"
        )
    signed = doc.get("signed")
    manifest = parse_signed(signed)
    now = now_ms() if now is None else now
    if manifest.expires <= now:
        raise ManifestError(
            f"expired {(now - manifest.expires) / 1000:.0f} s ago: a manifest replayed after its"
            " time (freeze)"
        )
    return dataclasses.replace(manifest, kids=tuple(good))
