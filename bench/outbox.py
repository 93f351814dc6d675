#!/usr/bin/env python3
"""cloudsync's outbox: disk use per 100,000 records, and outbox-to-broker throughput.

1. Disk: 100,000 telemetry records (a typical metric sample, ~150 bytes of JSON) put into an
   ``Outbox`` in batches of 1,000 (one transaction, one fsync each); the file's size (database
   plus WAL, after a checkpoint) and the put rate.
2. Throughput: a real Mosquitto on loopback with the fleet's configuration (TLS 1.3, client
   certificates, ACLs; ``tests/mosquitto.py``) and a consumer with a persistent session
   subscribed to the node. ``--records`` records wait in cloudsync's outbox; cloudsync starts
   (a subprocess) and delivers them: records/s from its start until the outbox is empty (every
   PUBACK in) and until the consumer has them all. Baseline in the same run: the same records
   published at QoS 1 by a bare paho client (200 in flight, no outbox, nothing on disk), until
   the last PUBACK.

    .venv/bin/python bench/outbox.py [--records 20000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from cloudsync.agent.outbox import Item, Outbox  # noqa: E402
from cloudsync.protocol.envelope import Envelope  # noqa: E402
from cloudsync.protocol.mqtt import SyncClient, tls_context  # noqa: E402
from cloudsync.protocol.topics import Topics  # noqa: E402
from edged.client import Client  # noqa: E402
from tests.mosquitto import OPERATOR, Broker, cloudsync_config, make_pki  # noqa: E402

NODE = Topics("bench", "n1")


def sample(i: int) -> dict[str, object]:
    return {
        "metric": "edged_request_duration_seconds",
        "value": 0.0123 + i % 97 / 1000,
        "labels": {"model": "intent", "route": "local"},
        "n": i,
    }


def disk_per_100k(work: Path) -> tuple[float, float, float]:
    """(MiB on disk, bytes a record, records/s put)."""
    box = Outbox(work / "disk.db", budget_bytes=1 << 40)
    started = time.perf_counter()
    for start in range(0, 100_000, 1000):
        box.put_many([Item("telemetry", sample(i)) for i in range(start, start + 1000)])
    seconds = time.perf_counter() - started
    box.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    box.close()
    size = sum(p.stat().st_size for p in work.glob("disk.db*"))
    return size / (1 << 20), size / 100_000, 100_000 / seconds


def baseline(broker: Broker, records: int) -> float:
    """Records/s of bare paho QoS 1 publishes, 200 in flight, until the last PUBACK."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw", protocol=mqtt.MQTTv5)
    pki = broker.pki
    client.tls_set_context(tls_context(pki / "ca.pem", pki / "n1.pem", pki / "n1.key"))
    client.max_inflight_messages_set(200)
    acked = threading.Semaphore(0)
    client.on_publish = lambda *_: acked.release()
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    payloads = [Envelope("n1", i, sample(i)).encode() for i in range(records)]  # the same bytes
    started = time.perf_counter()
    for payload in payloads:
        client.publish(NODE.telemetry, payload, qos=1)
    for _ in range(records):
        acked.acquire()
    seconds = time.perf_counter() - started
    client.disconnect()
    client.loop_stop()
    return records / seconds


def through_cloudsync(broker: Broker, work: Path, records: int) -> tuple[float, float]:
    """(records/s until the outbox is empty, records/s until the consumer has them all)."""
    box = Outbox(work / "outbox.db", budget_bytes=1 << 40)
    for start in range(0, records, 1000):
        box.put_many(
            [Item("telemetry", sample(i)) for i in range(start, min(records, start + 1000))]
        )
    box.close()
    config = work / "cloudsync.toml"
    config.write_text('log_level = "warning"\n' + cloudsync_config(broker, work, "bench"))
    consumer = SyncClient(broker.port, broker.pki, OPERATOR, client_id="bench-consumer")
    assert consumer.connect()
    consumer.subscribe(NODE.telemetry)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "cloudsync.agent.cli", "--config", str(config)])
    try:
        local = Client(str(work / "cloudsync.sock"), timeout=5)
        drained = None
        while drained is None:
            time.sleep(0.05)
            try:
                if local.call("GET", "/v1/status")["outbox"]["pending"] == 0:
                    drained = time.perf_counter() - started
            except Exception:
                pass  # not up yet
        consumer.wait_messages(records, 120)
        arrived = time.perf_counter() - started
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
        consumer.close()
    return records / drained, records / arrived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    args = parser.parse_args()
    if shutil.which("mosquitto") is None:
        sys.exit("mosquitto is not installed (make test installs it)")
    work = Path(tempfile.mkdtemp(prefix="bench-outbox-"))
    try:
        mib, per_record, put_rate = disk_per_100k(work)
        print("## outbox on disk: 100,000 telemetry records (~150 B of JSON each)\n")
        print("| MiB on disk | bytes a record | put, records/s (batches of 1,000) |")
        print("| --- | --- | --- |")
        print(f"| {mib:.1f} | {per_record:.0f} | {put_rate:,.0f} |\n")
        broker = Broker(work / "mosquitto", make_pki(work / "pki", ["n1"])).start()
        try:
            raw = [baseline(broker, args.records) for _ in range(2)]
            drained, arrived = through_cloudsync(broker, work, args.records)
        finally:
            broker.stop()
        best_raw = max(raw)
        print(f"## outbox to broker: {args.records:,} records, Mosquitto on loopback, TLS 1.3\n")
        print("| path | records/s | / bare paho |")
        print("| --- | --- | --- |")
        print(f"| bare paho QoS 1, 200 in flight (best of 2) | {best_raw:,.0f} | 1 |")
        print(
            f"| cloudsync: outbox empty (all PUBACKs) | {drained:,.0f} | {drained / best_raw:.2f} |"
        )
        print(f"| cloudsync: all at the consumer | {arrived:,.0f} | {arrived / best_raw:.2f} |")
        print("\n(cloudsync's figures include its start: the process, TLS, the session)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
