"""Connections of the REST socket: a cap on how many are open, and an end to the ones that hold
a slot without asking anything.

aiohttp keeps a connection open for as long as its request headers are still coming (its
keep-alive timer stops at the first byte), and it has no limit on connections: 1,100 half-sent
requests were held open, past systemd's default of 1,024 descriptors. Here a connection over
``max_connections`` is answered 503 and closed at once, without reading it, and a sweep closes
every connection that has not been handling a request for ``idle_timeout_s`` (half-sent
headers, a client that connected and went quiet, an idle keep-alive). A request being handled
is never cut by the sweep: its body has its own timeout where it is read (``read_body``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any, cast

from aiohttp import web

from edged.common.errors import RequestTimeout

log = logging.getLogger(__name__)

BACKLOG = 1024  # the listening socket's queue (the kernel's somaxconn caps it)
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"


class _Refused(asyncio.Protocol):
    """A connection over the cap: told so in one write, then closed."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        head = BUSY + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(self.body)
        writer = cast(asyncio.Transport, transport)  # uvloop's is none of asyncio's classes
        writer.write(head + self.body)
        writer.close()


class CappedSite(web.SockSite):
    """A SockSite that refuses connections over ``limit`` instead of holding them (edged's
    REST socket, and the fleet service's API: ``who`` and its ``setting`` name them in the
    answer; with ``ssl_context``, a TLS handshake not done in ``handshake_timeout_s`` is
    closed)."""

    def __init__(
        self,
        runner: web.AppRunner,
        sock: Any,
        limit: int,
        *,
        who: str = "edged",
        setting: str = "server.max_connections",
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context)
        self.limit, self.who, self.setting = limit, who, setting
        self.handshake_timeout_s = handshake_timeout_s
        self.busy = b'{"error": "%s has %d connections open, its limit (%s)"}' % (
            who.encode(),
            limit,
            setting.encode(),
        )
        self.refused = 0
        # accepted, not yet connected (aiohttp lists a connection from its connection_made: a
        # step of the loop later, or after the TLS handshake): id -> (protocol, when)
        self.pending: dict[int, tuple[asyncio.Protocol, float]] = {}

    def _factory(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        live = {id(handler) for handler in server.connections}
        now = time.monotonic()
        # those connected since, connected and closed already (aiohttp's handler lets go of
        # its server then), or never (a handshake that failed) leave the count
        gone = max(10.0, self.handshake_timeout_s)
        self.pending = {
            key: (proto, since)
            for key, (proto, since) in self.pending.items()
            if key not in live
            and now - since < gone
            and getattr(proto, "_manager", None) is not None
        }
        if len(live) + len(self.pending) >= self.limit:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning(
                    "%s: %d connections open, refused one (%d so far; %s)",
                    self.who,
                    len(live) + len(self.pending),
                    self.refused,
                    self.setting,
                )
            return _Refused(self.busy)
        handler = server()
        self.pending[id(handler)] = (handler, now)
        return handler

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        if self._ssl_context is None:
            self._server = await loop.create_server(self._factory, sock=self._sock)
        else:
            self._server = await loop.create_server(
                self._factory,
                sock=self._sock,
                ssl=self._ssl_context,
                ssl_handshake_timeout=self.handshake_timeout_s,
            )
        # A burst of connections waits in the kernel's queue: asyncio's backlog (100) dropped
        # the rest's handshakes, which their clients take as made, so they came (and were
        # counted) seconds late. Not asyncio's own backlog argument: it also accepts that
        # many in one step of the loop, a descriptor each before any is refused and closed.
        self._sock.listen(BACKLOG)


async def sweep_idle(runner: web.AppRunner, idle_timeout_s: float) -> None:
    """Close the connections that have not handled a request for ``idle_timeout_s`` (runs
    until cancelled; looks every quarter of that, at most every second)."""
    last_busy: dict[int, float] = {}
    while True:
        await asyncio.sleep(min(1.0, idle_timeout_s / 4))
        try:
            last_busy = _sweep(runner, idle_timeout_s, last_busy)
        except Exception:  # a sweep that fails is logged; the next one runs all the same
            log.exception("sweeping idle connections failed")


def _sweep(
    runner: web.AppRunner, idle_timeout_s: float, last_busy: dict[int, float]
) -> dict[int, float]:
    """One look: close the idle connections; the next look's ``last_busy``."""
    server = runner.server
    if server is None:
        return last_busy
    now = time.monotonic()
    seen = {}
    for handler in list(server.connections):
        key = id(handler)
        # aiohttp's own flag; an aiohttp without it is never swept (busy, by default)
        if getattr(handler, "_request_in_progress", True):
            seen[key] = now
            continue
        seen[key] = since = last_busy.get(key, now)
        if now - since > idle_timeout_s:
            handler.force_close()
            seen.pop(key)
    return seen


READ_CHUNK = 1 << 20  # the event loop gets a turn after each MiB of a body


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, or 408 when it does not arrive within ``timeout_s``. Read a MiB at
    a time, yielding between: aiohttp's own read() gathered a 38 MiB body in one step of the
    loop (120 ms) through a growing buffer."""
    try:
        return await asyncio.wait_for(_read(request), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s (server.read_timeout_s)"
        ) from None


async def _read(request: web.Request) -> bytes:
    length = request.content_length
    if length is None or length <= READ_CHUNK:  # small, or chunked: aiohttp's way
        return await request.read()
    chunks = []
    while chunk := await request.content.read(READ_CHUNK):
        chunks.append(chunk)
        await asyncio.sleep(0)
    return b"".join(chunks)  # one copy, no zeroed buffer first (38 MiB: ~18 ms here)


class QuietLog:
    """aiohttp's server logger, for what callers send: a malformed request logs one short
    WARNING (at most one per ``every_s``, with how many were not logged), and its traceback
    only at DEBUG. aiohttp logs each at ERROR with a traceback: anyone on the socket could
    fill the journal. Edged's own failures are logged by its handlers, not here."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self.last = -every_s
        self.quiet = 0

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        self.logger.debug(msg, *args, exc_info=exc_info)
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.quiet += 1
            return
        error = exc_info if isinstance(exc_info, BaseException) else None
        what = f"{type(error).__name__}: {str(error)[:200]}" if error else "no detail"
        more = f" ({self.quiet} more since the last one)" if self.quiet else ""
        self.logger.warning("%s: %s%s", msg % args, what, more)
        self.last, self.quiet = now, 0

    def __getattr__(self, name: str) -> Any:  # debug, warning, isEnabledFor...
        return getattr(self.logger, name)
