"""Signed commands: forged, altered, expired, replayed (also after a restart), misdirected and
unsigned commands are refused with the reason; a valid one passes once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol.commands import Refused, Verifier, load_anchors, sign
from cloudsync.protocol.envelope import canonical

TARGET = "f1/n1"


@pytest.fixture
def fleet_key(tmp_path: Path) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    trust = tmp_path / "trust"
    trust.mkdir()
    (trust / "fleet-1.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key


def verifier(tmp_path: Path) -> Verifier:
    return Verifier(TARGET, load_anchors(tmp_path / "trust"), tmp_path / "nonces.db")


def test_a_valid_command_runs_once_even_across_restarts(
    tmp_path: Path, fleet_key: Ed25519PrivateKey
) -> None:
    cmd_id, payload = sign(fleet_key, "fleet-1", "operator", TARGET, "ping", {"x": 1})
    check = verifier(tmp_path)
    command = check.check(cmd_id, payload)
    assert (command.name, command.args, command.issuer) == ("ping", {"x": 1}, "operator")
    with pytest.raises(Refused, match="replayed"):
        check.check(cmd_id, payload)
    check.close()
    with pytest.raises(Refused, match="replayed"):
        verifier(tmp_path).check(cmd_id, payload)  # the nonce is on disk


def altered(payload: bytes, **changes: object) -> bytes:
    doc = json.loads(payload)
    doc["body"].update(changes)
    return canonical(doc)


def test_forged_altered_expired_misdirected_and_unsigned_commands_are_refused(
    tmp_path: Path, fleet_key: Ed25519PrivateKey
) -> None:
    check = verifier(tmp_path)
    other = Ed25519PrivateKey.generate()
    cases: list[tuple[str, bytes, str]] = []
    cid, forged = sign(other, "fleet-1", "mallory", TARGET, "drain")
    cases.append((cid, forged, "does not verify"))
    cid, good = sign(fleet_key, "fleet-1", "operator", TARGET, "ping")
    cases.append((cid, altered(good, name="drain"), "does not verify"))
    cid, unknown = sign(other, "fleet-9", "mallory", TARGET, "ping")
    cases.append((cid, unknown, "not a trust anchor"))
    cid, expired = sign(fleet_key, "fleet-1", "operator", TARGET, "ping", lifetime_s=-1)
    cases.append((cid, expired, "expired"))
    cid, long_lived = sign(fleet_key, "fleet-1", "operator", TARGET, "ping", lifetime_s=86400)
    cases.append((cid, long_lived, "valid for more than"))
    cid, elsewhere = sign(fleet_key, "fleet-1", "operator", "f1/n2", "ping")
    cases.append((cid, elsewhere, "is for 'f1/n2'"))
    doc = json.loads(good)
    del doc["sig"]
    cases.append((doc["id"], canonical(doc), "unsigned"))
    cases.append(("x", b"{not json", "not a command envelope"))
    cid, fine = sign(fleet_key, "fleet-1", "operator", TARGET, "ping")
    cases.append(("another-id", fine, "not the topic's"))
    for cmd_id, payload, why in cases:
        with pytest.raises(Refused, match=why):
            check.check(cmd_id, payload)
    assert check.check(cid, fine).name == "ping"  # refusing others did not spend its nonce


def test_a_scoped_key_gives_only_its_commands_and_signs_no_manifest(
    tmp_path: Path, fleet_key: Ed25519PrivateKey
) -> None:
    """The fleet service's deploy key: trust/deploy-1.pub with deploy-1.commands."""
    from cloudsync.protocol import manifest
    from cloudsync.protocol.commands import load_scopes

    deploy = Ed25519PrivateKey.generate()
    trust = tmp_path / "trust"
    (trust / "deploy-1.pub").write_bytes(
        deploy.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (trust / "deploy-1.commands").write_text("# the fleet service\nrollback\n\nping  # checks\n")
    scopes = load_scopes(trust)
    assert scopes == {"deploy-1": frozenset({"rollback", "ping"})}
    check = Verifier(TARGET, load_anchors(trust), tmp_path / "nonces.db", scopes=scopes)
    for name in ("rollback", "ping"):
        cmd_id, payload = sign(deploy, "deploy-1", "edgefleet", TARGET, name, {})
        assert check.check(cmd_id, payload).name == name
    cmd_id, payload = sign(deploy, "deploy-1", "edgefleet", TARGET, "drain", {})
    with pytest.raises(Refused, match="key 'deploy-1' may sign only: ping, rollback"):
        check.check(cmd_id, payload)
    cmd_id, payload = sign(fleet_key, "fleet-1", "operator", TARGET, "drain", {})
    assert check.check(cmd_id, payload).name == "drain"  # an operator's key: every command
    assert set(check.manifest_anchors()) == {"fleet-1"}
    files = [{"path": "m.onnx", "sha256": "a" * 64, "length": 1}]
    doc = manifest.sign(manifest.make("m", 2, files), {"deploy-1": deploy})
    with pytest.raises(manifest.ManifestError, match="'deploy-1' is not a trust anchor"):
        manifest.verify(doc, check.manifest_anchors())


def test_keygen_makes_a_scoped_key(tmp_path: Path) -> None:
    from cloudsync.fleet.cli import main
    from cloudsync.protocol.commands import load_scopes

    trust = tmp_path / "trust"
    assert main(["keygen", "--kid", "deploy-1", "--dir", str(trust), "--commands", "rollback"]) == 0
    assert main(["keygen", "--kid", "fleet-1", "--dir", str(trust)]) == 0
    assert load_scopes(trust) == {"deploy-1": frozenset({"rollback"})}
    assert set(load_anchors(trust)) == {"deploy-1", "fleet-1"}
    assert (trust / "deploy-1.key").stat().st_mode & 0o777 == 0o600


def test_a_scope_file_that_is_not_text_is_an_error_naming_it(tmp_path: Path) -> None:
    from cloudsync.protocol.commands import load_scopes

    (tmp_path / "deploy-1.commands").write_bytes(b"\xff\xferollback")
    with pytest.raises(OSError, match=r"deploy-1\.commands: not UTF-8 text"):
        load_scopes(tmp_path)
