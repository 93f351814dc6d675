#!/usr/bin/env python3
"""cloudsync's heartbeat while edged is under full inference load.

A real edged (``text-embedding``) saturated by ``--clients`` threads that each send 32-text
``/v1/embed`` requests back to back; a real Mosquitto (TLS 1.3, the fleet's configuration); a
real cloudsync pointed at both, heartbeat every ``--interval`` seconds; a consumer that notes
when each heartbeat arrives. Over ``--seconds``: the gaps between heartbeats as the consumer
saw them (arrival) and as cloudsync stamped them (``ts``), p50, p99 and max; edged's request
rate and the machine's load during the run. Baseline in the same run: the same measurement
with edged idle, first.

    .venv/bin/python bench/heartbeat.py [--interval 10] [--seconds 180] [--clients 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloudsync.protocol import envelope  # noqa: E402
from cloudsync.protocol.mqtt import SyncClient  # noqa: E402
from cloudsync.protocol.topics import Topics  # noqa: E402
from edged.client import Client  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.mosquitto import OPERATOR, Broker, cloudsync_config, make_pki  # noqa: E402

NODE = Topics("bench", "n1")
TEXTS = [f"sentence number {i} about the weather and the device's state" for i in range(32)]


def gaps(stamps: list[float]) -> tuple[float, float, float]:
    diffs = [b - a for a, b in itertools.pairwise(stamps)]
    q = statistics.quantiles(diffs, n=100, method="inclusive") if len(diffs) > 1 else diffs
    return statistics.median(diffs), q[98] if len(q) > 98 else max(diffs), max(diffs)


def measure(consumer: SyncClient, seconds: float) -> tuple[list[float], list[float]]:
    start = len(consumer.received)
    arrivals: list[float] = []
    stamps: list[float] = []
    seen = start
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = consumer.wait_messages(seen + 1, 0.2)
        for _, payload in got[seen:]:
            arrivals.append(time.monotonic())
            stamps.append(envelope.decode(payload).ts / 1000)
        seen = len(got)
    return arrivals, stamps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-heartbeat-"))
    procs: list[subprocess.Popen[bytes]] = []
    broker = Broker(work / "mosquitto", make_pki(work / "pki", ["n1"])).start()
    try:
        edged_sock = work / "edged.sock"
        (work / "edged.toml").write_text('[models]\nload = ["text-embedding"]\n')
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "edged",
                    "--config",
                    str(work / "edged.toml"),
                    "--socket",
                    str(edged_sock),
                    "--state-dir",
                    str(work / "state"),
                    "--models",
                    str(ROOT / "models"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for(lambda: edged_sock.exists() and Client(str(edged_sock)).ready(), 120, "edged")
        (work / "cloudsync.toml").write_text(
            'log_level = "warning"\n'
            + cloudsync_config(
                broker,
                work,
                "bench",
                edged_socket=edged_sock,
                more=f"[heartbeat]\ninterval_s = {args.interval}",
            )
        )
        consumer = SyncClient(broker.port, broker.pki, OPERATOR)
        assert consumer.connect()
        consumer.subscribe(NODE.heartbeat)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cloudsync.agent.cli",
                    "--config",
                    str(work / "cloudsync.toml"),
                ]
            )
        )
        consumer.wait_messages(1, 30)
        half = args.seconds / 2
        idle = measure(consumer, half)
        stop = threading.Event()
        done = [0]

        def load() -> None:
            client = Client(str(edged_sock), timeout=60)
            while not stop.is_set():
                client.call("POST", "/v1/embed", {"texts": TEXTS})
                done[0] += 1

        threads = [threading.Thread(target=load) for _ in range(args.clients)]
        for t in threads:
            t.start()
        load_start = time.monotonic()
        busy = measure(consumer, args.seconds)
        elapsed = time.monotonic() - load_start
        loadavg = os.getloadavg()[0]
        stop.set()
        for t in threads:
            t.join()
        consumer.close()
        print(
            f"## heartbeat every {args.interval:g} s; edged: text-embedding, "
            f"{os.cpu_count()} CPUs\n"
        )
        print("| edged | heartbeats | gap p50 s | gap p99 s | gap max s | by ts: p99 s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, (arrivals, stamps) in [("idle", idle), ("under load", busy)]:
            p50, p99, top = gaps(arrivals)
            print(
                f"| {name} | {len(arrivals)} | {p50:.3f} | {p99:.3f} | {top:.3f} "
                f"| {gaps(stamps)[1]:.3f} |"
            )
        print(
            f"\nload: {args.clients} clients, {done[0] / elapsed:.1f} embed requests/s of 32 "
            f"texts ({32 * done[0] / elapsed:.0f} texts/s), 1-min load average {loadavg:.1f}"
        )
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(30)
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
