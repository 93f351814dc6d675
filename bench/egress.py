#!/usr/bin/env python3
"""The egress ledger's cost: per entry, and on cloud calls at 200 calls/s.

1. One entry (``Ledger.record``, edged/egress.py): the SHA-256 of payloads of 1 KiB, 64 KiB and
   1 MiB, then the entry itself (JSON, its hash, one ``write``), timed call by call
   (``perf_counter_ns``), medians; the ledger's bytes per entry. Baseline in the same run: a
   bare ``os.write`` of a line of the same size to the same kind of file.
2. End to end: two real edged daemons, one with the ledger and one with ``[egress] enabled =
   false``, both calling the same real cloud (the tests' MLServer serving intent-classifier on
   loopback) for every request (``route: cloud``), driven open-loop at ``--rate`` calls per
   second (each call sent at its time, whatever the others do) in alternating rounds (A B, B A,
   ...), so drift and order hit both alike; client-side latency percentiles and the ratio of
   the medians.

    .venv/bin/python bench/egress.py [--rate 200] [--seconds 5] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer import ensure_venv, start_peer  # noqa: E402
from bench.routing import table  # noqa: E402
from bench.serving import edged_argv, stop  # noqa: E402
from edged.client import Client  # noqa: E402
from edged.common.egress import Ledger, digest  # noqa: E402
from edged.common.stats import percentile  # noqa: E402

MODELS = ROOT / "models"
MODEL = "intent-classifier"


def bench_entries(count: int, workdir: Path) -> None:
    rows = []
    for size in (1 << 10, 64 << 10, 1 << 20):
        payload = os.urandom(size)
        ledger = Ledger(workdir / f"ledger-{size}")
        ledger.open()
        hashing, recording, raw = [], [], []
        start_size = ledger.size
        with (workdir / f"raw-{size}.jsonl").open("ab", buffering=0) as bare:
            for i in range(count):
                t = time.perf_counter_ns()
                sha = digest(payload)
                hashing.append(time.perf_counter_ns() - t)
                t = time.perf_counter_ns()
                ledger.record(
                    "cloud-infer",
                    request_id=f"req-{i}",
                    uid=1000,
                    model=MODEL,
                    cloud_model=MODEL,
                    endpoint="https://cloud.example/api/v1",
                    tier="cloud",
                    protocol="rest",
                    route="cloud",
                    reason="rule cloud-first: action cloud",
                    labels={"embedding": "public"},
                    bytes=size,
                    sha256=sha,
                )
                recording.append(time.perf_counter_ns() - t)
                line = b"x" * (ledger.size // max(1, i + 2)) + b"\n"
                t = time.perf_counter_ns()
                os.write(bare.fileno(), line)
                raw.append(time.perf_counter_ns() - t)
        per_entry = (ledger.size - start_size) / count
        ledger.close()
        rows.append(
            [
                f"{size >> 10} KiB",
                statistics.median(hashing) / 1000,
                statistics.median(recording) / 1000,
                statistics.median(raw) / 1000,
                per_entry,
            ]
        )
    print(f"\n## one entry: medians of {count} calls, microseconds\n")
    print(table(rows, ["payload", "SHA-256 µs", "record µs", "bare write µs", "ledger bytes"]))


def wait_ready(client: Client) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status = client.status()
            if status["ready"] and MODEL in (status.get("cloud") or {}).get("catalog", []):
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise SystemExit("edged or its cloud did not come up")


def drive(client: Client, rate: float, seconds: float, first: int) -> list[float]:
    """Open loop: call i is sent at i / rate s; its latency from when it was sent."""
    feeds = [
        {"embedding": np.random.default_rng(first + i).standard_normal((1, 384)).astype(np.float32)}
        for i in range(64)
    ]
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t = time.perf_counter()
        _, answer = client.infer_answer(
            MODEL, feeds[i % 64], request_id=f"b-{first + i}", parameters={"route": "cloud"}
        )
        if answer["route"] != "cloud":
            raise SystemExit(f"ran {answer['route']}: {answer['reason']}")
        with lock:
            latencies.append((time.perf_counter() - t) * 1000)

    start = time.perf_counter()
    total = int(rate * seconds)
    with ThreadPoolExecutor(32) as pool:
        futures = []
        for i in range(total):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, i))
        for f in futures:
            f.result()
    return latencies


def bench_calls(rate: float, seconds: float, rounds: int, workdir: Path) -> None:
    peer = start_peer(
        ensure_venv(), MODELS / MODEL / "1" / "model.onnx", MODEL, workdir / "mlserver"
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    clients: dict[str, Client] = {}
    try:
        for name, enabled in (("ledger", "true"), ("no ledger", "false")):
            work = workdir / name.replace(" ", "-")
            work.mkdir()
            config = work / "edged.toml"
            config.write_text(
                f'[models]\nload = ["{MODEL}"]\n[cloud]\nurl = "{peer.http_url}"\n'
                f"[egress]\nenabled = {enabled}\n"
            )
            socket = work / "edged.sock"
            procs[name] = subprocess.Popen(edged_argv(work, config))
            clients[name] = Client(str(socket))
        for client in clients.values():
            wait_ready(client)
            drive(client, rate, 1.0, 900_000)  # warm-up
        latency: dict[str, list[float]] = {name: [] for name in clients}
        ratios = []
        for r in range(rounds):  # A B, then B A: what comes first in a round cancels out
            order = list(clients.items()) if r % 2 == 0 else list(clients.items())[::-1]
            medians = {}
            for k, (name, client) in enumerate(order):
                got = drive(client, rate, seconds, (r * 2 + k) * 100_000)
                latency[name] += got
                medians[name] = statistics.median(got)
            ratios.append(medians["ledger"] / medians["no ledger"])
        rows = []
        base = statistics.median(latency["no ledger"])
        for name, values in latency.items():
            s = sorted(values)
            rows.append(
                [
                    name,
                    len(s),
                    statistics.median(s),
                    percentile(s, 0.95),
                    percentile(s, 0.99),
                    statistics.median(s) / base,
                ]
            )
        entries = Ledger(workdir / "ledger" / "state" / "egress").entries(
            limit=10**6, match=lambda e: e["kind"] == "cloud-infer"
        )
        print(
            f"\n## cloud calls: intent-classifier on MLServer (loopback), open loop at {rate:g}"
            f" calls/s, {rounds} rounds of {seconds:g} s each, alternating; {os.cpu_count()}"
            " CPUs shared by both daemons, the cloud and this client\n"
        )
        print(table(rows, ["edged", "calls", "p50 ms", "p95 ms", "p99 ms", "p50 / no ledger"]))
        print(
            f"\nper round, p50 with the ledger / without: median {statistics.median(ratios):.3f},"
            f" from {min(ratios):.3f} to {max(ratios):.3f} ({rounds} rounds)"
        )
        size = sum(p.stat().st_size for p in (workdir / "ledger" / "state" / "egress").iterdir())
        print(f"\nthe ledger recorded {len(entries)} cloud calls; its size: {size} bytes")
    finally:
        for proc in procs.values():
            stop(proc)
        peer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--skip-calls", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edged-bench-egress-") as tmp:
        bench_entries(args.entries, Path(tmp))
        if not args.skip_calls:
            bench_calls(args.rate, args.seconds, args.rounds, Path(tmp))
    print(json.dumps({"python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
