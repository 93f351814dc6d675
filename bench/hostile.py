#!/usr/bin/env python3
"""A real edged while a hostile client sends the worst inputs of issue 21 in a loop: how fast
/v2/health/ready answers meanwhile (its p50/p99/max is the event loop's stall), and how much
memory edged (with its children) takes. Baseline in the same run: the same probe with no
hostile traffic. Probes that found no room (503 over server.max_connections, or the listen
backlog full: BlockingIOError) are counted in the answers column, not in the latencies.

Each row: the hostile client (one thread, back to back, for ``--seconds``) sends one kind of
input; a prober asks /v2/health/ready every 20 ms on a connection of its own; RSS is read from
/proc every 50 ms.

    .venv/bin/python bench/hostile.py [--seconds 10] [--only PNG] [--skip WAV]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.idle_unload import tree_rss  # noqa: E402
from tests.conftest import Daemon  # noqa: E402

CONFIG = """
[server]
read_timeout_s = 5.0
[models]
load = ["intent", "text-embedding", "text-encoder", "intent-classifier", "vad", "vad-silero",
        "ocr", "ocr-det", "ocr-rec", "ocr-cls"]
"""


def post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: edged\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def json_38mib() -> bytes:
    data = b"[" + b"0.5," * (10 << 20) + b"0.5]"
    doc = b'{"inputs":[{"name":"embedding","datatype":"FP32","shape":[10485761],"data":'
    return post("/v2/models/intent-classifier/infer", doc + data + b"}]}")


def bytes_15mib() -> bytes:
    count = 4_000_000
    chunk = b"\0\0\0\0" * count
    tensor = {"name": "text", "datatype": "BYTES", "shape": [count]}
    tensor["parameters"] = {"binary_data_size": len(chunk)}
    header = json.dumps({"inputs": [tensor]}).encode()
    extra = f"Inference-Header-Content-Length: {len(header)}\r\n"
    return post("/v2/models/intent/infer", header + chunk, extra)


def wav_38mib() -> bytes:
    frames = 38 << 20
    fmt = b"\x01\x00\x01\x00" + (192000).to_bytes(4, "little") * 2 + b"\x01\x00\x08\x00"
    wav = b"RIFF" + (36 + frames).to_bytes(4, "little") + b"WAVEfmt \x10\x00\x00\x00" + fmt
    return post("/v1/vad", wav + b"data" + frames.to_bytes(4, "little") + bytes(frames))


def markdown(size: int) -> Callable[[], bytes]:
    def make() -> bytes:
        line = "#" * 6 + " " + "*_[a](" * (size // 6)
        doc = {"documents": [{"text": line[:size], "format": "markdown", "source": "x.md"}]}
        return post("/v1/kb/hostile/ingest", json.dumps(doc).encode())

    return make


def json_infer(mib: float) -> Callable[[], bytes]:
    """The largest kind of JSON infer body: numbers ("0.5,"), ``mib`` of them."""

    def make() -> bytes:
        count = int(mib * (1 << 20)) // 4
        doc = b'{"inputs":[{"name":"embedding","datatype":"FP32","shape":[%d],"data":' % count
        return post(
            "/v2/models/intent-classifier/infer", doc + b"[" + b"0.5," * (count - 1) + b"0.5]}]}"
        )

    return make


def long_texts() -> bytes:
    """256 texts of 16 KB to /v1/intent (a 4 MiB body, within every limit): issue 44."""
    words = ["edge", "inference", "on", "the", "device", "and", "in", "cloud"]
    text = " ".join(words[i % 8] for i in range(3300))[:16384]
    return post("/v1/intent", json.dumps({"texts": [text] * 256}).encode())


def big_image() -> bytes:
    """A 6000 x 6000 PNG of one colour: 48 KB on the wire (issue 44)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (6000, 6000), 255).save(out, "PNG", optimize=True)
    return post("/v1/ocr", out.getvalue())


def small_garbage() -> bytes:
    body = b'{"inputs":[{"name":"embedding","datatype":"FP32","shape":[0,2147483647,2147483647],'
    return post(
        "/v2/models/intent-classifier/infer", body + b'"data":[NaN, 1' + b"1" * 5000 + b"]}]}"
    )


INPUTS: dict[str, Callable[[], bytes]] = {
    "none (baseline)": lambda: b"",
    "38 MiB JSON infer": json_38mib,
    "15 MiB binary BYTES of empty strings": bytes_15mib,
    "38 MiB 8-bit 192 kHz WAV": wav_38mib,
    "1.5 KB markdown line (ingest)": markdown(1536),
    "4 KB markdown line (ingest)": markdown(4096),
    "NaN, 5,000-digit integer, huge shape": small_garbage,
    "15 MiB JSON infer of numbers": json_infer(15),
    "JSON infer of numbers just under max_json_bytes (2 MiB)": json_infer(1.99),
    "256 texts of 16 KB (/v1/intent, 4 MiB)": long_texts,
    "6000 x 6000 PNG of 48 KB (/v1/ocr)": big_image,
}


def send(path: Path, raw: bytes) -> str:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(120)
        try:
            sock.connect(str(path))
            sock.sendall(raw)
            reply = sock.recv(64)
        except OSError as exc:  # a full listen backlog, a close before the whole body was read
            return type(exc).__name__
    parts = reply.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 else "closed"


def half_sent(path: Path, stop: threading.Event) -> dict[str, int]:
    """1,100 half-sent requests, opened again as edged closes them."""
    held: list[socket.socket] = []
    opened = 0
    while not stop.is_set():
        while len(held) < 1100 and not stop.is_set():
            sock = socket.socket(socket.AF_UNIX)
            opened += 1
            try:
                sock.connect(str(path))
                sock.sendall(b"POST /v1/intent HTTP/1.1\r\nContent-Length: 100\r\n")
            except OSError:  # refused over the cap, and closed already
                sock.close()
                continue
            held.append(sock)
        time.sleep(0.2)
        alive = []
        for sock in held:
            sock.setblocking(False)
            try:
                if sock.recv(16) == b"":
                    sock.close()
                    continue
                sock.close()  # answered (503 over the cap): gone
                continue
            except BlockingIOError:
                alive.append(sock)
        held = alive
    for sock in held:
        sock.close()
    return {"connections opened": opened}


def run(daemon: Daemon, name: str, seconds: float) -> dict[str, object]:
    assert daemon.proc is not None
    stop = threading.Event()
    latencies: list[float] = []
    peak = [tree_rss(daemon.proc.pid)]
    start_rss = peak[0]
    statuses: dict[str, int] = {}

    def prober() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            status = send(daemon.socket, b"GET /v2/health/ready HTTP/1.1\r\nHost: e\r\n\r\n")
            if status == "200":
                latencies.append((time.perf_counter() - started) * 1000)
            else:  # counted apart: a probe turned away has no latency to report
                statuses[f"probe {status}"] = statuses.get(f"probe {status}", 0) + 1
            time.sleep(0.02)

    def sampler() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(daemon.proc.pid))  # type: ignore[union-attr]
            time.sleep(0.05)

    def hostile() -> None:
        if name == "1,100 half-sent requests":
            statuses.update(half_sent(daemon.socket, stop))
            return
        raw = INPUTS[name]()
        while not stop.is_set() and raw:
            status = send(daemon.socket, raw)
            statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=f) for f in (prober, sampler, hostile)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    time.sleep(2.0)  # what edged gives back once the hostile client stops
    after = tree_rss(daemon.proc.pid)
    latencies.sort()
    latencies = latencies or [float("nan")]  # no probe answered 200 in the whole row
    return {
        "input": name,
        "answers": ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())) or "-",
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "max": latencies[-1],
        "rss": start_rss / 2**20,
        "peak": peak[0] / 2**20,
        "after": after / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--skip", action="append", default=[], help="rows whose name has this")
    parser.add_argument("--only", action="append", default=[], help="rows whose name has this")
    args = parser.parse_args()
    names = [n for n in [*INPUTS, "1,100 half-sent requests"] if not any(s in n for s in args.skip)]
    if args.only:
        names = [n for n in names if n == "none (baseline)" or any(s in n for s in args.only)]
    with tempfile.TemporaryDirectory() as work:
        daemon = Daemon(Path(work), config=CONFIG).start()
        try:
            rows = [run(daemon, name, args.seconds) for name in names]
            alive = daemon.proc is not None and daemon.proc.poll() is None
        finally:
            daemon.stop()
    print(
        "| hostile input (in a loop) | edged's answers | ready p50 ms | p99 ms | max ms |"
        " RSS before MiB | peak MiB | after MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        memory = f"{r['rss']:.0f} | {r['peak']:.0f} | {r['after']:.0f}"
        print(
            f"| {r['input']} | {r['answers']} | {r['p50']:.1f} | {r['p99']:.1f} |"
            f" {r['max']:.1f} | {memory} |"
        )
    print(f"\nedged still running after all rows: {alive}")


if __name__ == "__main__":
    main()
