"""What every REST endpoint reads and answers with: the application's keys (the data plane,
the settings, the access rules), bodies read within their limits and time, JSON decoded off
the event loop when large, query parameters as request parameters, answers of JSON lines."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from edged.common import connections
from edged.common.errors import EdgedError, InvalidRequest, PayloadTooLarge
from edged.common.live import Live
from edged.config import ServerConfig
from edged.dataplane.plane import DataPlane
from edged.oip.tensors import dump_json, parse_json
from edged.server.access import Access, Peer, peer_of
from edged.server.offload import offload

log = logging.getLogger("edged.server.rest")  # the access log's name, as before the split

PLANE: web.AppKey[DataPlane] = web.AppKey("plane", DataPlane)
SETTINGS: web.AppKey[Live[ServerConfig]] = web.AppKey("settings", Live)  # swapped on reload
ACCESS: web.AppKey[Access] = web.AppKey("access", Access)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def settings_of(request: web.Request) -> ServerConfig:
    """The server settings as they are now (a reload swaps them)."""
    return request.app[SETTINGS].now()


def ok(doc: Any) -> web.Response:
    return web.json_response(doc, dumps=dump_json)  # never NaN: RFC 8259 JSON


def status_only(good: bool) -> web.Response:
    return web.Response(status=200 if good else 503)


def error_response(status: int, message: str) -> web.Response:
    """The protocol's error body: {"error": "..."}."""
    return web.json_response({"error": message}, status=status)


# each connection's caller: the kernel fixed it at connect() (SO_PEERCRED and SO_PEERGROUPS
# give the credentials of that moment), so it is read once per connection, not per request
_PEERS: weakref.WeakKeyDictionary[asyncio.BaseTransport, Peer] = weakref.WeakKeyDictionary()


def peer_credentials(request: web.Request) -> Peer | None:
    """The process at the other end of the Unix socket (SO_PEERCRED, SO_PEERGROUPS)."""
    transport = request.transport
    if transport is None:
        return None
    peer = _PEERS.get(transport)
    if peer is None:
        peer = peer_of(transport.get_extra_info("socket"))
        if peer is not None:
            _PEERS[transport] = peer
    return peer


def check_admin(request: web.Request) -> None:
    """Admin calls (/v1/admin, repository load and unload) are for admins only
    (``edged.server.access``: root, edged's own uid, server.admin_group and the admin lists)."""
    request.app[ACCESS].check_admin(peer_credentials(request), request.path, "REST")


class Lines:
    """An answer of JSON lines (``application/x-ndjson``) written as they come; a caller that
    leaves stops the writing, not the handler (which is cancelled soon)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.lock = asyncio.Lock()
        self.gone = False

    @classmethod
    async def start(cls, request: web.Request) -> Lines:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        return cls(response)

    async def emit(self, event: dict[str, Any]) -> None:
        async with self.lock:
            if self.gone:
                return
            try:
                await self.response.write(dump_json(event).encode() + b"\n")
            except ConnectionError:
                self.gone = True

    async def fail(self, exc: Exception, what: str) -> None:
        """The error as the last line: its status and message (a bug: 500, logged)."""
        if isinstance(exc, EdgedError):
            await self.emit({"event": "error", "status": exc.status, "error": exc.message})
            return
        if isinstance(exc, ConnectionResetError):  # the caller closed mid-body: no one to tell
            log.info("%s: the caller went away mid-request", what)
            self.gone = True
            return
        log.exception(what)
        await self.emit({"event": "error", "status": 500, "error": f"{type(exc).__name__}: {exc}"})

    async def end(self) -> web.StreamResponse:
        if not self.gone:
            await self.response.write_eof()
        return self.response


def check_json_size(size: int | None, settings: ServerConfig) -> None:
    """413 for a JSON document over server.max_json_bytes, before it is read or decoded."""
    if size is not None and size > settings.max_json_bytes:
        raise PayloadTooLarge(
            f"the JSON document is {size} bytes, over the limit of {settings.max_json_bytes}"
            " (server.max_json_bytes): send large tensors as binary data"
        )


async def read_body(request: web.Request) -> bytes:
    """The body, or 408 when it comes slower than server.read_timeout_s."""
    return await connections.read_body(request, settings_of(request).read_timeout_s)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, or InvalidRequest (413 past server.max_json_bytes)."""
    settings = settings_of(request)
    check_json_size(request.content_length, settings)
    body = await read_body(request)
    check_json_size(len(body), settings)
    return await offload(len(body), parse_json, body)


def query_parameters(request: web.Request) -> dict[str, Any]:
    """Query parameters as request parameters: ``route`` as text, ``private``, ``explain`` and
    ``stream`` as true/false, the others as numbers (?threshold=0.6)."""
    params: dict[str, Any] = {}
    for key, value in request.query.items():
        if key == "route":
            params[key] = value
            continue
        if key in ("private", "explain", "stream"):
            if value not in ("true", "false", "1", "0"):
                raise InvalidRequest(f"query parameter '{key}' must be true or false")
            params[key] = value in ("true", "1")
            continue
        try:
            params[key] = float(value)
        except ValueError:
            raise InvalidRequest(f"query parameter '{key}' must be a number") from None
    return params
