"""Model manifests: signatures by a threshold of trust anchors, expiry, paths, targets."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudsync.fleet.cli import main as edgefleet
from cloudsync.protocol import manifest as manifest_module
from cloudsync.protocol.envelope import canonical
from cloudsync.protocol.manifest import (
    DEB_VERSION,
    PACKAGE_FILE,
    FileEntry,
    Manifest,
    ManifestError,
    file_entry,
    is_key,
    key_of,
    make,
    parse_signed,
    sign,
    verify,
)

KEYS = {kid: Ed25519PrivateKey.generate() for kid in ("fleet-1", "fleet-2", "fleet-3")}
ANCHORS = {kid: key.public_key() for kid, key in KEYS.items()}
FILES = [{"path": "model.onnx", "sha256": "ab" * 32, "length": 1234}]


def manifest(**changes: Any) -> dict[str, Any]:
    signed = make("intent-classifier", 7, FILES, targets={"fleet": "f1"})
    signed.update(changes)
    return signed


def test_a_signed_manifest_verifies_and_says_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"onnx bytes")
    row = file_entry(tmp_path / "model.onnx")
    digest = hashlib.sha256(b"onnx bytes").hexdigest()
    assert row == {"path": "model.onnx", "sha256": digest, "length": 10}
    found = verify(sign(manifest(), {"fleet-1": KEYS["fleet-1"]}), ANCHORS)
    assert (found.model, found.version, found.size, found.kids) == (
        "intent-classifier",
        7,
        1234,
        ("fleet-1",),
    )
    assert found.for_node("f1", "n1", "x86_64") == ""
    assert "fleet 'f1'" in found.for_node("f2", "n1", "x86_64")


def test_forged_altered_unknown_and_too_few_signatures_are_refused() -> None:
    doc = sign(manifest(), {"fleet-1": KEYS["fleet-1"]})
    altered = copy.deepcopy(doc)
    altered["signed"]["version"] = 8
    with pytest.raises(ManifestError, match="does not verify"):
        verify(altered, ANCHORS)
    stranger = sign(manifest(), {"mallory": Ed25519PrivateKey.generate()})
    with pytest.raises(ManifestError, match="'mallory' is not a trust anchor"):
        verify(stranger, ANCHORS)
    # the same key twice is one signature: a threshold of 2 needs two anchors
    twice = sign(manifest(), {"fleet-1": KEYS["fleet-1"]})
    twice["signatures"] *= 2
    with pytest.raises(ManifestError, match="1 valid signature"):
        verify(twice, ANCHORS, threshold=2)
    two = sign(manifest(), {"fleet-1": KEYS["fleet-1"], "fleet-3": KEYS["fleet-3"]})
    assert verify(two, ANCHORS, threshold=2).kids == ("fleet-1", "fleet-3")
    with pytest.raises(ManifestError, match="a manifest is"):
        verify({"signed": manifest()}, ANCHORS)


def test_an_expired_manifest_is_refused_as_a_freeze() -> None:
    doc = sign(manifest(expires=1_000), {"fleet-1": KEYS["fleet-1"]})
    with pytest.raises(ManifestError, match=r"expired .* \(freeze\)"):
        verify(doc, ANCHORS)


@pytest.mark.parametrize(
    "path",
    [
        "../etc/passwd",
        "/abs/model.onnx",
        "a/../../b",
        ".hidden",
        "a//b",
        "",
        "sub/-x",
        "a\\b",
        "model.onnx\n",
    ],
)
def test_file_paths_stay_inside_the_version_directory(path: str) -> None:
    with pytest.raises(ManifestError, match="path"):
        make("m", 1, [{"path": path, "sha256": "ab" * 32, "length": 1}])


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"version": 0}, "'version'"),
        ({"version": True}, "'version'"),
        ({"model": "a/b"}, "'model'"),
        ({"files": []}, "'files'"),
        ({"files": [FILES[0], FILES[0]]}, "listed twice"),
        ({"files": [{**FILES[0], "sha256": "XY"}]}, "sha256"),
        ({"files": [{**FILES[0], "length": -1}]}, "length"),
        ({"targets": {"planet": "mars"}}, "targets"),
        ({"targets": {"nodes": "n1"}}, "targets.nodes"),
        ({"type": "software"}, "not a model or package manifest"),
        ({"deb_version": "1.0"}, "for package manifests"),
        ({"type": "package", "deb_version": "1.0"}, "one file, the .deb"),
        ({"type": "package", "deb_version": "1.0\n"}, "Debian version"),
        ({"model": "m\n"}, "'model'"),
        ({"files": [{**FILES[0], "sha256": "ab" * 32 + "\n"}]}, "sha256"),
        ({"remove": 1}, "'remove' must be true or false"),
        ({"remove": True}, "a removal .* has no files and no smoke cases"),
        ({"remove": True, "files": [], "smoke": [{}]}, "no files and no smoke"),
        ({"remove": False, "files": []}, "'files'"),
    ],
)
def test_malformed_manifests_name_what_is_wrong(changes: dict[str, Any], says: str) -> None:
    doc = sign(manifest(**changes), {"fleet-1": KEYS["fleet-1"]})
    with pytest.raises(ManifestError, match=says):
        verify(doc, ANCHORS)


def test_targets_by_hardware_and_nodes() -> None:
    found = verify(
        sign(
            manifest(targets={"hardware": ["aarch64"], "nodes": ["n1", "n2"]}),
            {"fleet-2": KEYS["fleet-2"]},
        ),
        ANCHORS,
    )
    assert found.for_node("any", "n1", "aarch64") == ""
    assert "hardware aarch64" in found.for_node("any", "n1", "x86_64")
    assert "not among its nodes" in found.for_node("any", "n3", "aarch64")


def test_one_key_filed_under_two_kids_counts_once_toward_the_threshold() -> None:
    """Two trust files holding the same public key are one signer: threshold 2 needs two keys."""
    key = KEYS["fleet-1"]
    anchors = {**ANCHORS, "fleet-1-copy": key.public_key()}
    doc = sign(manifest(), {"fleet-1": key, "fleet-1-copy": key})
    with pytest.raises(ManifestError, match=r"1 valid signature.*'fleet-1-copy' is the same key"):
        verify(doc, anchors, threshold=2)
    assert verify(doc, anchors, threshold=1).kids == ("fleet-1",)
    two = sign(manifest(), {"fleet-1": key, "fleet-2": KEYS["fleet-2"]})
    assert verify(two, anchors, threshold=2).kids == ("fleet-1", "fleet-2")


def test_a_removal_and_a_version_with_its_config_say_so() -> None:
    removal = verify(sign(make("m", 3, [], remove=True), {"fleet-1": KEYS["fleet-1"]}), ANCHORS)
    assert (removal.model, removal.version, removal.files, removal.remove) == ("m", 3, (), True)
    assert "remove" not in make("m", 3, FILES)  # absent, not false: older nodes read it alike
    plain = verify(sign(manifest(), {"fleet-1": KEYS["fleet-1"]}), ANCHORS)
    assert not plain.remove and not plain.configured
    config = {"path": "config.pbtxt", "sha256": "cd" * 32, "length": 10}
    own = verify(sign(manifest(files=[*FILES, config]), {"fleet-1": KEYS["fleet-1"]}), ANCHORS)
    assert own.configured and own.size == 1244
    nested = {**config, "path": "sub/config.pbtxt"}  # only the version's top-level one counts
    assert not verify(
        sign(manifest(files=[nested]), {"fleet-1": KEYS["fleet-1"]}), ANCHORS
    ).configured


def test_edgefleet_signs_a_removal_and_refuses_what_a_node_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert edgefleet(["keygen", "--kid", "fleet-1", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    key, out = f"fleet-1={tmp_path / 'fleet-1.key'}", tmp_path / "removal.json"
    made = ["manifest", "--model", "old", "--version", "9", "--sign", key]
    assert edgefleet([*made, "--remove", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: old version 9, removal"
    public = load_pem_public_key((tmp_path / "fleet-1.pub").read_bytes())
    assert isinstance(public, Ed25519PublicKey)
    removal = verify(json.loads(out.read_text()), {"fleet-1": public})
    assert (removal.model, removal.version, removal.remove, removal.files) == ("old", 9, True, ())
    (tmp_path / "model.onnx").write_bytes(b"x")
    for argv, says in (
        ([*made], "--file for each file of a version, or --remove"),
        ([*made, "--remove", "--file", str(tmp_path / "model.onnx")], "or --remove"),
        (["manifest", "--model", "a/b", "--version", "1", "--remove", "--sign", key], "'model'"),
    ):
        assert edgefleet(argv) == 2, argv
        assert says in capsys.readouterr().err, argv


FIELD = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=70)
    | st.sampled_from(["1.0", "2:1.0+1~rc1", "1.0/..", "model", "package", ""])
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["model", "package", None, "Package"]) | FIELD,
    remove=FIELD,
    deb_version=FIELD,
    path=st.sampled_from(
        [
            "edged_1.0_amd64.deb",
            "model.onnx",
            "a/edged.deb",
            ".deb",
            "edged:1.deb",
            "edged_1.0_amd64.deb\n",
        ]
    ),
)
def test_any_type_remove_and_deb_version_give_a_consistent_manifest_or_a_refusal(
    kind: Any, remove: Any, deb_version: Any, path: str
) -> None:
    """What verify accepts is one of three shapes: a model version (files, no deb_version), a
    removal (no files), or a package (one .deb by a plain name, a Debian version); never a
    package that removes, nor a deb_version on a model."""
    doc = manifest(
        files=[{"path": path, "sha256": "0" * 64, "length": 1}],
        type=kind,
        remove=remove,
        deb_version=deb_version,
    )
    try:
        found = verify(sign(doc, {"fleet-1": KEYS["fleet-1"]}), ANCHORS)
    except ManifestError:
        return
    assert found.remove is remove and found.kind == kind
    if kind == "package":
        assert DEB_VERSION.fullmatch(found.deb_version) and found.deb_version == deb_version
        assert not remove and len(found.files) == 1 and PACKAGE_FILE.fullmatch(path)
        assert found.key == f"package:{found.model}"
    else:
        assert found.deb_version == "" and found.key == found.model
        assert (found.files == ()) is bool(remove)


# ---- the survivors of mutation testing (issue 32), each killed here --------------------------


def test_the_files_come_back_whole_and_the_expiry_is_to_the_millisecond() -> None:
    """The file entries (path, digest, length) as signed; ``now`` is what decides expiry, and
    a manifest expires at its ``expires`` exactly (``<=`` -> ``<``)."""
    doc = sign(manifest(expires=5_000), {"fleet-1": KEYS["fleet-1"]})
    found = verify(doc, ANCHORS, now=4_999)
    assert [(f.path, f.sha256, f.length) for f in found.files] == [("model.onnx", "ab" * 32, 1234)]
    assert found.expires == 5_000 and found.targets == {"fleet": "f1"} and found.smoke == []
    with pytest.raises(ManifestError, match=r"expired 0 s ago"):
        verify(doc, ANCHORS, now=5_000)
    with pytest.raises(ManifestError, match=r"expired 10 s ago"):
        verify(doc, ANCHORS, now=15_000)


def test_key_rotation_an_unknown_or_bad_signature_first_hides_no_valid_one() -> None:
    """Several signatures, the first by a retired key (not an anchor any more) and the second
    forged: the valid ones after them still count (``continue`` -> ``break``)."""
    retired = Ed25519PrivateKey.generate()
    doc = sign(
        manifest(), {"fleet-0": retired, "fleet-1": KEYS["fleet-1"], "fleet-2": KEYS["fleet-2"]}
    )
    forged = {"kid": "fleet-3", "sig": doc["signatures"][1]["sig"]}  # fleet-1's, not fleet-3's
    doc["signatures"].insert(1, forged)
    found = verify(doc, ANCHORS, threshold=2)
    assert found.kids == ("fleet-1", "fleet-2")
    with pytest.raises(ManifestError) as refused:
        verify(doc, ANCHORS, threshold=3)
    assert str(refused.value) == (
        "2 valid signature(s) by distinct trust anchor keys, 3 needed ('fleet-0' is not a trust"
        " anchor; fleet-3's signature does not verify)"
    )


def test_a_refusal_names_what_an_unverified_manifest_claims_and_nothing_unusable() -> None:
    """cloudsync's refusal of a manifest that does not verify carries its claimed model and
    version (marked unverified), so the rollout that sent it stops at once; garbage claims
    nothing."""
    from cloudsync.agent.delivery import claimed

    signed = {"model": "intent-classifier", "version": 7}
    assert claimed({"manifest": {"signed": signed}}) == {
        "model": "intent-classifier",
        "version": 7,
        "unverified": True,
    }
    package = {"kind": "package", "model": "edged", "version": 3}
    assert claimed({"manifest": {"signed": package}})["model"] == "package:edged"
    bads: list[Any] = [
        None,
        [],
        {"manifest": []},
        {"manifest": {"signed": "x"}},
        {"manifest": {"signed": {"model": "a b", "version": 1}}},
        {"manifest": {"signed": {"model": "m", "version": True}}},
        {"manifest": {"signed": {"model": "m", "version": 0}}},
        {"manifest": {"signed": {"model": "m", "version": 2**63}}},
        {"manifest": {"signed": {"model": "m", "version": "7"}}},
    ]
    for bad in bads:
        assert claimed(bad) == {}, bad


def refusal(signed: Any) -> str:
    with pytest.raises(ManifestError) as refused:
        parse_signed(signed)
    return str(refused.value)


def entry(path: str = "model.onnx", length: Any = 1) -> dict[str, Any]:
    return {"path": path, "sha256": "0" * 64, "length": length}


def test_make_writes_exactly_the_documented_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_module, "now_ms", lambda: 1_000_000)
    assert make("m", 2, FILES) == {
        "type": "model",
        "spec": 1,
        "model": "m",
        "version": 2,
        "files": FILES,
        "targets": {},
        "smoke": [],
        "expires": 1_000_000 + 7 * 24 * 3600 * 1000,
    }
    smoke: list[dict[str, Any]] = [{"inputs": [], "outputs": []}]
    assert make("m", 2, FILES, lifetime_s=1.5, targets={"nodes": ["n1"]}, smoke=smoke) == {
        "type": "model",
        "spec": 1,
        "model": "m",
        "version": 2,
        "files": FILES,
        "targets": {"nodes": ["n1"]},
        "smoke": smoke,
        "expires": 1_001_500,
    }
    deb = [entry("edged_1.0_amd64.deb")]
    assert make("edged", 3, deb, deb_version="1.0") == {
        "type": "package",
        "deb_version": "1.0",
        "spec": 1,
        "model": "edged",
        "version": 3,
        "files": deb,
        "targets": {},
        "smoke": [],
        "expires": 1_000_000 + 604_800_000,
    }
    assert make("m", 4, [], remove=True)["remove"] is True
    with pytest.raises(ManifestError, match="'version'"):
        make("m", 0, FILES)  # checked as a node checks it


def test_sign_signs_the_canonical_bytes_by_each_key_in_kid_order() -> None:
    signed = manifest()
    doc = sign(signed, {"fleet-2": KEYS["fleet-2"], "fleet-1": KEYS["fleet-1"]})
    assert doc["signed"] is signed and [s["kid"] for s in doc["signatures"]] == [
        "fleet-1",
        "fleet-2",
    ]
    for row in doc["signatures"]:
        assert set(row) == {"kid", "sig"}
        ANCHORS[row["kid"]].verify(base64.b64decode(row["sig"], validate=True), canonical(signed))
    assert sign(signed, {}) == {"signed": signed, "signatures": []}


def test_a_verified_manifest_carries_every_signed_field() -> None:
    smoke = [{"inputs": [{"name": "x"}], "outputs": []}]
    targets = {"fleet": "f1", "hardware": ["aarch64"], "nodes": ["n1"]}
    files = [entry("model.onnx", 0), entry("sub/config.pbtxt", 8 << 30)]
    doc = sign(
        make("m.v2_x-y", 2**53 - 1, files, targets=targets, smoke=smoke),
        {"fleet-2": KEYS["fleet-2"]},
    )
    found = verify(doc, ANCHORS, now=doc["signed"]["expires"] - 1)
    assert found == Manifest(
        "m.v2_x-y",
        2**53 - 1,
        (FileEntry("model.onnx", "0" * 64, 0), FileEntry("sub/config.pbtxt", "0" * 64, 8 << 30)),
        doc["signed"]["expires"],
        targets,
        smoke,
        ("fleet-2",),
        False,
        "model",
        "",
    )
    assert found.size == 8 << 30 and found.key == "m.v2_x-y" and not found.configured
    package = parse_signed(make("edged", 1, [entry("e.deb")], deb_version="2:1.0+b1~rc1"))
    assert (package.kind, package.deb_version, package.key) == (
        "package",
        "2:1.0+b1~rc1",
        "package:edged",
    )
    assert (package.remove, package.kids, package.targets, package.smoke) == (False, (), {}, [])


def test_who_a_manifest_is_for_is_said_exactly() -> None:
    found = parse_signed(
        manifest(targets={"fleet": "f1", "hardware": ["aarch64", "riscv64"], "nodes": ["n1", "n2"]})
    )
    assert found.for_node("f1", "n2", "riscv64") == ""
    assert found.for_node("f2", "n1", "aarch64") == "for fleet 'f1', this node is in 'f2'"
    assert found.for_node("f1", "n1", "x86_64") == (
        "for hardware aarch64, riscv64, this node is x86_64"
    )
    assert found.for_node("f1", "n3", "aarch64") == "this node is not among its nodes"
    anyone = parse_signed(manifest(targets={}))
    assert anyone.for_node("f9", "n9", "x86_64") == ""


def test_delivery_keys_tell_packages_from_models() -> None:
    assert key_of("package", "edged") == "package:edged" and key_of("model", "edged") == "edged"
    assert key_of(None, 7) == "7"
    assert is_key("edged") and is_key("package:edged") and is_key("m.v2_x-y")
    assert not is_key("package:") and not is_key("package:a b") and not is_key("a/b")
    assert not is_key(None) and not is_key("Package:edged") and not is_key("package:package:x")


def test_a_file_entry_is_named_as_given_or_by_its_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"abc")
    digest = hashlib.sha256(b"abc").hexdigest()
    assert file_entry(tmp_path / "weights.bin", "sub/w.bin") == {
        "path": "sub/w.bin",
        "sha256": digest,
        "length": 3,
    }
    assert file_entry(tmp_path / "weights.bin")["path"] == "weights.bin"


def test_the_bounds_of_versions_files_and_lengths_are_inclusive() -> None:
    assert parse_signed(manifest(version=1)).version == 1
    assert parse_signed(manifest(version=2**53 - 1)).version == 2**53 - 1
    for version in (0, -1, 2**53, 1.0, "1", True, None):
        assert refusal(manifest(version=version)) == "'version' must be a positive integer"
    many = [entry(f"f{i}") for i in range(64)]
    assert len(parse_signed(manifest(files=many)).files) == 64
    assert refusal(manifest(files=[*many, entry("f64")])) == "'files' must list 1 to 64 files"
    assert refusal(manifest(files={"path": "x"})) == "'files' must list 1 to 64 files"
    assert refusal(manifest(files=None)) == "'files' must list 1 to 64 files"
    assert parse_signed(manifest(files=[entry(length=0)])).files[0].length == 0
    assert parse_signed(manifest(files=[entry(length=8 << 30)])).size == 8 * 1024**3
    wrong = [(8 * 1024**3 + 1, "0 to 8589934592"), (-1, "0 to 8589934592")]
    for length, says in [*wrong, (True, "an integer"), (1.0, "an integer"), ("1", "an integer")]:
        assert refusal(manifest(files=[entry(length=length)])) == (
            f"file 'model.onnx': 'length' must be {says}"
        )


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"type": "model", "spec": 2}, "not a model or package manifest of spec 1"),
        ({"spec": None}, "not a model or package manifest of spec 1"),
        ({"type": None}, "not a model or package manifest of spec 1"),
        ({"model": 7}, "'model' must be a model name (letters, digits, '_', '.', '-')"),
        ({"model": ""}, "'model' must be a model name (letters, digits, '_', '.', '-')"),
        ({"remove": "yes"}, "'remove' must be true or false"),
        ({"remove": True}, "a removal ('remove': true) has no files and no smoke cases"),
        ({"files": ["model.onnx"]}, "each file must be {path, sha256, length}"),
        ({"files": [{"sha256": "0" * 64, "length": 1}]}, "a file's 'path' must be text"),
        ({"files": [entry("/m")]}, "file path '/m' is not a plain relative path"),
        ({"files": [entry("a/./b")]}, "file path 'a/./b' is not a plain relative path"),
        ({"files": [entry("a/")]}, "file path 'a/' is not a plain relative path"),
        ({"files": [entry("")]}, "file path '' is not a plain relative path"),
        (
            {"files": [entry("a/.b")]},
            "file path 'a/.b': '.b' may hold only letters, digits, '_',"
            " '.', '+', '-', and may not start with '.' or '-'",
        ),
        (
            {"files": [entry("a/" + "x" * 129)]},
            f"file path 'a/{'x' * 129}': '{'x' * 129}' may"
            " hold only letters, digits, '_', '.', '+', '-', and may not start with '.' or '-'",
        ),
        (
            {"files": [{**entry(), "sha256": "A" * 64}]},
            "file 'model.onnx': 'sha256' must be 64 lowercase hex digits",
        ),
        (
            {"files": [{**entry(), "sha256": "0" * 63}]},
            "file 'model.onnx': 'sha256' must be 64 lowercase hex digits",
        ),
        (
            {"files": [{**entry(), "sha256": None}]},
            "file 'model.onnx': 'sha256' must be 64 lowercase hex digits",
        ),
        ({"files": [entry(), entry()]}, "a file is listed twice"),
        ({"targets": []}, "'targets' may hold only 'fleet', 'hardware' and 'nodes'"),
        (
            {"targets": {"fleet": "f1", "zone": "z"}},
            "'targets' may hold only 'fleet', 'hardware' and 'nodes'",
        ),
        ({"targets": {"hardware": "aarch64"}}, "'targets.hardware' must be a list of names"),
        ({"targets": {"hardware": [1]}}, "'targets.hardware' must be a list of names"),
        ({"targets": {"nodes": ["n1", None]}}, "'targets.nodes' must be a list of names"),
        ({"smoke": {}}, "'smoke' must be a list of test cases"),
        ({"smoke": [{}, []]}, "'smoke' must be a list of test cases"),
        ({"expires": None}, "'expires' must be ms since the epoch"),
        ({"expires": True}, "'expires' must be ms since the epoch"),
        ({"expires": 1.5}, "'expires' must be ms since the epoch"),
        (
            {"type": "package", "deb_version": 1},
            "'deb_version' must be a Debian version (a package manifest)",
        ),
        ({"type": "package"}, "'deb_version' must be a Debian version (a package manifest)"),
        (
            {"type": "package", "deb_version": "1." + "x" * 64},
            "'deb_version' must be a Debian version (a package manifest)",
        ),
        (
            {"type": "package", "deb_version": "1.0", "files": [entry("e.deb"), entry("f.deb")]},
            "a package manifest lists one file, the .deb (a plain name)",
        ),
        (
            {"type": "package", "deb_version": "1.0", "files": [entry("_e.deb")]},
            "a package manifest lists one file, the .deb (a plain name)",
        ),
        (
            {"type": "package", "deb_version": "1.0", "files": [], "remove": True},
            "a package manifest lists one file, the .deb (a plain name)",
        ),
        ({"type": "model", "deb_version": ""}, "'deb_version' is for package manifests"),
    ],
)
def test_each_refusal_names_the_field_exactly(changes: dict[str, Any], says: str) -> None:
    assert refusal(manifest(**changes)) == says


def test_the_longest_names_and_versions_are_taken() -> None:
    longest = "x" * 128
    assert parse_signed(manifest(files=[entry(f"{longest}/{longest}")])).files[0].path == (
        f"{longest}/{longest}"
    )
    deb = "x" * 124 + ".deb"  # 128 characters
    package = parse_signed(manifest(type="package", deb_version="1" + "x" * 63, files=[entry(deb)]))
    assert package.deb_version == "1" + "x" * 63 and package.files[0].path == deb
    assert refusal("signed") == "'signed' must be an object"
    removal = parse_signed(manifest(remove=True, files=[], smoke=[]))
    assert removal.remove is True and removal.files == () and removal.size == 0


def test_signatures_are_bounded_and_each_bad_one_says_why() -> None:
    signed = manifest(expires=10_000)
    good = sign(signed, {"fleet-1": KEYS["fleet-1"]})["signatures"][0]
    sixteen = {"signed": signed, "signatures": [good] * 16}
    assert verify(sixteen, ANCHORS, now=9_999).kids == ("fleet-1",)
    with pytest.raises(ManifestError) as refused:
        verify({"signed": signed, "signatures": [good] * 17}, ANCHORS, now=9_999)
    assert str(refused.value) == "more than 16 signatures"
    rows = [
        "x",
        {"kid": 7, "sig": good["sig"]},
        {"kid": "fleet-2"},  # a trusted kid, no sig
        {"kid": "fleet-2", "sig": "!" + good["sig"]},  # not base64: not skipped over
        {"kid": "fleet-3", "sig": "abc"},
        {"kid": "fleet-1", "sig": good["sig"]},
    ]
    with pytest.raises(ManifestError) as refused:
        verify({"signed": signed, "signatures": rows}, ANCHORS, threshold=2, now=9_999)
    assert str(refused.value) == (
        "1 valid signature(s) by distinct trust anchor keys, 2 needed ('None' is not a trust"
        " anchor; '7' is not a trust anchor; fleet-2's signature is not base64 text; fleet-2's"
        " signature does not verify; fleet-3's signature does not verify)"
    )
    with pytest.raises(ManifestError) as refused:
        verify({"signed": signed, "signatures": []}, ANCHORS)
    assert str(refused.value) == "0 valid signature(s) by distinct trust anchor keys, 1 needed"
    assert verify({"signed": signed, "signatures": []}, ANCHORS, threshold=0, now=0).kids == ()
    docs: list[Any] = [[], {"signatures": {}}, {"signed": signed}]
    for doc in docs:
        with pytest.raises(ManifestError) as refused:
            verify(doc, ANCHORS)
        assert str(refused.value) == 'a manifest is {"signed": {...}, "signatures": [...]}'


def test_signed_fields_that_json_cannot_carry_are_refused_before_any_signature() -> None:
    bad = manifest(smoke=[{"atol": float("nan")}])
    with pytest.raises(ManifestError, match=r"^'signed' is not JSON that can be signed: "):
        verify({"signed": bad, "signatures": []}, ANCHORS)
    with pytest.raises(ManifestError) as refused:
        verify({"signed": "text", "signatures": []}, ANCHORS, threshold=0)
    assert str(refused.value) == "'signed' must be an object"


def test_expiry_is_judged_by_the_clock_when_no_time_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc = sign(manifest(expires=50_000), {"fleet-1": KEYS["fleet-1"]})
    monkeypatch.setattr(manifest_module, "now_ms", lambda: 49_999)
    assert verify(doc, ANCHORS).expires == 50_000
    monkeypatch.setattr(manifest_module, "now_ms", lambda: 51_499)
    with pytest.raises(ManifestError) as refused:
        verify(doc, ANCHORS)
    assert str(refused.value) == "expired 1 s ago: a manifest replayed after its time (freeze)"
    with pytest.raises(ManifestError, match=r"^expired 2 s ago"):
        verify(doc, ANCHORS, now=51_501)


def test_absent_targets_and_smoke_are_none_and_a_removal_needs_no_smoke_key() -> None:
    signed = manifest()
    del signed["targets"], signed["smoke"]
    found = verify(sign(signed, {"fleet-1": KEYS["fleet-1"]}), ANCHORS)
    assert (found.targets, found.smoke) == ({}, [])
    assert found.for_node("any", "any", "any") == ""
    removal = make("m", 3, [], remove=True)
    del removal["smoke"], removal["targets"]
    assert parse_signed(removal).remove is True


def test_a_signature_counts_once_per_key_and_names_the_kid_it_counted_under() -> None:
    key = KEYS["fleet-1"]
    anchors = {**ANCHORS, "fleet-1-copy": key.public_key()}
    doc = sign(manifest(), {"fleet-1": key, "fleet-1-copy": key})
    doc["signatures"].append(doc["signatures"][0])  # fleet-1 again: not a reason, not a signer
    with pytest.raises(ManifestError) as refused:
        verify(doc, anchors, threshold=2)
    assert str(refused.value) == (
        "1 valid signature(s) by distinct trust anchor keys, 2 needed ('fleet-1-copy' is the"
        " same key as 'fleet-1')"
    )
    same = sign(manifest(), {"fleet-1": key})
    same["signatures"] *= 3
    with pytest.raises(ManifestError) as refused:
        verify(same, anchors, threshold=2)
    assert str(refused.value) == "1 valid signature(s) by distinct trust anchor keys, 2 needed"


def test_a_signature_is_strict_base64_and_a_kid_of_any_json_type_is_no_anchor() -> None:
    signed = manifest()
    sig = sign(signed, {"fleet-1": KEYS["fleet-1"]})["signatures"][0]["sig"]
    for junk in ("!" + sig, sig[:10] + "\n" + sig[10:]):
        with pytest.raises(ManifestError) as refused:
            verify({"signed": signed, "signatures": [{"kid": "fleet-1", "sig": junk}]}, ANCHORS)
        assert str(refused.value).endswith("1 needed (fleet-1's signature does not verify)")
    kids: list[Any] = [[], {"k": 1}, 1.5]
    for kid in kids:
        with pytest.raises(ManifestError) as refused:
            verify({"signed": signed, "signatures": [{"kid": kid, "sig": sig}]}, ANCHORS)
        assert str(refused.value).endswith(f"1 needed ('{kid}' is not a trust anchor)")


def test_a_signed_part_that_is_no_object_is_judged_against_no_bytes() -> None:
    """What signs a non-object ``signed`` is checked against the empty message: a signature
    of the JSON text does not count, one of nothing does, and the manifest is refused."""
    key = KEYS["fleet-1"]
    of_text = base64.b64encode(key.sign(canonical("text"))).decode()  # type: ignore[arg-type]
    with pytest.raises(ManifestError) as refused:
        verify({"signed": "text", "signatures": [{"kid": "fleet-1", "sig": of_text}]}, ANCHORS)
    assert str(refused.value) == (
        "0 valid signature(s) by distinct trust anchor keys, 1 needed (fleet-1's signature does"
        " not verify)"
    )
    of_nothing = base64.b64encode(key.sign(b"")).decode()
    with pytest.raises(ManifestError) as refused:
        verify({"signed": [], "signatures": [{"kid": "fleet-1", "sig": of_nothing}]}, ANCHORS)
    assert str(refused.value) == "'signed' must be an object"
