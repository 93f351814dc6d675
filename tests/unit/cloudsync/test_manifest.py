"""Model manifests: signatures by a threshold of trust anchors, expiry, paths, targets."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol.manifest import ManifestError, file_entry, make, sign, verify

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
    ["../etc/passwd", "/abs/model.onnx", "a/../../b", ".hidden", "a//b", "", "sub/-x", "a\\b"],
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
        ({"type": "software"}, "not a model manifest"),
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
