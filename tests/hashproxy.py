"""Reverse proxies on loopback (HTTP, and gRPC below) that write down what each request
carried, as the cloud received it: its method, path, length and the SHA-256 of its body bytes
(and the OIP request id, read from the JSON header of an inference body), then forward it to
the real server and hand back its answer. The egress tests compare the ledger's hashes with
these. Started and stopped by the test (its thread, its port)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from typing import Any

import aiohttp
from aiohttp import web

KEPT_HEADERS = ("Content-Type", "Inference-Header-Content-Length", "Content-Encoding")


class HashProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, name="hashproxy", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> HashProxy:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the hashing proxy did not start")
        return self

    def posts(self) -> list[dict[str, Any]]:
        """Every POST so far, in the order they came."""
        with self.lock:
            return [s for s in self.seen if s["method"] == "POST"]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        session: aiohttp.ClientSession | None = None

        async def forward(request: web.Request) -> web.StreamResponse:
            nonlocal session
            body = await request.read()
            row: dict[str, Any] = {"method": request.method, "path": request.path,
                                   "bytes": len(body),
                                   "sha256": hashlib.sha256(body).hexdigest()}  # fmt: skip
            if request.method == "POST":
                size = int(request.headers.get("Inference-Header-Content-Length", len(body)))
                try:
                    row["id"] = json.loads(body[:size]).get("id")
                except ValueError:
                    row["id"] = None
            with self.lock:
                self.seen.append(row)
            if session is None:
                session = aiohttp.ClientSession()
            headers = {k: v for k, v in request.headers.items() if k in KEPT_HEADERS}
            async with session.request(request.method, self.upstream + request.path_qs,
                                       data=body, headers=headers) as reply:  # fmt: skip
                data = await reply.read()
                out = {k: v for k, v in reply.headers.items() if k in KEPT_HEADERS}
                return web.Response(status=reply.status, body=data, headers=out)

        async def serve() -> web.AppRunner:
            app = web.Application(client_max_size=256 << 20)
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return runner

        runner = self.loop.run_until_complete(serve())
        self.ready.set()
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(runner.cleanup())
            if session is not None:
                self.loop.run_until_complete(session.close())
            self.loop.close()


class GrpcHashProxy:
    """The same for gRPC: a server that takes any method's request as raw bytes (no
    deserializer), writes down the method, the length and the SHA-256 of the message as the
    frame carried it, and forwards the same bytes to the real server."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, name="grpc-hashproxy", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> GrpcHashProxy:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the gRPC hashing proxy did not start")
        return self

    def calls(self, method: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.seen if s["method"].endswith(method)]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self) -> None:
        import grpc

        asyncio.set_event_loop(self.loop)
        proxy = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                method = details.method

                async def unary(request: bytes, context: Any) -> bytes:
                    digest = hashlib.sha256(request).hexdigest()
                    with proxy.lock:
                        proxy.seen.append({"method": method, "bytes": len(request),
                                           "sha256": digest})  # fmt: skip
                    call = channel.unary_unary(method)  # raw bytes both ways
                    metadata = [(k, v) for k, v in context.invocation_metadata()
                                if not k.startswith(":")]  # fmt: skip
                    return await call(request, metadata=metadata)

                return grpc.unary_unary_rpc_method_handler(unary)

        async def serve() -> Any:
            server = grpc.aio.server(handlers=[Forward()])
            self.port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server

        channel = grpc.aio.insecure_channel(self.upstream)
        server = self.loop.run_until_complete(serve())
        self.ready.set()
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(server.stop(None))
            self.loop.run_until_complete(channel.close())
            self.loop.close()
