"""Trust documents: thresholds of the keys in force and of the new ones, distinct keys, scoped
keys, versions, and the state a node keeps (cloudsync.protocol.trust)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol.trust import Trust, TrustError, TrustState, make, raw, sign, verify

KEYS = {kid: Ed25519PrivateKey.generate() for kid in ("a", "b", "c", "d")}
PUBLIC = {kid: key.public_key() for kid, key in KEYS.items()}
CURRENT = Trust(0, {k: PUBLIC[k] for k in "abc"}, {}, 2)  # two of a, b, c sign for the fleet


def doc(version: int, kids: str, threshold: int, signers: str) -> dict[str, object]:
    signed = make(version, {k: (PUBLIC[k], None) for k in kids}, threshold, ["0f" * 32])
    return sign(signed, {k: KEYS[k] for k in signers})


def test_a_rotation_needs_the_threshold_of_the_keys_in_force_and_of_its_own() -> None:
    new = verify(doc(1, "cd", 2, "abcd"), CURRENT)  # a and b in force; c and d its own
    assert (new.version, sorted(new.anchors), new.threshold) == (1, ["c", "d"], 2)
    assert new.revoked == frozenset({"0f" * 32})
    for signers, says in (
        ("ad", "1 valid signature(s) by the keys in force, 2 needed"),
        ("abd", "1 valid signature(s) by its own keys, 2 needed"),
        ("d", "0 valid signature(s) by the keys in force"),
    ):
        with pytest.raises(TrustError, match=re.escape(says)):
            verify(doc(1, "cd", 2, signers), CURRENT)
    with pytest.raises(TrustError, match="expired"):
        verify(doc(1, "cd", 2, "abcd"), CURRENT, now=2**62)


def test_one_key_under_two_kids_and_scoped_keys_do_not_make_a_threshold() -> None:
    twice = make(1, {"a": (PUBLIC["a"], None), "a2": (PUBLIC["a"], None)}, 1)
    with pytest.raises(TrustError, match="threshold 2 with 1 distinct signing key"):
        make(1, {"a": (PUBLIC["a"], None), "a2": (PUBLIC["a"], None)}, 2)
    with pytest.raises(TrustError, match="threshold 1 with 0 distinct signing key"):
        make(1, {"ops": (PUBLIC["d"], ["drain"])}, 1)
    one = Trust(0, {"a": PUBLIC["a"], "a2": PUBLIC["a"]}, {}, 2)  # in force: one key, twice
    with pytest.raises(TrustError, match="'a2' is the same key as 'a'"):
        verify(sign(twice, {"a": KEYS["a"], "a2": KEYS["a"]}), one)
    scoped = Trust(0, {"a": PUBLIC["a"], "ops": PUBLIC["d"]}, {"ops": frozenset({"drain"})}, 1)
    with pytest.raises(TrustError, match="0 valid signature"):  # a command key signs no trust
        verify(
            sign(make(1, {"d": (PUBLIC["d"], None)}, 1), {"ops": KEYS["d"], "d": KEYS["d"]}), scoped
        )


def test_a_node_keeps_what_it_took_and_a_file_it_cannot_read_gives_no_keys(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trust.json"
    state = TrustState(path, CURRENT)
    rotation = doc(1, "cd", 2, "abcd")
    taken = state.offer(rotation)
    assert taken is not None and sorted(taken.anchors) == ["c", "d"]
    assert state.offer(rotation) is None  # the retained document again: nothing new
    assert state.offer(doc(2, "bcd", 2, "cd")) is not None  # c and d in force now
    with pytest.raises(TrustError, match="version 1 is not above 2"):  # an older one, replayed
        state.offer(rotation)
    again = TrustState(path, CURRENT)  # a restart
    assert sorted(again.current.anchors) == ["b", "c", "d"] and again.current.version == 2
    assert {raw(k) for k in again.current.anchors.values()} == {
        raw(PUBLIC["b"]),
        raw(PUBLIC["c"]),
        raw(PUBLIC["d"]),
    }
    chain = json.loads(path.read_text())["chain"]
    for bad in (
        {"version": "one"},
        {"chain": chain[1:]},  # a document without the one before: its signers are not in force
        {"chain": [{**chain[0], "signed": {**chain[0]["signed"], "threshold": 1}}, chain[1]]},
    ):
        path.write_text(json.dumps(bad))
        broken = TrustState(path, CURRENT)
        assert broken.current.anchors == {} and "cannot be used" in broken.error, bad
    with pytest.raises(TrustError, match="by the keys in force"):  # nothing is taken
        broken.offer(doc(2, "cd", 2, "abcd"))
