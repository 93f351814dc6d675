"""An HTTP reverse proxy on loopback that writes down what each request carried, as the cloud
received it: its method, path, length and the SHA-256 of its body bytes (and the OIP request
id, read from the JSON header of an inference body), then forwards it to the real server and
hands back its answer. The egress tests compare the ledger's hashes with these. Started and
stopped by the test (its thread, its port)."""

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
