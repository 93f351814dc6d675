"""The REST adapter's middleware: every request's caller checked, its body limit, the data
plane's in-flight count, errors mapped to statuses, the access log (4xx at a bounded rate), and
the heap trimmed after the last large request of a burst."""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

from aiohttp import web

from edged.common import heap, logs
from edged.common.errors import EdgedError, PayloadTooLarge, retry_after
from edged.request import CALLER
from edged.server.rest.io import (
    ACCESS,
    PLANE,
    Handler,
    error_response,
    peer_credentials,
    settings_of,
)

log = logging.getLogger("edged.server.rest")  # the access log's name, as before the split


class Refusals:
    """How many answers of 4xx the access log writes at info: a burst of ``burst``, then
    ``per_s`` a second (a token bucket); the others at debug, counted, and said with the next
    one written. A caller's garbage is the caller's (one fuzz run wrote 41,802 lines); edged's
    own failures, 5xx, are always written."""

    def __init__(self, per_s: float = 5.0, burst: float = 20.0) -> None:
        self.per_s, self.burst = per_s, burst
        self.tokens, self.at, self.quiet = burst, time.monotonic(), 0

    def take(self) -> int | None:
        """None: not this one (counted); else how many were not written before it."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1:
            self.quiet += 1
            return None
        self.tokens -= 1
        quiet, self.quiet = self.quiet, 0
        return quiet


REFUSALS = Refusals()


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request: checked and answered by ``_checked``, logged at debug level (at info:
    every one with ``access_log = "all"``; with "errors", 5xx and, up to a rate, 4xx)."""
    started = time.perf_counter()
    response = await _checked(request, handler)
    if (request.content_length or 0) >= heap.LARGE_BYTES and request.app[PLANE].inflight == 0:
        # the last large request of a burst has gone: the heap's free pages go back now
        await asyncio.get_running_loop().run_in_executor(None, heap.trim_heap)
    wanted = settings_of(request).access_log
    level = (
        logging.INFO
        if wanted == "all" or (wanted == "errors" and response.status >= 400)
        else logging.DEBUG
    )
    more = ""
    if level == logging.INFO and wanted == "errors" and response.status < 500:
        quiet = REFUSALS.take()
        if quiet is None:
            level = logging.DEBUG
        elif quiet:
            more = f" ({quiet} more 4xx not written at info since the last)"
    if log.isEnabledFor(level):  # the request's log fields (id, model, route) are still set
        creds = peer_credentials(request)
        route = logs.bound().get("route")
        log.log(
            level,
            "%s %s -> %d in %.1f ms%s (pid/uid/gid %s)%s",
            request.method,
            request.path,
            response.status,
            (time.perf_counter() - started) * 1000,
            f", {route}" if route else "",
            f"{creds.pid}/{creds.uid}/{creds.gid}" if creds else "?",
            more,
        )
    return response


async def _checked(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Caller identity, body limit, in-flight count and error mapping."""
    settings = settings_of(request)
    plane = request.app[PLANE]
    caller = peer_credentials(request)
    CALLER.set(caller.uid if caller is not None else None)  # this request's task only
    try:
        if settings.allowed_uids or settings.allowed_gids:
            request.app[ACCESS].check_allowed(caller, "REST")
        length = request.content_length
        if length is not None and length > settings.max_request_bytes:
            raise PayloadTooLarge(
                f"request body of {length} bytes is over the limit of"
                f" {settings.max_request_bytes} bytes (server.max_request_bytes)"
            )
        plane.begin()
        try:
            return await handler(request)
        finally:
            plane.end()
    except EdgedError as exc:
        # the traceback's frames hold the request's data (a 38 MiB body): let it go now, not
        # at the garbage collector's next pass over a cycle
        traceback.clear_frames(exc.__traceback__)
        if exc.status >= 500 and exc.status not in (503, 504):
            log.warning("%s %s: %s", request.method, request.path, exc.message)
        response = error_response(exc.status, exc.message)
        seconds = retry_after(exc)
        if seconds is not None:
            response.headers["Retry-After"] = str(seconds)
        return response
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            413, f"request body is over the limit of {settings.max_request_bytes} bytes"
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)
    except ConnectionResetError:  # the caller closed mid-body: no one is left to answer
        log.info("%s %s: the caller went away mid-request", request.method, request.path)
        return error_response(400, "the connection was lost mid-request")
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal error; the daemon's log has the details")
