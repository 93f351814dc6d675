"""The MQTT contract: every topic built and parsed by one module, and the envelope."""

from __future__ import annotations

import json

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
