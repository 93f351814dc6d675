"""Issue 22: cloudsync lives on whatever the broker hands it.

A real Mosquitto (TLS 1.3, client certificates, ACLs, the shipped ``max_packet_size``) and a real
cloudsync process. The operator publishes, on every topic cloudsync subscribes to (its commands
and its desired models), messages that are empty, invalid UTF-8, not JSON, nested 200,000 deep,
of every wrong type, with a lone surrogate in every string field, forged, expired, replayed,
addressed to another node, on a command topic whose id is not an id, and 10 MiB large. Each is
refused and reported exactly once (a command's result and a "command refused" alert; a delivery
"refused" event), the 10 MiB one is refused by the broker at the door, cloudsync's PID never
changes, no handler fails (``poison_messages`` 0, no thread restarted), and a valid command sent
after them all runs.

Before: a lone surrogate in ``kid`` made the refusal unencodable and the process exited at each
redelivery; a deeply nested command was a RecursionError that escaped the envelope's decoder.
"""

from __future__ import annotations

import base64
import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol import envelope
from cloudsync.protocol.commands import sign
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topic, TopicError, parse
from tests.cloudsync_agent import NODE, Agent, online
from tests.conftest import wait_for
from tests.mosquitto import OPERATOR, Broker

SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800: valid JSON, no valid UTF-8
STRING_FIELDS = [
    ("id",),
    ("node",),
    ("kid",),
    ("sig",),
    ("body", "name"),
    ("body", "target"),
    ("body", "nonce"),
]
WRONG_TYPES: list[tuple[tuple[str, ...], Any]] = [
    (("v",), "1"),
    (("id",), 5),
    (("ts",), "now"),
    (("ts",), -1),
    (("node",), []),
    (("seq",), 1.5),
    (("body",), []),
    (("kid",), 5),
    (("sig",), None),
    (("body", "name"), 5),
    (("body", "args"), []),
    (("body", "target"), {"f1": "n1"}),
    (("body", "exp"), "soon"),
    (("body", "nonce"), 0),
    (("ts",), 10**30),
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def changed(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> bytes:
    out = copy.deepcopy(doc)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(out).encode()


def command_poison(key: Ed25519PrivateKey) -> list[tuple[str, bytes]]:
    """(command id, payload) for .../cmd/{id}, every one to be refused; the signed ones carry
    their topic's id (so that only what is named in the test is wrong)."""
    _, good = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
    doc = json.loads(good)
    nested: Any = "deep"
    for _ in range(100):
        nested = {"a": [nested]}

    def signed(i: int, key: Ed25519PrivateKey, target: str = "f1/n1", **how: Any) -> bytes:
        return sign(key, "fleet-1", OPERATOR, target, "ping", cmd_id=f"poison-{i}", **how)[1]

    forged = signed(10, Ed25519PrivateKey.generate())
    expired = signed(11, key, lifetime_s=-5)
    elsewhere = signed(12, key, "f1/n2")
    forever = signed(13, key, lifetime_s=10 * 86400)
    payloads = [
        b"",
        b"\xff\xfe{\x80",
        b'{"v": 1, "id": "abc',
        b"[" * 200_000,
        b'{"v": 1, "seq": NaN}',
        b"null",
        b"[]",
        b'"text"',
        b"1e999",
        changed(doc, ("body", "args"), nested),
        forged,
        expired,
        elsewhere,
        forever,
        *[changed(doc, path, SURROGATE + "x") for path in STRING_FIELDS],
        *[changed(doc, path, value) for path, value in WRONG_TYPES],
        changed(doc, ("body", "args"), {SURROGATE: SURROGATE}),
    ]
    return [(f"poison-{i}", p) for i, p in enumerate(payloads)]


def desired_poison() -> list[bytes]:
    """Payloads for .../desired/models, every one to be refused (an empty one clears it)."""

    def env(body: Any) -> bytes:
        doc = {"v": 1, "id": "d" * 32, "ts": 1, "node": OPERATOR, "seq": 1, "body": body}
        return json.dumps(doc).encode()

    manifest = {"signed": {"model": SURROGATE}, "signatures": [{"kid": SURROGATE, "sig": "!"}]}
    return [
        b"\xff\xfe",
        b"not json",
        b"[" * 200_000,
        env("models"),
        env({"models": "all"}),
        env({"models": [5]}),
        env({"models": [{"manifest": manifest, "urls": {SURROGATE: SURROGATE}}]}),
        env({"models": [{"manifest": {"signatures": "none"}, "urls": {}}]}),
        env({"models": [{"manifest": [], "urls": []}]}),
    ]


def trust_poison() -> list[bytes]:
    """Payloads for .../desired/trust, each refused with one alert (cloudsync.protocol.trust)."""

    def env(body: Any) -> bytes:
        doc = {"v": 1, "id": "t" * 32, "ts": 1, "node": OPERATOR, "seq": 1, "body": body}
        return json.dumps(doc).encode()

    key = base64.b64encode(bytes(32)).decode()
    signed = {
        "type": "trust",
        "spec": 1,
        "version": 1,
        "threshold": 1,
        "expires": 2**62,
        "keys": {"k": {"public": key}},
        "revoked": [],
    }
    return [
        b"\xff\xfe",
        b"{" * 100_000,
        env("trust"),
        env({"signed": signed}),
        env({"signed": signed, "signatures": [{"kid": "k", "sig": "!!"}] * 17}),
        env({"signed": {**signed, "keys": {"k\n": {"public": key}}}, "signatures": []}),
        env({"signed": {**signed, "keys": {SURROGATE: {"public": key}}}, "signatures": []}),
        env({"signed": {**signed, "keys": {"k": {"public": "not base64"}}}, "signatures": []}),
        env({"signed": {**signed, "revoked": ["0" * 64] * 1001}, "signatures": []}),
        env({"signed": {**signed, "revoked": ["X" * 64]}, "signatures": []}),
        env({"signed": {**signed, "threshold": 2}, "signatures": []}),
        env({"signed": {**signed, "version": 2**60}, "signatures": []}),
        env({"signed": signed, "signatures": [{"kid": "k", "sig": SURROGATE}]}),
    ]


def test_poison_on_every_topic_is_refused_once_and_cloudsync_lives_on(
    broker: Broker, agent: Agent
) -> None:
    with online(broker, agent) as (key, consumer):
        assert agent.proc is not None
        pid, rss_before = agent.proc.pid, rss_kib(agent.proc.pid)
        # a valid command, then the same again: a replay
        ping_id, ping = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
        poison = [(ping_id, ping), (ping_id, ping)]
        poison += command_poison(key)
        for cmd_id, payload in poison:
            assert not consumer.publish(NODE.cmd(cmd_id), payload).is_failure, cmd_id
        # a topic cloudsync subscribes to (cmd/+) whose id is not an id: refused, an alert
        assert not consumer.publish(NODE.base + "/cmd/not.an.id", b"{}").is_failure
        # 10 MiB: the broker refuses it at the door (its max_packet_size); the publisher is cut
        big = SyncClient(broker.port, broker.pki, OPERATOR)
        assert big.connect()
        assert big.publish(NODE.cmd("big"), b"{" + b" " * (10 << 20), timeout=3) is None
        big.close()

        wait_for(lambda: len(_results_by_id(consumer)) >= len(poison) - 1, 30, "every refusal")
        refusals = 1 + len(poison) - 1  # the topic without an id, every payload but the ping
        wait_for(
            lambda: len(_alerts(consumer)) >= refusals, 30, f"{refusals} 'command refused' alerts"
        )
        by_id = _results_by_id(consumer)
        ran, replayed = sorted(by_id[ping_id], key=lambda r: not r["ok"])  # in either order
        assert ran["ok"] is True and ran["result"]["pong"] is True
        assert replayed["ok"] is False and "replayed" in replayed["error"]
        for cmd_id, _ in poison[2:]:
            (only,) = by_id[cmd_id]  # reported once
            assert only["ok"] is False and only["error"].startswith("refused: "), (cmd_id, only)
            assert len(only["error"]) < 700
        assert "big" not in by_id
        alerts = _alerts(consumer)
        assert Counter(a["command"] for a in alerts) == Counter(
            [ping_id] + [c for c, _ in poison[2:]] + [None]
        )
        why = {a["command"]: a["why"] for a in alerts}
        assert "nested deeper than 32" in why["poison-3"], why["poison-3"]
        assert "for 'f1/n2'" in why["poison-12"] and "expired" in why["poison-11"]
        assert "does not verify" in why["poison-10"] and "valid for more" in why["poison-13"]
        assert "not.an.id" in why[None]

        # the desired models, one at a time (a newer desired state replaces one not yet read)
        for i, payload in enumerate(desired_poison()):
            assert not consumer.publish(NODE.desired_models, payload).is_failure
            wait_for(lambda n=i + 1: len(_refused_deliveries(consumer)) >= n, 20, f"refusal {i}")
        assert not consumer.publish(NODE.desired_models, b"").is_failure  # clears: no report

        # trust documents: each refused once, the keys in force unchanged (the command below)
        for i, payload in enumerate(trust_poison()):
            assert not consumer.publish(NODE.desired_trust, payload).is_failure
            wait_for(lambda n=i + 1: len(_trust_refused(consumer)) >= n, 20, f"trust {i}")
        assert len(_trust_refused(consumer)) == len(trust_poison())

        ok_id, ok = sign(key, "fleet-1", OPERATOR, "f1/n1", "status")
        assert not consumer.publish(NODE.cmd(ok_id), ok).is_failure
        wait_for(lambda: ok_id in _results_by_id(consumer), 10, "the valid command's result")
        assert _results_by_id(consumer)[ok_id][0]["ok"] is True
        deliveries = _refused_deliveries(consumer)
        assert len(deliveries) == len(desired_poison()), deliveries
        assert all(len(d.get("why", "")) < 700 for d in deliveries)
        status = agent.status()
        assert agent.proc.poll() is None and agent.proc.pid == pid
        assert status["poison_messages"] == 0 and status["thread_restarts"] == {}, status
        grew = rss_kib(pid) - rss_before
        print(
            f"{len(poison) + 2} command and {len(deliveries)} desired-state poison messages;"
            f" RSS +{grew} KiB"
        )
        assert grew < 64 << 10


def test_cloudsync_takes_no_packet_larger_than_it_can_use(tmp_path: Path, pki: Path) -> None:
    """With a broker that has no size limit of its own, cloudsync's CONNECT says the largest
    packet it takes (MQTT 5's Maximum Packet Size): the broker does not send it a 10 MiB
    message at all. Without that property cloudsync would receive it and report it refused."""
    open_broker = Broker(tmp_path / "mosquitto", pki, max_packet_size=None)
    agent_ = Agent(tmp_path / "agent", open_broker)
    try:
        with online(open_broker, agent_) as (key, consumer):
            assert agent_.proc is not None
            rss_before = rss_kib(agent_.proc.pid)
            big = b'{"v":1,"pad":"' + b"x" * (10 << 20) + b'"}'
            assert not consumer.publish(NODE.cmd("big"), big, timeout=20).is_failure
            ping_id, ping = sign(key, "fleet-1", OPERATOR, "f1/n1", "ping")
            assert not consumer.publish(NODE.cmd(ping_id), ping).is_failure
            wait_for(lambda: ping_id in _results_by_id(consumer), 10, "the ping's result")
            assert "big" not in _results_by_id(consumer)  # it came before the ping: never sent
            assert rss_kib(agent_.proc.pid) - rss_before < 8 << 10
            assert agent_.status()["poison_messages"] == 0
    finally:
        if agent_.proc is not None and agent_.proc.poll() is None:
            agent_.proc.kill()
            agent_.proc.wait()
        open_broker.kill()


def _from_node(client: SyncClient, kind: str) -> list[tuple[Topic, envelope.Envelope]]:
    """What the node sent on topics of ``kind`` (the consumer also hears the operator's own
    publishes to the node, poison included: those are skipped)."""
    out = []
    for t, p in list(client.received):
        try:
            topic = parse(t)
        except TopicError:
            continue
        if topic.kind == kind:
            out.append((topic, envelope.decode(p)))
    return out


def _results_by_id(client: SyncClient) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for topic, e in _from_node(client, "cmd-result"):
        out.setdefault(topic.cmd_id or "", []).append(e.body)
    return out


def _alerts(client: SyncClient) -> list[dict[str, Any]]:
    return [
        e.body for _, e in _from_node(client, "events") if e.body.get("alert") == "command refused"
    ]


def _refused_deliveries(client: SyncClient) -> list[dict[str, Any]]:
    return [
        e.body["delivery"]
        for _, e in _from_node(client, "events")
        if e.body.get("delivery", {}).get("step") == "refused"
    ]


def _trust_refused(client: SyncClient) -> list[dict[str, Any]]:
    return [
        e.body for _, e in _from_node(client, "events") if e.body.get("alert") == "trust refused"
    ]
