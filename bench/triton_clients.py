#!/usr/bin/env python3
"""One client library for every row: tritonclient against edged's gRPC and REST sockets and
MLServer's gRPC and REST ports, on the same ONNX graphs, in ONE run.

What a Triton user measures: ``tritonclient.grpc`` on edged's gRPC socket (it takes
``unix://``), ``tritonclient.http`` on edged's REST socket through a loopback relay (its HTTP
client takes only TCP: socat when installed, as docs/API.md shows, else a Python relay in this
process), and the same two clients on MLServer's ports (its own venv, bench/peer.py; without and
with its adaptive batching, since edged batches) and on Triton Inference Server's
(bench/triton_peer.py: 2.51.0, the python backend running ONNX Runtime, behind Triton's dynamic
batcher). Binary tensors on REST where the server has the extension (edged, Triton), JSON
otherwise (MLServer). One client per thread, closed loop; QPS, p50/p95/p99 in ms, the server's CPU
per call (from /proc), and QPS against MLServer gRPC (no batching) and against Triton over the
same protocol, in the same run.

Then the floors of the two protocol stacks on this machine: a bare ``grpc.aio`` servicer and a
bare aiohttp handler on Unix sockets (on uvloop, as edged), each answering a fixed response with
no model, called by the same clients as edged (tritonclient.grpc, and the load benchmark's
http.client), with the server's CPU time per call read from /proc: what no code of edged's can
go below.

    .venv/bin/python bench/triton_clients.py [--seconds 4] [--concurrency 1 8 32] [--no-peer]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket as socketlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import (  # noqa: E402
    MODELS,
    Call,
    Result,
    _datatype,
    closed_loop,
    grpc_client,
    rest_client,
    start_edged,
    start_peers,
    table,
    tensor_inputs,
)
from bench.serving import process_tree  # noqa: E402
from bench.triton_peer import ensure_triton, metadata, start_triton  # noqa: E402

Tensors = dict[str, np.ndarray]


def http_client(url: str, model: str, inputs: Tensors, binary: bool) -> Callable[[], Call]:
    """tritonclient.http, one client (one connection) per thread: made in the thread that calls
    it (geventhttpclient's connections belong to the thread that made them)."""
    import tritonclient.http as httpclient

    tensors = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array, binary_data=binary)
        tensors.append(tensor)

    def make() -> Call:
        mine = threading.local()

        def call() -> int:
            if not hasattr(mine, "client"):
                mine.client = httpclient.InferenceServerClient(
                    url, concurrency=1, connection_timeout=60, network_timeout=60
                )
            mine.client.infer(model, tensors)
            return 200

        return call

    return make


@contextlib.contextmanager
def relay(target: Path) -> Iterator[tuple[str, str]]:
    """A loopback TCP port that reaches the Unix socket ``target``: (host:port, what relays)."""
    socat = shutil.which("socat")
    if socat is None:
        from tests.relay import tcp_relay

        with tcp_relay(target) as address:
            yield address, "a Python relay in the client process"
        return
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [socat, f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr", f"UNIX-CONNECT:{target}"]
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socketlib.create_connection(("127.0.0.1", port)):
                break
            time.sleep(0.05)
        yield f"127.0.0.1:{port}", "socat"
    finally:
        proc.terminate()
        proc.wait(10)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process and its descendants (Triton's python-backend
    stubs are processes of their own), from /proc."""
    total = 0
    for current in process_tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def run(make: Callable[[], Call], c: int, seconds: float, pid: int) -> tuple[Result, float]:
    """A closed-loop run, and the server's CPU microseconds per answered call."""
    before = cpu_seconds(pid)
    result = closed_loop(make, c, seconds)
    spent = cpu_seconds(pid) - before
    return result, 1e6 * spent / max(1, len(result.latencies))


# ---- the floors: bare servers answering a fixed response ---------------------------------------

BARE = r"""
import asyncio, sys
import numpy as np
kind, path = sys.argv[1], sys.argv[2]
answer = np.zeros((1, 20), np.float32)

async def main():
    if kind == "grpc":
        import grpc
        from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc

        class Servicer(pb_grpc.GRPCInferenceServiceServicer):
            async def ModelInfer(self, request, context):
                reply = pb.ModelInferResponse(model_name=request.model_name, model_version="1")
                reply.outputs.add(name="probabilities", datatype="FP32", shape=[1, 20])
                reply.raw_output_contents.append(answer.tobytes())
                return reply

        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        await server.wait_for_termination()
    else:
        import json
        from aiohttp import web

        body = answer.tobytes()
        header = json.dumps({"model_name": "m", "model_version": "1", "outputs": [
            {"name": "probabilities", "datatype": "FP32", "shape": [1, 20],
             "parameters": {"binary_data_size": len(body)}}]}).encode()

        async def infer(request):
            await request.read()
            return web.Response(body=header + body, headers={
                "Inference-Header-Content-Length": str(len(header)),
                "Content-Type": "application/octet-stream"})

        app = web.Application()
        app.router.add_post("/v2/models/{name}/infer", infer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        await asyncio.Event().wait()

try:  # the event loop edged serves on (server.event_loop)
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


@contextlib.contextmanager
def bare_server(kind: str, workdir: Path) -> Iterator[tuple[Path, int]]:
    """A bare ``grpc`` or ``rest`` server on a Unix socket: (its path, its pid)."""
    path = workdir / f"bare-{kind}.sock"
    proc = subprocess.Popen([sys.executable, "-c", BARE, kind, str(path)])
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the bare {kind} server did not start")
            time.sleep(0.05)
        time.sleep(0.3)
        yield path, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--no-peer", action="store_true", help="skip MLServer and Triton")
    args = parser.parse_args()
    inputs = tensor_inputs()
    graphs = {"intent-classifier": "intent head", "text-encoder": "text encoder"}
    header = [
        "model",
        "target",
        "client",
        "conc.",
        "QPS",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "errors",
        "server CPU µs/call",
        "QPS / MLServer gRPC",
        "QPS / Triton, same protocol",
    ]
    rows: list[list[str]] = []
    peers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc, sock = start_edged(work / "edged")
        try:
            if not args.no_peer:
                peers = start_peers(list(graphs), work)
                models = {graph: MODELS / graph for graph in graphs}
                peers["triton"] = start_triton(ensure_triton(), models, work / "triton")
                print(f"Triton {metadata(peers['triton'])['version']} (python backend, ORT)")
            with relay(sock) as (address, relayed_by):
                print(f"tritonclient.http reaches edged's socket through {relayed_by}")
                for graph, label in graphs.items():
                    feeds = inputs[graph]
                    targets: dict[str, tuple[str, Callable[[], Call], int]] = {
                        "edged gRPC/UDS": (
                            "tritonclient.grpc",
                            grpc_client(
                                f"unix://{sock.with_name('edged-grpc.sock')}", graph, feeds
                            ),
                            proc.pid,
                        ),
                        "edged REST/UDS": (
                            "tritonclient.http",
                            http_client(address, graph, feeds, binary=True),
                            proc.pid,
                        ),
                    }
                    for suffix, name in (("", "MLServer"), ("+batching", "MLServer batching")):
                        peer = peers.get(graph + suffix)
                        if peer is None:
                            continue
                        targets[f"{name} gRPC/TCP"] = (
                            "tritonclient.grpc",
                            grpc_client(peer.grpc_url, graph, feeds),
                            peer.proc.pid,
                        )
                        targets[f"{name} REST/TCP"] = (
                            "tritonclient.http",
                            http_client(
                                peer.http_url.removeprefix("http://"), graph, feeds, binary=False
                            ),
                            peer.proc.pid,
                        )
                    triton = peers.get("triton")
                    if triton is not None:
                        targets["Triton gRPC/TCP"] = (
                            "tritonclient.grpc",
                            grpc_client(triton.grpc_url, graph, feeds),
                            triton.proc.pid,
                        )
                        targets["Triton REST/TCP"] = (
                            "tritonclient.http",
                            http_client(
                                triton.http_url.removeprefix("http://"), graph, feeds, binary=True
                            ),
                            triton.proc.pid,
                        )
                    for c in args.concurrency:
                        measured = {}
                        for target, (client, make, pid) in targets.items():
                            measured[target] = (client, *run(make, c, args.seconds, pid))
                        base = measured.get("MLServer gRPC/TCP")
                        for target, (client, r, cpu) in measured.items():
                            ratio = f"{r.qps / base[1].qps:.2f}x" if base and base[1].qps else "-"
                            protocol = target.split()[-1].split("/")[0]  # gRPC or REST
                            same = measured.get(f"Triton {protocol}/TCP")
                            versus = f"{r.qps / same[1].qps:.2f}x" if same and same[1].qps else "-"
                            rows.append(
                                [
                                    label,
                                    target,
                                    client,
                                    str(c),
                                    f"{r.qps:,.0f}",
                                    f"{r.pct(0.5):.2f}",
                                    f"{r.pct(0.95):.2f}",
                                    f"{r.pct(0.99):.2f}",
                                    str(r.errors),
                                    f"{cpu:.0f}",
                                    ratio,
                                    versus,
                                ]
                            )
                            print(" | ".join(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
            for p in peers.values():
                p.stop()
        print()
        print(table(rows, header))

        floor_rows: list[list[str]] = []
        feeds = inputs["intent-classifier"]
        for kind, client in (("grpc", "tritonclient.grpc"), ("rest", "http.client")):
            with bare_server(kind, work) as (path, pid):
                make = (
                    grpc_client(f"unix://{path}", "m", feeds)
                    if kind == "grpc"
                    else rest_client(str(path), "m", feeds)
                )
                for c in args.concurrency:
                    r, cpu = run(make, c, args.seconds, pid)
                    stack = "grpc.aio" if kind == "grpc" else "aiohttp"
                    floor_rows.append(
                        [
                            f"bare {stack} (fixed answer)",
                            client,
                            str(c),
                            f"{r.qps:,.0f}",
                            f"{r.pct(0.5):.2f}",
                            f"{cpu:.0f}",
                        ]
                    )
                    print(" | ".join(floor_rows[-1]), flush=True)
        print()
        print(
            table(floor_rows, ["server", "client", "conc.", "QPS", "p50 ms", "server CPU µs/call"])
        )


if __name__ == "__main__":
    main()
