"""Reverse proxies on loopback (HTTP, and gRPC below) that write down what each request
carried, as the cloud received it: its method, path, length and the SHA-256 of its body bytes
(and the OIP request id, read from the JSON header of an inference body), then forward it to
the real server and hand back its answer. The egress tests compare the ledger's hashes with
these. Started and stopped by the test (its thread, its port)."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import aiohttp
import grpc
from aiohttp import web

from tests.conftest import LoopThread

# forwarded both ways; the bodies pass as they are (no decompression: Triton gzips its answers
# when the request accepts gzip, and the Content-Encoding must go with the bytes it describes)
KEPT_HEADERS = (
    "Content-Type",
    "Inference-Header-Content-Length",
    "Content-Encoding",
    "Accept-Encoding",
)


class Recording(LoopThread):
    """What the proxies share: the upstream, the rows seen, their port."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def note(self, row: dict[str, Any], body: bytes) -> None:
        row.update(bytes=len(body), sha256=hashlib.sha256(body).hexdigest())
        with self.lock:
            self.seen.append(row)


class HashProxy(Recording):
    """HTTP: every request forwarded to ``upstream`` (``http://host:port``)."""

    def posts(self) -> list[dict[str, Any]]:
        """Every POST so far, in the order they came."""
        with self.lock:
            return [s for s in self.seen if s["method"] == "POST"]

    async def _serve(self) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _close(self) -> None:
        await self.runner.cleanup()
        await self.session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        row: dict[str, Any] = {"method": request.method, "path": request.path}
        if request.method == "POST":
            size = int(request.headers.get("Inference-Header-Content-Length", len(body)))
            try:
                row["id"] = json.loads(body[:size]).get("id")
            except ValueError:
                row["id"] = None
        self.note(row, body)
        headers = {k: v for k, v in request.headers.items() if k in KEPT_HEADERS}
        async with self.session.request(
            request.method, self.upstream.rstrip("/") + request.path_qs, data=body, headers=headers
        ) as reply:
            data = await reply.read()
            out = {k: v for k, v in reply.headers.items() if k in KEPT_HEADERS}
            return web.Response(status=reply.status, body=data, headers=out)


class GrpcHashProxy(Recording):
    """gRPC: a server that takes any method's request as raw bytes (no deserializer), so the
    hash is of the message as the frame carried it, and forwards the same bytes to
    ``upstream`` (``host:port``)."""

    def calls(self, method: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.seen if s["method"].endswith(method)]

    async def _serve(self) -> None:
        proxy = self
        self.channel = grpc.aio.insecure_channel(self.upstream)

        class Forward(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                method = details.method

                async def unary(request: bytes, context: Any) -> bytes:
                    proxy.note({"method": method}, request)
                    metadata = [
                        (k, v) for k, v in context.invocation_metadata() if not k.startswith(":")
                    ]
                    call = proxy.channel.unary_unary(method)  # raw bytes both ways
                    return await call(request, metadata=metadata)

                return grpc.unary_unary_rpc_method_handler(unary)

        self.server = grpc.aio.server(handlers=[Forward()])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def _close(self) -> None:
        await self.server.stop(None)
        await self.channel.close()
