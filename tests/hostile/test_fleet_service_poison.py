"""The fleet service (issue 24) lives on whatever nodes publish and whatever callers send.

- A fuzzer (hypothesis) feeds the registry batches of hostile messages on every topic it reads,
  on a real SQLite file and a real PostgreSQL: bytes, envelopes whose bodies are any JSON,
  numbers past a BIGINT, NUL and lone surrogates in every text, device alerts, heartbeat
  figures, histogram buckets, enrolment and renewal requests (signed by a real issuing CA when
  their CSR is good). Nothing escapes ``ingest``, a good birth in the same batch is written, and
  the fleet's series stay one valid exposition.
- The real service process, against a real Mosquitto, gets garbage on every topic it
  subscribes to, enrolment requests and renewals too (empty, invalid UTF-8, nested 100,000
  deep, 200 KiB, wrong types, NUL, huge numbers) from a node's side: it stays healthy,
  counts the poison, and a node's birth and heartbeat after them are in the registry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from cloudsync.fleet.enrolment import Enrolments, Issuer
from cloudsync.fleet.exporter import NodeSeries
from cloudsync.fleet.registry import Message, Registry
from cloudsync.protocol.enrol import make_csr, new_key
from cloudsync.protocol.envelope import Envelope
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics, enrol_request
from tests.fleetservice import FleetService
from tests.mosquitto import OPERATOR, Broker
from tests.pki import issue
from tests.postgres import fleet_store

GOOD_CSR = make_csr(new_key(), "n")
KINDS = ["status", "heartbeat", "events", "telemetry", "desired-models", "enrol", "renew"]
WATCHED = frozenset({"m"})
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=20) | st.sampled_from(
    ["\x00", "\ud800", "m", "online", "offline", "active", "a" * 70]
)
numbers = st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)
# bodies shaped like the real ones, with any value anywhere
bodies = st.fixed_dictionaries(
    {},
    optional={
        "state": st.sampled_from(["online", "offline"]) | json_values,
        "labels": st.dictionaries(texts, texts | json_values, max_size=3) | json_values,
        "models": st.lists(st.dictionaries(texts, json_values, max_size=3), max_size=3)
        | json_values,
        "hardware": json_values,
        "reason": json_values,
        # an enrolment request: a CSR (a good one for "n", or anything) and a token
        "csr": st.sampled_from([GOOD_CSR, GOOD_CSR[:-40], "x"]) | json_values,
        "token": json_values,
        # a device alert (cloudsync.agent.alerts) and a heartbeat's figures
        "alert": st.sampled_from(["EdgedLocalLoadHigh", "bad name"]) | json_values,
        "severity": json_values,
        "summary": json_values,
        "value": numbers | json_values,
        "active_since_ms": numbers | json_values,
        "at_ms": numbers | json_values,
        "load": st.dictionaries(
            st.sampled_from(
                [
                    "cpu_percent",
                    "gpu_percent",
                    "memory_total",
                    "memory_available",
                    "throttled",
                    "power_mode",
                    "temperatures",
                    "sources",
                    "x",
                ]
            ),
            numbers | json_values,
        )
        | json_values,
        "link": st.dictionaries(
            st.sampled_from(["up", "rtt_s", "rtt_p95_s", "bandwidth_bps"]), numbers | json_values
        )
        | json_values,
        "breaker": json_values,
        "cloud_error_ratio": numbers | json_values,
        "inflight": numbers | json_values,
        "edged": json_values,
        "outbox": st.fixed_dictionaries(
            {
                "depth": st.dictionaries(texts, numbers | json_values) | json_values,
                "bytes": numbers | json_values,
                "budget_bytes": numbers,
                "dead_letters": numbers,
                "disk_full": st.booleans() | json_values,
                "counters": st.dictionaries(texts, numbers | json_values) | json_values,
                "oldest_age_s": numbers | json_values,
            }
        )
        | json_values,
        "delivery": st.fixed_dictionaries(
            {
                "model": st.sampled_from(["m"]) | json_values,
                "version": numbers | json_values,
                "step": json_values,
            }
        )
        | json_values,
        "metrics": st.fixed_dictionaries(
            {
                "models": st.lists(
                    st.fixed_dictionaries(
                        {
                            "model": st.just("m"),
                            "version": json_values,
                            "requests": numbers | json_values,
                            "outcomes": st.dictionaries(
                                st.sampled_from(["error", "ok"]), numbers | json_values
                            )
                            | json_values,
                            "p95_ms": numbers | json_values,
                            "confidence_n": numbers | json_values,
                            "confidence_mean": numbers | json_values,
                            "buckets": st.dictionaries(
                                st.sampled_from(["0.01", "+Inf", "x", "1e400", "-1"]),
                                numbers | json_values,
                            )
                            | json_values,
                            "seconds": numbers | json_values,
                        }
                    ),
                    max_size=2,
                ),
                "routes": st.dictionaries(
                    st.just("m"), st.dictionaries(texts, numbers | json_values) | json_values
                ),
                "cloud": st.dictionaries(texts, st.dictionaries(texts, json_values)) | json_values,
            }
        )
        | json_values,
    },
)


def envelope_bytes(body: dict[str, Any], ts: int) -> bytes:
    try:
        return Envelope("n", 1, body, ts=ts).encode()
    except (ValueError, TypeError):  # a body the envelope cannot carry: raw JSON then
        return json.dumps(
            {"v": 1, "id": "x", "ts": ts, "node": "n", "seq": 1, "body": body}, default=str
        ).encode(errors="surrogatepass")


payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(envelope_bytes, bodies, st.integers(-(2**65), 2**65) | st.just(1_800_000_000_000)),
)
messages = st.lists(st.tuples(st.sampled_from(KINDS), payloads), min_size=1, max_size=8)


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Registry]:
    cluster = request.getfixturevalue("postgres_cluster") if request.param != "sqlite" else None
    store = fleet_store(request.param, tmp_path, cluster)
    issue("fleet CA", None, tmp_path, "ca")  # enrolment requests are answered, signed
    yield Registry(
        store, enrolments=Enrolments(store, Issuer(tmp_path / "ca.pem", tmp_path / "ca.key", 1))
    )
    store.close()


def test_no_message_escapes_ingest_and_the_good_ones_are_written(registry: Registry) -> None:
    good = Envelope("good", 1, {"state": "online", "labels": {"k": "v"}}, ts=1).encode()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(messages)
    def fuzz(batch: list[tuple[str, bytes]]) -> None:
        hostile = [Message(kind, "n", payload, 1, "a" * 32) for kind, payload in batch]
        done = registry.ingest([*hostile, Message("status", "good", good, 2)], WATCHED)
        assert "good" in done.births
        assert done.poison + sum(done.counted.values()) == len(hostile) + 1

    fuzz()
    row = registry.node("good", 10)
    assert row is not None and row["labels"] == {"k": "v"}
    # whatever the nodes sent, the fleet's series are one valid exposition
    text = NodeSeries(registry.store, "f1", 10**15, lambda: 1_800_000_000_000).render()
    families = {f.name for f in text_string_to_metric_families(text.decode())}
    assert "cloudsync_mqtt_connected" in families


GARBAGE: list[bytes] = [
    b"",
    b"\xff\xfe",
    b"not json",
    b"[" * 100_000 + b"]" * 100_000,
    b"x" * 200_000,
    b'{"v": 1, "id": "a", "ts": 1, "node": "n", "seq": 1, "body": []}',
    Envelope("n", 1, {"state": "online", "labels": {"k\\u0000": "v"}}).encode(),
    Envelope("n", 1, {"state": 5}).encode(),
    Envelope("n", 1, {"delivery": {"model": "m\x00", "version": 2**80, "step": "x"}}).encode(),
    Envelope("n", 2**64, {"state": "online"}).encode(),
    Envelope("n", 1, {"metrics": {"models": [{"model": "m", "requests": 2**70}]}}).encode(),
    Envelope("n", 1, {"models": [1, 2]}).encode(),
]
LEAVES = {
    "status": "status",
    "heartbeat": "heartbeat",
    "events": "events",
    "telemetry": "telemetry",
    "desired": "desired_models",
    "renew": "renew",
}


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    yield broker
    broker.kill()


def test_the_service_lives_on_garbage_from_the_nodes(tmp_path: Path, broker: Broker) -> None:
    service = FleetService(tmp_path / "service", broker).start()
    client = SyncClient(broker.port, broker.pki, OPERATOR)
    assert client.connect()
    try:
        pid = service.proc.pid  # type: ignore[union-attr]
        topics = Topics("f1", "evil")
        sent = 0
        for payload in GARBAGE:
            for attribute in LEAVES.values():
                client.publish(getattr(topics, attribute), payload)
                sent += 1
            client.publish(enrol_request("f1", "a" * 32), payload)  # a new device's request
            sent += 1
        now = int(time.time() * 1000)
        good = Topics("f1", "n1")
        client.publish(
            good.status, Envelope("n1", 1, {"state": "online"}, ts=now).encode(), retain=True
        )
        client.publish(good.heartbeat, Envelope("n1", 2, {"uptime_s": 1}, ts=now + 1).encode())

        def written() -> bool:
            status, row = service.call("GET", "/v1/nodes/n1")
            return status == 200 and row["heartbeats"] == 1

        assert service.wait_for(written, 30), service.logs()[-3000:]
        assert service.proc is not None and service.proc.pid == pid and service.proc.poll() is None
        assert service.call("GET", "/healthz")[0] == 200
        metrics = service.call("GET", "/metrics")[1]
        poison = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("edgefleet_poison_messages_total")
        )
        print(f"{sent} hostile messages, {poison:.0f} counted as poison")
        assert poison >= len(GARBAGE) * 3  # every status, heartbeat, event one at least
        errors = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("edgefleet_database_errors_total")
        )
        assert errors == 0  # each refused before it reached the database
    finally:
        client.close()
        service.kill()
