"""Signed commands: forged, altered, expired, replayed (also after a restart), misdirected and
unsigned commands are refused with the reason; a valid one passes once."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol import commands
from cloudsync.protocol.commands import (
    Command,
    Refused,
    Verifier,
    load_anchors,
    load_scopes,
    sign,
)
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


def pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def ec_key() -> bytes:
    from cryptography.hazmat.primitives.asymmetric import ec

    return (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


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


# ---- the survivors of mutation testing (issue 32), each killed here --------------------------

NOW = 1_700_000_000_000


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The commands' clock (``now_ms``): the test sets ``clock[0]``, to the millisecond."""
    now = [NOW]
    monkeypatch.setattr(commands, "now_ms", lambda: now[0])
    return now


def signed(key: Ed25519PrivateKey, kid: str = "fleet-1", **fields: Any) -> bytes:
    """A command envelope with any fields, signed as ``sign`` signs."""
    body = {"name": "ping", "args": {}, "target": TARGET, "exp": NOW + 60_000, "nonce": "n-1"}
    doc: dict[str, Any] = {
        "v": 1,
        "id": "cmd-1",
        "ts": NOW,
        "node": "operator",
        "seq": NOW,
        "body": body,
        "kid": kid,
    }
    for name, value in fields.items():
        if name in body:
            body[name] = value
        else:
            doc[name] = value
    sig = base64.b64encode(key.sign(canonical(doc))).decode()
    return canonical({**doc, "sig": sig})


def refusal(check: Verifier, payload: bytes, cmd_id: str = "cmd-1") -> str:
    with pytest.raises(Refused) as refused:
        check.check(cmd_id, payload)
    return str(refused.value)


def test_sign_makes_exactly_the_documented_command(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    cmd_id, payload = sign(fleet_key, "fleet-1", "operator", TARGET, "drain", {"s": 5})
    doc = json.loads(payload)
    assert payload == canonical(doc) and doc["id"] == cmd_id and len(cmd_id) == 32
    nonce = doc["body"]["nonce"]
    assert len(nonce) == 32 and int(nonce, 16) >= 0
    sig = doc.pop("sig")
    assert doc == {
        "v": 1,
        "id": cmd_id,
        "ts": NOW,
        "node": "operator",
        "seq": NOW,
        "kid": "fleet-1",
        "body": {
            "name": "drain",
            "args": {"s": 5},
            "target": TARGET,
            "exp": NOW + 300_000,
            "nonce": nonce,
        },
    }
    fleet_key.public_key().verify(base64.b64decode(sig, validate=True), canonical(doc))
    again_id, again = sign(fleet_key, "k2", "op", "f/n", "ping", lifetime_s=1.5, cmd_id="c-9")
    other = json.loads(again)
    assert again_id == other["id"] == "c-9" and other["kid"] == "k2"
    assert other["body"]["args"] == {} and other["body"]["exp"] == NOW + 1_500
    assert other["body"]["nonce"] != nonce
    command = verifier(tmp_path).check(cmd_id, payload)
    assert command == Command(cmd_id, "drain", {"s": 5}, "operator", "fleet-1")


def test_a_command_expires_at_its_exp_to_the_millisecond(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    check = verifier(tmp_path)
    clock[0] = NOW + 59_999
    assert check.check("cmd-1", signed(fleet_key)).name == "ping"
    clock[0] = NOW + 60_000
    assert refusal(check, signed(fleet_key, nonce="n-2")) == "expired 0.0 s ago"
    clock[0] = NOW + 61_500
    assert refusal(check, signed(fleet_key, nonce="n-2")) == "expired 1.5 s ago"
    clock[0] = NOW + 160_000
    assert refusal(check, signed(fleet_key, nonce="n-2")) == "expired 100.0 s ago"


def test_the_clock_skew_allowed_is_a_minute_to_the_millisecond(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    check = verifier(tmp_path)
    clock[0] = NOW - 60_000  # the command's ts is a minute ahead of this node
    assert check.check("cmd-1", signed(fleet_key)).name == "ping"
    clock[0] = NOW - 60_001
    assert refusal(check, signed(fleet_key, nonce="n-2")) == (
        "issued in the future (beyond the clock skew allowed)"
    )


def test_the_longest_lifetime_is_inclusive_and_named_in_the_refusal(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    check = verifier(tmp_path)  # an hour by default
    assert check.check("cmd-1", signed(fleet_key, exp=NOW + 3_600_000)).name == "ping"
    assert refusal(check, signed(fleet_key, exp=NOW + 3_600_001, nonce="n-2")) == (
        "valid for more than 3600 s"
    )
    short = Verifier(TARGET, load_anchors(tmp_path / "trust"), tmp_path / "b.db", 2.5)
    assert short.check("cmd-1", signed(fleet_key, exp=NOW + 2_500, nonce="n-3")).name == "ping"
    assert refusal(short, signed(fleet_key, exp=NOW + 2_501, nonce="n-4")) == (
        "valid for more than 2 s"
    )


def test_each_refusal_says_exactly_why(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    check = verifier(tmp_path)
    key = fleet_key
    good = json.loads(signed(key))
    cases: list[tuple[bytes, str]] = [
        (b"[]", "not a command envelope: an envelope is a JSON object"),
        (canonical({**good, "kid": 7}), "unsigned: a command needs 'kid' and 'sig'"),
        (
            canonical({k: v for k, v in good.items() if k != "kid"}),
            "unsigned: a command needs 'kid' and 'sig'",
        ),
        (canonical({**good, "sig": None}), "unsigned: a command needs 'kid' and 'sig'"),
        (signed(key, kid="fleet-2"), "key 'fleet-2' is not a trust anchor of this node"),
        (
            canonical({**good, "sig": good["sig"][:-4]}),
            "the signature does not verify: forged or altered",
        ),
        (
            canonical({**good, "sig": "!" + good["sig"]}),
            "the signature does not verify: forged or altered",
        ),  # not base64: not ignored
        (canonical({**good, "sig": "AAAA"}), "the signature does not verify: forged or altered"),
        (signed(key, name=7), "a command needs 'name' (a string) and 'args' (an object)"),
        (signed(key, args=[]), "a command needs 'name' (a string) and 'args' (an object)"),
        (signed(key, target="f1/n2"), "the command is for 'f1/n2', this is 'f1/n1'"),
        (signed(key, target=None), "the command is for 'None', this is 'f1/n1'"),
        (signed(key, exp="soon"), "a command needs 'exp' (ms) and a 'nonce'"),
        (signed(key, nonce=""), "a command needs 'exp' (ms) and a 'nonce'"),
        (signed(key, nonce=5), "a command needs 'exp' (ms) and a 'nonce'"),
    ]
    for payload, why in cases:
        assert refusal(check, payload) == why, payload
    assert refusal(check, signed(key), cmd_id="cmd-2") == "the command id is not the topic's"
    assert check.db.execute("SELECT count(*) FROM nonces").fetchone() == (0,)


def test_a_command_without_args_has_none_and_its_nonce_is_kept_until_it_expires(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    check = verifier(tmp_path)
    doc = json.loads(signed(fleet_key))
    del doc["body"]["args"], doc["sig"]
    sig = base64.b64encode(fleet_key.sign(canonical(doc))).decode()
    command = check.check("cmd-1", canonical({**doc, "sig": sig}))
    assert command == Command("cmd-1", "ping", {}, "operator", "fleet-1")
    check.check("cmd-1", signed(fleet_key, nonce="n-2", exp=NOW + 90_000))
    nonces = "SELECT nonce, exp FROM nonces ORDER BY nonce"
    assert check.db.execute(nonces).fetchall() == [("n-1", NOW + 60_000), ("n-2", NOW + 90_000)]
    clock[0] = NOW + 60_001  # n-1's command has expired: its nonce is forgotten
    check.check("cmd-1", signed(fleet_key, nonce="n-3", exp=NOW + 90_000))
    assert check.db.execute(nonces).fetchall() == [("n-2", NOW + 90_000), ("n-3", NOW + 90_000)]
    assert refusal(check, signed(fleet_key, nonce="n-2", exp=NOW + 90_000)) == (
        "replayed: this nonce was already used"
    )


def test_a_nonce_that_cannot_be_kept_refuses_the_command(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    check = verifier(tmp_path)
    check.db.execute("PRAGMA query_only = ON")
    assert refusal(check, signed(fleet_key)) == (
        "its nonce cannot be kept (attempt to write a readonly database): not run"
    )
    check.db.execute("PRAGMA query_only = OFF")
    assert check.check("cmd-1", signed(fleet_key)).name == "ping"


def test_nonces_that_cannot_be_opened_are_an_error_naming_where(tmp_path: Path) -> None:
    (tmp_path / "nonces.db").mkdir()
    with pytest.raises(OSError, match=r"^cannot open the command nonces at .*nonces\.db: "):
        verifier(tmp_path)


def test_anchors_and_scopes_are_read_from_the_trust_directory(tmp_path: Path) -> None:
    assert load_anchors(tmp_path / "none") == {} and load_scopes(tmp_path / "none") == {}
    trust = tmp_path / "trust"
    trust.mkdir()
    keys = {kid: Ed25519PrivateKey.generate() for kid in ("b-key", "a-key")}
    for kid, key in keys.items():
        (trust / f"{kid}.pub").write_bytes(pem(key))
    ec = ec_key()
    (trust / "ec.pub").write_bytes(ec)  # not Ed25519: not an anchor
    (trust / "a-key.commands").write_text("ping # a comment # more\n  drain  \n#rollback\n\n")
    (trust / "none.commands").write_text("# nothing\n")
    anchors = load_anchors(trust)
    assert list(anchors) == ["a-key", "b-key"]
    assert anchors["a-key"].public_bytes_raw() == keys["a-key"].public_key().public_bytes_raw()
    assert load_scopes(trust) == {"a-key": frozenset({"ping", "drain"}), "none": frozenset()}
    (trust / "bad.pub").write_text("not a key")
    with pytest.raises(OSError) as error:
        load_anchors(trust)
    assert str(error.value) == f"trust anchor {trust / 'bad.pub'}: not a PEM public key"


def test_a_key_scoped_to_nothing_signs_no_command(
    tmp_path: Path, fleet_key: Ed25519PrivateKey, clock: list[int]
) -> None:
    anchors = load_anchors(tmp_path / "trust")
    check = Verifier(TARGET, anchors, tmp_path / "n.db", scopes={"fleet-1": frozenset()})
    assert refusal(check, signed(fleet_key)) == "key 'fleet-1' may sign only: no command"
    assert check.manifest_anchors() == {}
    assert Verifier(TARGET, anchors, tmp_path / "m.db").manifest_anchors() == anchors


def test_commands_arrive_on_another_thread_than_the_one_that_opened_the_nonces(
    tmp_path: Path, fleet_key: Ed25519PrivateKey
) -> None:
    check = verifier(tmp_path)
    assert check.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert check.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: a nonce survives
    found: list[object] = []
    cmd_id, payload = sign(fleet_key, "fleet-1", "operator", TARGET, "ping")

    def receive() -> None:
        try:
            found.append(check.check(cmd_id, payload).name)
        except Exception as exc:  # (reported below)
            found.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    thread.join()
    assert found == ["ping"]
