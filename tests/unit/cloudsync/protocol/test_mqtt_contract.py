"""The MQTT contract: every topic built and parsed by one module, and the envelope."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloudsync.protocol import envelope, topics
from cloudsync.protocol.envelope import Envelope, EnvelopeError
from cloudsync.protocol.topics import Topic, TopicError, Topics

NAMES = st.from_regex(r"[A-Za-z0-9-][A-Za-z0-9_-]{0,63}", fullmatch=True)


@given(NAMES, NAMES, NAMES)
def test_every_topic_parses_back_to_what_built_it(fleet: str, node: str, cmd: str) -> None:
    t = Topics(fleet, node)
    for kind in topics.LEAVES:
        assert topics.parse(getattr(t, kind)) == Topic(fleet, node, kind)
    assert topics.parse(t.desired_models) == Topic(fleet, node, "desired-models")
    assert topics.parse(t.cmd(cmd)) == Topic(fleet, node, "cmd", cmd)
    assert topics.parse(t.cmd_result(cmd)) == Topic(fleet, node, "cmd-result", cmd)


def test_names_cannot_reach_into_other_topics() -> None:
    # a leading _ is the fleet's own level (_fleet: rollouts), never a node's or a fleet's
    for bad in ["a/b", "+", "#", "", "x" * 65, "node 1", "é", "_fleet"]:
        with pytest.raises(TopicError):
            Topics("fleet", bad)
        with pytest.raises(TopicError):
            Topics(bad, "node")
    t = Topics("f1", "n1")
    for bad_cmd in ["a/b", "+", "#", ""]:
        with pytest.raises(TopicError):
            t.cmd(bad_cmd)
    assert t.commands == "edge/v1/f1/n1/cmd/+" and t.everything == "edge/v1/f1/n1/#"
    assert topics.fleet_filter("f1", "status") == "edge/v1/f1/+/status"
    for bad_topic in [
        "edge/v2/f1/n1/status",
        "edge/v1/f1/n1/unknown",
        "edge/v1/f1/n1/cmd/x/other",
        "edge/v1/f1/+/status",
        "edge/v1/f1/n1",
        "other/v1/f1/n1/status",
    ]:
        with pytest.raises(TopicError):
            topics.parse(bad_topic)


def test_envelope_round_trip_is_byte_stable_and_keeps_unknown_keys() -> None:
    sent = Envelope("n1", 7, {"temp_c": 41.5, "ok": True})
    data = sent.encode()
    assert data == sent.encode()  # canonical: the same bytes every time
    got = envelope.decode(data)
    assert got == sent and len(got.id) == 32 and got.ts > 1_700_000_000_000
    later = json.loads(data) | {"sig": "abc", "kid": "fleet-1"}  # a later minor, a signature
    kept = envelope.decode(json.dumps(later).encode())
    assert kept.extra == {"sig": "abc", "kid": "fleet-1"}
    assert envelope.decode(kept.encode()) == kept


@pytest.mark.parametrize(
    "doc, words",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"v": 1}', "missing id, ts, node, seq, body"),
        (b'{"v": 2, "id": "a", "ts": 1, "node": "n", "seq": 0, "body": {}}', "version 2"),
        (b'{"v": 1, "id": "a", "ts": -1, "node": "n", "seq": true, "body": []}', "ts, seq, body"),
        (b'{"v": 1, "id": "", "ts": 1, "node": "", "seq": 0, "body": {}}', "bad id, node"),
    ],
)
def test_bad_envelopes_are_refused_with_what_is_wrong(doc: bytes, words: str) -> None:
    with pytest.raises(EnvelopeError, match=words):
        envelope.decode(doc)


def test_an_envelope_over_the_limit_is_refused() -> None:
    big = Envelope("n1", 1, {"x": "y" * envelope.MAX_BYTES})
    with pytest.raises(EnvelopeError, match="over"):
        big.encode()
    with pytest.raises(EnvelopeError, match="over"):
        envelope.decode(b" " * (envelope.MAX_BYTES + 1))


# ---- the survivors of mutation testing (issue 32), each killed here --------------------------

EXAMPLE = (
    b'{"body":{"temp_c":41.5},"epoch":"5c1e0d9a7b3f4e21","id":"3f2a9c0e5b7d4e1f8a6b2c4d0e9f1a3b",'
    b'"node":"jetson-17","priority":"telemetry","seq":4242,"ts":1764760000123,"v":1}'
)  # docs/PROTOCOL.md's envelope, byte for byte


def test_the_documented_envelope_is_exactly_these_bytes_and_decodes_to_its_fields() -> None:
    sent = Envelope(
        "jetson-17",
        4242,
        {"temp_c": 41.5},
        "3f2a9c0e5b7d4e1f8a6b2c4d0e9f1a3b",
        1764760000123,
        extra={"priority": "telemetry", "epoch": "5c1e0d9a7b3f4e21"},
    )
    assert sent.v == 1 and sent.encode() == EXAMPLE
    got = envelope.decode(EXAMPLE)
    assert (got.node, got.seq, got.body, got.id, got.ts, got.v) == (
        "jetson-17",
        4242,
        {"temp_c": 41.5},
        "3f2a9c0e5b7d4e1f8a6b2c4d0e9f1a3b",
        1764760000123,
        1,
    )
    assert got.extra == {"epoch": "5c1e0d9a7b3f4e21", "priority": "telemetry"}


def test_canonical_bytes_sort_keys_keep_unicode_and_refuse_nan() -> None:
    doc = {"b": [1, {"d": None, "c": True}], "a": "é ✓"}
    assert envelope.canonical(doc) == '{"a":"é ✓","b":[1,{"c":true,"d":null}]}'.encode()
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError):
            envelope.canonical({"x": bad})


def test_new_ids_are_32_hex_characters_and_now_is_integer_milliseconds() -> None:
    ids = {envelope.new_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    before = time.time_ns() // 1_000_000
    now = envelope.now_ms()
    after = time.time_ns() // 1_000_000
    assert type(now) is int and before <= now <= after
    made = Envelope("n1", 0, {})
    assert len(made.id) == 32 and before <= made.ts <= envelope.now_ms() and made.extra == {}


def sized(total: int) -> bytes:
    """A valid envelope of exactly ``total`` bytes."""
    base = len(canonical_of(Envelope("n1", 1, {"x": ""}, "a" * 32, 1)))
    data = canonical_of(Envelope("n1", 1, {"x": "y" * (total - base)}, "a" * 32, 1))
    assert len(data) == total
    return data


def test_an_envelope_of_exactly_256_kib_is_taken_and_one_byte_more_is_not() -> None:
    assert envelope.MAX_BYTES == 262_144  # 256 KiB: the broker's Maximum Packet Size
    data = sized(262_144)
    assert envelope.decode(data).encode() == data
    over = sized(262_145)
    with pytest.raises(EnvelopeError) as refused:
        envelope.decode(over)
    assert str(refused.value) == "an envelope of 262145 bytes is over 262144"
    big = Envelope("n1", 1, {"x": "y" * 262_144}, "a" * 32, 1)
    with pytest.raises(EnvelopeError) as refused:
        big.encode()
    assert str(refused.value) == f"an envelope of {len(canonical_of(big))} bytes is over 262144"


def canonical_of(env: Envelope) -> bytes:
    return envelope.canonical(env.as_dict())


def test_a_record_body_of_the_documented_limit_fits_one_message_with_the_largest_fields() -> None:
    """docs/PROTOCOL.md: a record's body is at most 260,096 bytes as canonical JSON, so that
    with its envelope (64-character node and id, the largest seq and ts) it fits 256 KiB."""
    assert envelope.MAX_BODY_BYTES == 260_096
    body = {"x": "y" * (260_096 - len(envelope.canonical({"x": ""})))}
    assert len(envelope.canonical(body)) == envelope.MAX_BODY_BYTES
    largest = Envelope(
        "n" * 64,
        2**63 - 1,
        body,
        "i" * 64,
        2**63 - 1,
        extra={"epoch": "e" * 16, "priority": "telemetry"},
    )
    assert envelope.decode(largest.encode()) == largest


def nested(levels: int) -> bytes:
    """An envelope whose body nests ``levels`` deep in all (the envelope itself is level 1)."""
    inner = "[" * (levels - 2) + "]" * (levels - 2)
    return b'{"v":1,"id":"a","ts":1,"node":"n","seq":0,"body":{"x":' + inner.encode() + b"}}"


def test_nesting_of_32_levels_is_taken_and_33_are_refused_even_far_deeper() -> None:
    assert envelope.decode(nested(32)).body["x"] is not None
    for levels in (33, 34, 100_000):  # json itself gives up far before the last
        with pytest.raises(EnvelopeError) as refused:
            envelope.decode(nested(levels))
        assert str(refused.value) == "nested deeper than 32 levels"
    with pytest.raises(EnvelopeError, match=r"^nested deeper than 32 levels$"):
        envelope.decode(b"[" * 40 + b"]" * 40)  # too deep before it is found not an object


@pytest.mark.parametrize(
    ("doc", "depth"),
    [
        (1, 0),
        ("x", 0),
        (None, 0),
        ([], 1),
        ({}, 1),
        ([1, "a"], 1),
        ({"a": {"b": 1}}, 2),
        ([[], [[[]]], {}], 4),
        ({"a": [1, {"b": []}], "c": {}}, 4),
        ([{"a": []}, [[[[]]]]], 5),
    ],
)
def test_depth_counts_the_deepest_object_or_list(doc: object, depth: int) -> None:
    assert envelope.depth(doc) == depth


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (b"not json", "not JSON: Expecting value: line 1 column 1 (char 0)"),
        (b'{"x": NaN}', "not JSON: NaN is not JSON"),
        (b'{"x": -Infinity}', "not JSON: -Infinity is not JSON"),
        (
            b"\xff\xfe{",
            "not JSON: 'utf-16-le' codec can't decode byte 0x7b in position 2: truncated data",
        ),
        (b"[1, 2]", "an envelope is a JSON object"),
        (b'"text"', "an envelope is a JSON object"),
        (b"{}", "missing v, id, ts, node, seq, body"),
        (b'{"v": 1, "id": "a", "node": "n", "body": {}}', "missing ts, seq"),
        (
            b'{"v": 2, "id": "a", "ts": 1, "node": "n", "seq": 0, "body": {}}',
            "envelope version 2: this reader knows 1",
        ),
        (
            b'{"v": "1", "id": "a", "ts": 1, "node": "n", "seq": 0, "body": {}}',
            "envelope version '1': this reader knows 1",
        ),
        (
            b'{"v": 1, "id": 7, "ts": 1.0, "node": ["n"], "seq": -1, "body": null}',
            "bad id, ts, node, seq, body",
        ),
        (b'{"v": 1, "id": "a", "ts": false, "node": "n", "seq": 0.0, "body": {}}', "bad ts, seq"),
    ],
)
def test_every_refusal_says_exactly_what_is_wrong(doc: bytes, says: str) -> None:
    with pytest.raises(EnvelopeError) as refused:
        envelope.decode(doc)
    assert str(refused.value) == says


def test_the_bounds_of_each_field_are_inclusive() -> None:
    def doc(**fields: object) -> bytes:
        base: dict[str, object] = {"v": 1, "id": "a", "ts": 0, "node": "n", "seq": 0, "body": {}}
        return json.dumps(base | fields).encode()

    got = envelope.decode(doc(id="i" * 64, node="n" * 64, ts=0, seq=0))
    assert (got.id, got.node, got.ts, got.seq, got.body) == ("i" * 64, "n" * 64, 0, 0, {})
    assert envelope.decode(doc(id="i", node="n")).id == "i"
    for fields, bad in (
        ({"id": "i" * 65}, "bad id"),
        ({"node": "n" * 65}, "bad node"),
        ({"id": ""}, "bad id"),
        ({"node": ""}, "bad node"),
        ({"ts": -1}, "bad ts"),
        ({"seq": -1}, "bad seq"),
        ({"ts": True}, "bad ts"),
        ({"seq": True}, "bad seq"),
        ({"body": []}, "bad body"),
    ):
        with pytest.raises(EnvelopeError) as refused:
            envelope.decode(doc(**fields))
        assert str(refused.value) == bad


def test_printable_escapes_what_utf8_cannot_carry_and_caps_the_length() -> None:
    assert envelope.printable("héllo") == "héllo"
    assert envelope.printable("a\udcffb") == "a\\udcffb"
    assert envelope.printable("x" * 500) == "x" * 500
    assert envelope.printable("x" * 501) == "x" * 500 + "... [1 more]"
    assert envelope.printable("abcdef", 6) == "abcdef"
    assert envelope.printable("abcdefg", 6) == "abcdef... [1 more]"
    assert envelope.printable("\udcff" * 3, 4) == "\\udc... [14 more]"
