"""`edgefleet nodes` in its direct-MQTT mode lists every node, or says the list is partial
(issue 24): it answered from a 2 s listening window, and with the retained statuses of 10,000
nodes on a local Mosquitto it listed 2,700 of them without a word. Now it publishes a marker
after subscribing (cloudsync.protocol.topics.barrier) and waits for it: the broker hands a new
subscription's retained messages before it, and drops the marker too when its queue cannot hold
them (measured: a queue of 100 handed 120 of 1,000 statuses and never the marker).

A real Mosquitto (TLS, ACLs) holding 10,000 retained statuses, published by the test as nodes
would publish their births.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cloudsync.protocol.envelope import Envelope
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics
from tests.mosquitto import OPERATOR, Broker, edgefleet

NODES = 10_000


def births(broker: Broker, count: int) -> None:
    """``count`` nodes' retained online statuses, each acknowledged by the broker."""
    client = SyncClient(broker.port, broker.pki, OPERATOR)
    assert client.connect()
    try:
        sent = []
        for i in range(count):
            body = {"state": "online", "software": {"cloudsync": "sim"}, "models": []}
            payload = Envelope(f"sim-{i:05d}", i, body).encode()
            sent.append(
                client.client.publish(Topics("f1", f"sim-{i:05d}").status, payload, 1, True)
            )
        for info in sent:
            info.wait_for_publish(60)
            assert info.is_published()
    finally:
        client.close()


def test_every_retained_status_or_a_partial_list_that_says_so(tmp_path: Path, pki: Path) -> None:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    try:
        births(broker, NODES)
        started = time.monotonic()
        done = edgefleet(broker, "--json", "nodes", "--wait", "0")
        took = time.monotonic() - started
        assert done.returncode == 0 and done.stderr == "", done.stderr
        rows = json.loads(done.stdout)
        assert len(rows) == NODES and {r["state"] for r in rows} == {"online"}
        assert [r["node"] for r in rows] == [f"sim-{i:05d}" for i in range(NODES)]
        print(f"edgefleet nodes: {NODES} nodes in {took:.1f} s (process start included)")

        # a broker whose queue cannot hold the fleet's statuses: the list is partial, and says so
        broker.stop()
        broker.config.write_text(
            broker.config.read_text().replace(
                "max_queued_messages 100000", "max_queued_messages 100"
            )
        )
        broker.start()
        short = edgefleet(broker, "--json", "--timeout", "5", "nodes", "--wait", "0")
        assert short.returncode == 4, short.stderr
        assert "partial list" in short.stderr and "max_queued_messages" in short.stderr
        assert len(json.loads(short.stdout)) < NODES
    finally:
        broker.kill()
