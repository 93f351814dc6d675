"""Model manifests: signatures by a threshold of trust anchors, expiry, paths, targets."""

from __future__ import annotations

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
from cloudsync.protocol.manifest import (
    DEB_VERSION,
    PACKAGE_FILE,
    ManifestError,
    file_entry,
    make,
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
        "intent-classifier", 7, 1234, ("fleet-1",),
    )  # fmt: skip
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
    ["../etc/passwd", "/abs/model.onnx", "a/../../b", ".hidden", "a//b", "", "sub/-x", "a\\b",
     "model.onnx\n"],
)  # fmt: skip
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
        sign(manifest(targets={"hardware": ["aarch64"], "nodes": ["n1", "n2"]}),
             {"fleet-2": KEYS["fleet-2"]}),
        ANCHORS,
    )  # fmt: skip
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


FIELD = (st.none() | st.booleans() | st.integers() | st.text(max_size=70)
         | st.sampled_from(["1.0", "2:1.0+1~rc1", "1.0/..", "model", "package", ""]))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["model", "package", None, "Package"]) | FIELD,
       remove=FIELD, deb_version=FIELD,
       path=st.sampled_from(["edged_1.0_amd64.deb", "model.onnx", "a/edged.deb", ".deb",
                             "edged:1.deb", "edged_1.0_amd64.deb\n"]))  # fmt: skip
def test_any_type_remove_and_deb_version_give_a_consistent_manifest_or_a_refusal(
    kind: Any, remove: Any, deb_version: Any, path: str
) -> None:
    """What verify accepts is one of three shapes: a model version (files, no deb_version), a
    removal (no files), or a package (one .deb by a plain name, a Debian version); never a
    package that removes, nor a deb_version on a model."""
    doc = manifest(files=[{"path": path, "sha256": "0" * 64, "length": 1}], type=kind,
                   remove=remove, deb_version=deb_version)  # fmt: skip
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
    doc = sign(manifest(), {"fleet-0": retired, "fleet-1": KEYS["fleet-1"],
                            "fleet-2": KEYS["fleet-2"]})  # fmt: skip
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
        "model": "intent-classifier", "version": 7, "unverified": True,
    }  # fmt: skip
    package = {"kind": "package", "model": "edged", "version": 3}
    assert claimed({"manifest": {"signed": package}})["model"] == "package:edged"
    for bad in (None, [], {"manifest": []}, {"manifest": {"signed": "x"}},
                {"manifest": {"signed": {"model": "a b", "version": 1}}},
                {"manifest": {"signed": {"model": "m", "version": True}}},
                {"manifest": {"signed": {"model": "m", "version": 0}}},
                {"manifest": {"signed": {"model": "m", "version": 2**63}}},
                {"manifest": {"signed": {"model": "m", "version": "7"}}}):  # fmt: skip
        assert claimed(bad) == {}, bad
