#!/usr/bin/env python3
"""Load benchmark: edged (REST and gRPC over Unix sockets) against in-process ONNX Runtime and a
peer server (MLServer, its own venv, loopback), in ONE run, on the same ONNX files.

Targets, each serving the same graph with the same request:
- ``ort``: ``InferenceSession.run`` in this process from N threads, unbatched, with edged's
  session settings (thread spinning off) so that the difference is the serving;
- ``edged-rest`` / ``edged-grpc``: a fresh edged daemon (dynamic batching as in the default
  repository); one keep-alive connection per client thread (REST: binary tensors);
- ``peer``: MLServer (parallel_workers 0) with an ONNX Runtime model (same session settings),
  over v2 REST (JSON: MLServer has no binary extension) on loopback, without and with its
  adaptive batching (64 requests / 2 ms); bench/peer.py sets it up in .bench-venv/mlserver.

Closed loop: N client threads, each sending its next request when the last one is answered.
Open loop: requests sent at a fixed rate whatever the answers, latency counted from the time a
request was due (no coordinated omission). Reported: QPS, p50/p95/p99 in ms, errors; ratios
against in-process ORT measured in the same run. Then an overload run at 2x the measured
saturation rate (429/503 counted, time to refuse, RSS of edged), and 100 QPS on every light
default model.

    .venv/bin/python bench/load.py [--seconds 5] [--overload-seconds 30] [--no-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import edged_argv, rss_mib, tensor_inputs  # noqa: E402
from edged.client import Client, UnixHTTPConnection  # noqa: E402
from edged.common.stats import percentile  # noqa: E402
from edged.oip.tensors import HEADER_LENGTH, encode_tensors  # noqa: E402

MODELS = ROOT / "models"
Tensors = dict[str, np.ndarray]
Call = Callable[[], int]  # one request; returns the HTTP-like status (200 ok)


@dataclass
class Result:
    """What one run measured."""

    seconds: float
    latencies: list[float] = field(default_factory=list)  # of the answered requests
    statuses: dict[int, int] = field(default_factory=dict)
    refusals: list[float] = field(default_factory=list)  # time to a 429/503

    def add(self, status: int, latency: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == 200:
            self.latencies.append(latency)
        elif status in (429, 503):
            self.refusals.append(latency)

    @property
    def qps(self) -> float:
        return len(self.latencies) / self.seconds

    def pct(self, q: float, samples: list[float] | None = None) -> float:
        value = percentile(sorted(self.latencies if samples is None else samples), q)
        return float("nan") if value is None else value * 1000

    @property
    def errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s != 200)


# ---- clients: one per thread, each returns a Call ---------------------------------------------


def ort_client(session: ort.InferenceSession, feeds: Tensors) -> Callable[[], Call]:
    def make() -> Call:
        def call() -> int:
            session.run(None, feeds)
            return 200

        return call

    return make


def rest_client(socket_path: str, model: str, inputs: Tensors, **params: Any) -> Callable[[], Call]:
    """Binary-tensor REST over one keep-alive Unix-socket connection per thread."""
    path, body, headers = rest_request(model, inputs, **params)

    def make() -> Call:
        conn = UnixHTTPConnection(socket_path, 60)

        def call() -> int:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            return response.status

        return call

    return make


def grpc_client(url: str, model: str, inputs: Tensors) -> Callable[[], Call]:
    """tritonclient.grpc, one client per thread: ``url`` is ``unix:///path`` or host:port."""
    import tritonclient.grpc as grpcclient

    def make() -> Call:
        client = grpcclient.InferenceServerClient(url)
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), _datatype(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)

        def call() -> int:
            client.infer(model, tensors)
            return 200

        return call

    return make


def http_client(url: str, model: str, inputs: Tensors) -> Callable[[], Call]:
    """JSON v2 REST over one keep-alive TCP connection per thread (the peer's protocol)."""
    doc = {
        "inputs": [
            {
                "name": name,
                "datatype": _datatype(array),
                "shape": list(array.shape),
                "data": array.reshape(-1).tolist(),
            }
            for name, array in inputs.items()
        ]
    }
    body = json.dumps(doc).encode()
    host, port = url.removeprefix("http://").split(":")

    def make() -> Call:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)

        def call() -> int:
            conn.request(
                "POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            response.read()
            return response.status

        return call

    return make


def _datatype(array: np.ndarray) -> str:
    return {"int64": "INT64", "float32": "FP32"}[str(array.dtype)]


# ---- load shapes --------------------------------------------------------------------------


def closed_loop(make: Callable[[], Call], concurrency: int, seconds: float) -> Result:
    """``concurrency`` threads, each sending its next request when the last is answered."""
    calls = [make() for _ in range(concurrency)]
    for call in calls:  # warm-up: connections, first runs
        call()
    result = Result(seconds)
    lock = threading.Lock()
    end = time.perf_counter() + seconds

    def worker(call: Call) -> None:
        while True:
            start = time.perf_counter()
            if start >= end:
                return
            status = _status(call)
            with lock:
                result.add(status, time.perf_counter() - start)

    threads = [threading.Thread(target=worker, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


async def _session(socket: Path) -> Any:
    import aiohttp

    connector = aiohttp.UnixConnector(path=str(socket), limit=1024)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


async def _post(session: Any, path: str, body: bytes, headers: dict[str, str]) -> int:
    import aiohttp

    try:
        async with session.post(f"http://edged{path}", data=body, headers=headers) as r:
            await r.read()
            return int(r.status)
    except aiohttp.ClientError:
        return 599


def open_loop(
    socket: Path, path: str, body: bytes, headers: dict[str, str], rate: float, seconds: float
) -> Result:
    """Requests due at a fixed ``rate`` over REST/UDS from one asyncio client (threads cannot
    keep a schedule on 2 cores); latency counted from when each request was due. QPS is what
    was answered per second of the run, until the last answer."""

    async def run() -> Result:
        result = Result(seconds)
        async with await _session(socket) as session:

            async def send(due: float) -> None:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                result.add(await _post(session, path, body, headers), time.perf_counter() - due)

            start = time.perf_counter() + 0.2
            await asyncio.gather(*(send(start + i / rate) for i in range(int(rate * seconds))))
            result.seconds = time.perf_counter() - start
        return result

    return asyncio.run(run())


def saturate(
    socket: Path, path: str, body: bytes, headers: dict[str, str], clients: int, seconds: float
) -> Result:
    """Closed loop from ``clients`` asyncio tasks: the most the server answers per second."""

    async def run() -> Result:
        result = Result(seconds)
        async with await _session(socket) as session:
            end = time.perf_counter() + seconds

            async def client() -> None:
                while (start := time.perf_counter()) < end:
                    result.add(
                        await _post(session, path, body, headers), time.perf_counter() - start
                    )

            await asyncio.gather(*(client() for _ in range(clients)))
        return result

    return asyncio.run(run())


def rest_request(model: str, inputs: Tensors, **params: Any) -> tuple[str, bytes, dict[str, str]]:
    """Path, body and headers of a binary-tensor OIP request."""
    entries, chunks = encode_tensors(inputs, dict.fromkeys(inputs, True))
    doc = {"inputs": entries, "parameters": {"binary_data_output": True, **params}}
    header = json.dumps(doc).encode()
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return f"/v2/models/{model}/infer", header + b"".join(chunks), headers


def _status(call: Call) -> int:
    try:
        return call()
    except Exception as exc:  # a refused or failed call counts, it does not stop the run
        status = getattr(exc, "status", None)
        code = status() if callable(status) else None
        return {"StatusCode.RESOURCE_EXHAUSTED": 429, "StatusCode.UNAVAILABLE": 503}.get(
            str(code), 599
        )


# ---- the run ------------------------------------------------------------------------------


def start_peers(graphs: list[str], workdir: Path) -> dict[str, Any]:
    """MLServer (its own venv, bench/peer.py) for each graph, without and with its adaptive
    batching (up to 64 requests within 2 ms, ``<graph>+batching``), with the session settings
    edged uses (spinning off), so that the rows differ by serving."""
    from bench import peer as peer_module

    venv = peer_module.ensure_venv(ROOT / ".bench-venv" / "mlserver")
    spin_off = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}
    peers = {}
    for graph in graphs:
        onnx_file = MODELS / graph / "1" / "model.onnx"
        peers[graph] = peer_module.start_peer(
            venv, onnx_file, graph, workdir / graph, session_config=spin_off
        )
        peers[graph + "+batching"] = peer_module.start_peer(
            venv,
            onnx_file,
            graph,
            workdir / (graph + "-batching"),
            max_batch_size=64,
            max_batch_time=0.002,
            session_config=spin_off,
        )
    return peers


def start_edged(workdir: Path, models: Path = MODELS) -> tuple[subprocess.Popen[bytes], Path]:
    socket = workdir / "edged.sock"
    proc = subprocess.Popen(edged_argv(workdir, models=models))
    client = Client(str(socket))
    while not (socket.exists() and _ready(client)):
        if proc.poll() is not None:
            raise SystemExit(f"edged exited with {proc.returncode}")
        time.sleep(0.05)
    return proc, socket


def _ready(client: Client) -> bool:
    try:
        return client.ready()
    except Exception:
        return False


def row(label: str, target: str, c: int | str, r: Result, base: Result | None) -> list[str]:
    ratio = f"{r.qps / base.qps:.2f}x" if base and base.qps else "-"
    return [
        label,
        target,
        str(c),
        f"{r.qps:.0f}",
        f"{r.pct(0.5):.2f}",
        f"{r.pct(0.95):.2f}",
        f"{r.pct(0.99):.2f}",
        str(r.errors),
        ratio,
    ]


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each closed run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--overload-seconds", type=float, default=30.0)
    parser.add_argument("--no-peer", action="store_true", help="skip the MLServer peer")
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}; {args.seconds:.0f} s per closed-loop run")

    inputs = tensor_inputs()
    models = {"text-encoder": "text-embedding", "intent-classifier": "intent"}
    header = [
        "model (graph)",
        "target",
        "conc.",
        "QPS",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "errors",
        "QPS / ORT",
    ]
    rows: list[list[str]] = []
    peer: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        proc, socket = start_edged(Path(tmp) / "edged")
        try:
            if not args.no_peer:
                peer = start_peers(list(models), Path(tmp))
            for graph, task in models.items():
                feeds = inputs[graph]
                # The session settings edged uses (spinning off), so the rows differ by serving.
                options = ort.SessionOptions()
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                options.add_session_config_entry("session.inter_op.allow_spinning", "0")
                session = ort.InferenceSession(
                    str(MODELS / graph / "1" / "model.onnx"),
                    sess_options=options,
                    providers=["CPUExecutionProvider"],
                )
                targets: dict[str, Callable[[], Call]] = {
                    "ORT in-process": ort_client(session, feeds),
                    "edged REST/UDS": rest_client(str(socket), graph, feeds),
                    "edged gRPC/UDS": grpc_client(
                        f"unix://{socket.with_name('edged-grpc.sock')}", graph, feeds
                    ),
                }
                if peer is not None:
                    targets["MLServer REST/TCP"] = http_client(peer[graph].http_url, graph, feeds)
                    targets["MLServer batching"] = http_client(
                        peer[graph + "+batching"].http_url, graph, feeds
                    )
                for c in args.concurrency:
                    base = None
                    for target, make in targets.items():
                        r = closed_loop(make, c, args.seconds)
                        base = base or r
                        rows.append(row(f"{task} ({graph})", target, c, r, base))
                        print(" | ".join(rows[-1]), flush=True)
            print()
            print(table(rows, header))

            overload(socket, proc.pid, inputs["text-encoder"], args)
            light(socket, args)
        finally:
            proc.terminate()
            proc.wait(60)
            for p in (peer or {}).values():
                p.stop()


def overload(socket: Path, pid: int, feeds: Tensors, args: argparse.Namespace) -> None:
    """Saturation, then 2x that rate open-loop, then normal load again."""
    # Requests carry a 250 ms timeout (an SLO): admission refuses at once what cannot make it.
    request = rest_request("text-encoder", feeds, timeout=250_000)
    saturation = saturate(socket, *request, 64, args.seconds).qps
    rate = 2 * saturation
    rss_before = rss_mib(pid)
    peak = [rss_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak.append(rss_mib(pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    hot = open_loop(socket, *request, rate, args.overload_seconds)
    done.set()
    sampler.join()
    after = open_loop(socket, *request, saturation / 2, args.seconds)
    print(
        f"\n## Overload: text-encoder with a 250 ms timeout; saturation {saturation:.0f} QPS"
        " (closed loop, 64 asyncio clients)"
    )

    def phase(label: str, r: Result, refusals: str) -> list[str]:
        refused = sum(n for s, n in r.statuses.items() if s in (429, 503))
        latency = f"{r.pct(0.5):.1f} / {r.pct(0.99):.1f}"
        return [
            label,
            f"{r.qps:.0f}",
            str(r.statuses.get(200, 0)),
            str(refused),
            str(r.errors - refused),
            latency,
            refusals,
        ]

    hot_label = f"2x saturation ({rate:.0f}/s) for {args.overload_seconds:.0f} s"
    to_refuse = f"{hot.pct(0.5, hot.refusals):.1f} / {hot.pct(0.99, hot.refusals):.1f}"
    rows = [
        phase(hot_label, hot, to_refuse),
        phase(f"then 0.5x saturation ({saturation / 2:.0f}/s)", after, "-"),
    ]
    header = [
        "phase",
        "answered QPS",
        "200",
        "429/503",
        "504 and other",
        "p50 / p99 ms (200)",
        "p50 / p99 ms to refuse",
    ]
    print(table(rows, header))
    print(f"edged RSS: {rss_before:.0f} MiB before, {max(peak):.0f} MiB peak during overload")


def light(socket: Path, args: argparse.Namespace) -> None:
    """p99 at 100 QPS (open loop) on every light default model, through the task API."""
    sentence = json.dumps({"texts": ["How warm is the GPU on this Jetson right now?"]}).encode()
    tasks = {
        "text-embedding": ("/v1/embed", sentence),
        "text-embedding-int8": (
            "/v1/embed",
            json.dumps(
                {
                    "texts": ["How warm is the GPU on this Jetson right now?"],
                    "model": "text-embedding-int8",
                }
            ).encode(),
        ),
        "intent": ("/v1/intent", sentence),
    }
    rows = []
    for name, (path, body) in tasks.items():
        json_headers = {"Content-Type": "application/json"}
        r = open_loop(socket, path, body, json_headers, 100, args.seconds * 2)
        rows.append(
            [name, f"{r.qps:.0f}", f"{r.pct(0.5):.1f}", f"{r.pct(0.99):.1f}", str(r.errors)]
        )
    print("\n## 100 QPS open loop through the task API (REST/UDS)")
    print(table(rows, ["model", "answered QPS", "p50 ms", "p99 ms", "errors"]))


if __name__ == "__main__":
    main()
