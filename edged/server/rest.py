"""Open Inference Protocol REST (and the task API) over the Unix socket, with aiohttp."""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from edged import logs
from edged.admin import Admin
from edged.common import connections, heap
from edged.config import ServerConfig
from edged.dataplane import default_models
from edged.dataplane.plane import DataPlane
from edged.errors import EdgedError, InvalidRequest, PayloadTooLarge, RequestTimeout, retry_after
from edged.metrics import Metrics
from edged.protocol.shm import Bound
from edged.protocol.tensors import (
    HEADER_LENGTH,
    InferRequest,
    InferResponse,
    RequestedOutput,
    decode_request,
    dump_json,
    encode_response,
    is_count,
    parse_json,
    place,
    response_document,
)
from edged.request import CALLER, Sequences
from edged.server.access import Access, Peer, peer_of
from edged.server.services import Services

log = logging.getLogger(__name__)

PLANE: web.AppKey[DataPlane] = web.AppKey("plane", DataPlane)
SETTINGS: web.AppKey[ServerConfig] = web.AppKey("settings", ServerConfig)
ACCESS: web.AppKey[Access] = web.AppKey("access", Access)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str) -> web.Response:
    """The protocol's error body: {"error": "..."}."""
    return web.json_response({"error": message}, status=status)


def peer_credentials(request: web.Request) -> Peer | None:
    """The process at the other end of the Unix socket (SO_PEERCRED, SO_PEERGROUPS)."""
    transport = request.transport
    return peer_of(transport.get_extra_info("socket") if transport else None)


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
    wanted = request.app[SETTINGS].access_log
    level = logging.INFO if wanted == "all" or (
        wanted == "errors" and response.status >= 400) else logging.DEBUG  # fmt: skip
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
    settings = request.app[SETTINGS]
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


STREAM_CHUNK = 3200  # bytes of a streamed body per request of the sequence: 100 ms at 16 kHz

# Bodies past this are decoded in a thread: a 38 MiB JSON held the event loop for 4.6 s
OFFLOAD_BYTES = 64 * 1024


async def offload(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the loop for a small body, else in a thread (off the event loop)."""
    if size <= OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def place_outputs(
    response: InferResponse, requested: list[RequestedOutput], shm: Bound
) -> dict[str, dict[str, Any]]:
    """``place``: the outputs asked for in shared memory written there, large ones off the
    event loop (as large bodies are read)."""
    size = sum(
        response.outputs[o.name].nbytes
        for o in requested
        if o.shm is not None and o.name in response.outputs
    )
    return dict(await offload(size, place, response, requested, shm))


def check_json_size(size: int | None, settings: ServerConfig) -> None:
    """413 for a JSON document over server.max_json_bytes, before it is read or decoded."""
    if size is not None and size > settings.max_json_bytes:
        raise PayloadTooLarge(
            f"the JSON document is {size} bytes, over the limit of {settings.max_json_bytes}"
            " (server.max_json_bytes): send large tensors as binary data"
        )


async def read_body(request: web.Request) -> bytes:
    """The body, or 408 when it comes slower than server.read_timeout_s."""
    return await connections.read_body(request, request.app[SETTINGS].read_timeout_s)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, or InvalidRequest (413 past server.max_json_bytes)."""
    settings = request.app[SETTINGS]
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


def metrics_handler(metrics: Metrics) -> Handler:
    """GET /metrics: Prometheus' text format."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


def check_admin(request: web.Request) -> None:
    """Admin calls (/v1/admin, repository load and unload) are for admins only
    (``edged.server.access``: root, edged's own uid, server.admin_group and the admin lists)."""
    request.app[ACCESS].check_admin(peer_credentials(request), request.path, "REST")


def admin_routes(admin: Admin) -> list[web.RouteDef]:
    """/v1/admin: the routing policy, reload and drain (edged.admin)."""

    def handler(act: Callable[[web.Request], Awaitable[Any]]) -> Handler:
        async def answer(request: web.Request) -> web.Response:
            check_admin(request)
            return web.json_response(await act(request), dumps=dump_json)

        return answer

    async def body(request: web.Request) -> Any:
        return await read_json(request) if request.can_read_body else None

    async def routing(request: web.Request) -> Any:
        return admin.routing()

    async def patch(request: web.Request) -> Any:
        return admin.patch_routing(await read_json(request))

    async def reset(request: web.Request) -> Any:
        return admin.reset_routing()

    async def reload(request: web.Request) -> Any:
        return await admin.reload()

    async def drain(request: web.Request) -> Any:
        return await admin.drain(await body(request))

    async def resume(request: web.Request) -> Any:
        return admin.resume()

    async def versions(request: web.Request) -> Any:
        return admin.versions(request.match_info["model"])

    async def install(request: web.Request) -> Any:
        # finished even when the caller hangs up: a version half switched helps no one
        doc = await read_json(request)
        return await asyncio.shield(admin.install(request.match_info["model"], doc))

    async def remove(request: web.Request) -> Any:
        return await asyncio.shield(admin.remove(request.match_info["model"]))

    async def activate(request: web.Request) -> Any:
        return await admin.activate(request.match_info["model"], await body(request))

    async def split(request: web.Request) -> Any:
        return admin.set_split(request.match_info["model"], await read_json(request))

    async def scores(request: web.Request) -> Any:
        return admin.score(request.match_info["model"], await read_json(request))

    async def egress(request: web.Request) -> Any:
        return await admin.egress(request.query)

    async def verify_egress(request: web.Request) -> Any:
        unknown = set(request.query) - {"checkpoint"}
        if unknown:
            raise InvalidRequest(f"'{sorted(unknown)[0]}' is not a parameter here: checkpoint")
        return await admin.verify_egress(request.query.getall("checkpoint", []))

    async def rollback(request: web.Request) -> Any:
        return await admin.activate(request.match_info["model"], None)

    return [
        web.get("/v1/admin/routing", handler(routing)),
        web.patch("/v1/admin/routing", handler(patch)),
        web.delete("/v1/admin/routing", handler(reset)),
        web.post("/v1/admin/reload", handler(reload)),
        web.post("/v1/admin/drain", handler(drain)),
        web.post("/v1/admin/resume", handler(resume)),
        web.get("/v1/admin/models/{model}", handler(versions)),
        web.delete("/v1/admin/models/{model}", handler(remove)),
        web.post("/v1/admin/models/{model}/install", handler(install)),
        web.post("/v1/admin/models/{model}/activate", handler(activate)),
        web.post("/v1/admin/models/{model}/rollback", handler(rollback)),
        web.put("/v1/admin/cloud/{model}/ab", handler(split)),
        web.post("/v1/admin/cloud/{model}/ab/scores", handler(scores)),
        web.get("/v1/admin/egress", handler(egress)),
        web.get("/v1/admin/egress/verify", handler(verify_egress)),
    ]


def create_app(
    plane: DataPlane,
    settings: ServerConfig,
    admin: Admin | None = None,
    access: Access | None = None,
    services: Services | None = None,
) -> web.Application:
    """The aiohttp application with every route (/v1/admin with ``admin``, /v1/kb and /v1/tasks
    with ``services``); ``access`` checks the callers (by default over ``settings``)."""
    services = services if services is not None else Services(plane.check_ready)
    app = web.Application(middlewares=[guard], client_max_size=settings.max_request_bytes)
    app[PLANE] = plane
    app[SETTINGS] = settings
    app[ACCESS] = access if access is not None else Access(settings)
    if admin is not None:
        app.add_routes(admin_routes(admin))

    def ok(doc: Any) -> web.Response:
        return web.json_response(doc, dumps=dump_json)  # never NaN: RFC 8259 JSON

    def status_only(good: bool) -> web.Response:
        return web.Response(status=200 if good else 503)

    async def server_metadata(request: web.Request) -> web.Response:
        return ok(plane.server_metadata())

    async def live(request: web.Request) -> web.Response:
        return status_only(True)

    async def ready(request: web.Request) -> web.Response:
        return status_only(plane.ready)

    async def model_metadata(request: web.Request) -> web.Response:
        info = request.match_info
        return ok(plane.model_metadata(info["model"], info.get("version")))

    async def model_ready(request: web.Request) -> web.Response:
        info = request.match_info
        return status_only(plane.ready and plane.model_ready(info["model"], info.get("version")))

    async def shm_register(request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest("body: an object {key, offset, byte_size}")
        plane.shm.register(peer_credentials(request), request.match_info["region"],
                           doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))  # fmt: skip
        return ok({})

    async def shm_unregister(request: web.Request) -> web.Response:
        plane.shm.unregister(peer_credentials(request), request.match_info.get("region"))
        return ok({})

    async def shm_status(request: web.Request) -> web.Response:
        return ok(plane.shm.status(peer_credentials(request), request.match_info.get("region")))

    async def cuda_shm(request: web.Request) -> web.Response:
        raise InvalidRequest("CUDA shared memory: not on this edged (system shared memory is)")

    async def statistics(request: web.Request) -> web.Response:
        info = request.match_info
        return ok(plane.statistics(info.get("model"), info.get("version")))

    async def model_config(request: web.Request) -> web.Response:
        info = request.match_info
        return ok(plane.model_config(info["model"], info.get("version")).as_json())

    async def infer(request: web.Request) -> web.Response:
        info = request.match_info
        header = request.headers.get(HEADER_LENGTH)
        if header is not None and not is_count(header):
            raise InvalidRequest(f"{HEADER_LENGTH} must be a number of bytes, got '{header}'")
        json_size = int(header) if header is not None else request.content_length
        check_json_size(json_size, settings)
        body = await read_body(request)
        check_json_size(len(body) if header is None else None, settings)
        shm = plane.shared_memory(peer_credentials(request), settings.max_request_bytes)
        size = len(body)
        if size <= OFFLOAD_BYTES and b"shared_memory_region" in body:
            size = OFFLOAD_BYTES + 1  # a region's bytes are read off the event loop too
        decoded = await offload(
            size, decode_request, body, int(header) if header is not None else None, shm
        )
        response, binary = await plane.infer(info["model"], info.get("version"), decoded)
        placed = await place_outputs(response, decoded.outputs, shm)
        payload, header_length = encode_response(response, binary, placed)
        if header_length is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(
            body=payload,
            content_type="application/octet-stream",
            headers={HEADER_LENGTH: str(header_length)},
        )

    async def repository_index(request: web.Request) -> web.Response:
        return ok(plane.repository_index())

    async def repository_load(request: web.Request) -> web.Response:
        check_admin(request)
        await plane.load(request.match_info["model"])
        return ok({})

    async def repository_unload(request: web.Request) -> web.Response:
        check_admin(request)
        await plane.unload(request.match_info["model"])
        return ok({})

    async def status(request: web.Request) -> web.Response:
        return ok(plane.status())

    async def events(request: web.Request) -> web.Response:
        check_admin(request)  # the daemon's log lines: what other callers sent shows there
        query = request.query
        return ok(plane.events_after(query.get("after", "0"), query.get("limit", "1000")))

    async def kb_list(request: web.Request) -> web.Response:
        return ok({"namespaces": await services.kb().namespaces()})

    async def kb_ingest(request: web.Request) -> web.Response:
        doc = await read_json(request)
        documents = doc.get("documents") if isinstance(doc, dict) else None
        return ok(await services.kb().ingest(request.match_info["ns"], documents))

    async def kb_search(request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest('the body must be {"query": "...", "k": 5, "filter": ""}')
        k = doc.get("k", 5)
        if isinstance(k, bool) or not isinstance(k, int):
            raise InvalidRequest("'k' must be an integer")
        where = doc.get("filter", "")
        return ok(await services.kb().search(request.match_info["ns"], doc.get("query"), k, where))

    async def kb_ask(request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest('the body must be {"question": "...", "threshold": 0.6}')
        threshold = doc.get("threshold")
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float))
        ):
            raise InvalidRequest("'threshold' must be a number (a cosine score, -1 to 1)")
        params = query_parameters(request)
        # an escalation to the answer model may take seconds: the ask's own default deadline
        params.setdefault("timeout", round(services.kb().ask_settings.timeout_s * 1e6))
        _, route = plane.take_parameters(params)
        reply = await services.kb().ask(
            request.match_info["ns"],
            doc.get("question"),
            threshold,
            doc.get("filter", ""),
            private=route.private,
        )
        if params.get("explain") is True:
            reply["route_trace"] = route.decisions
        return ok(reply)

    async def kb_stats(request: web.Request) -> web.Response:
        return ok(await services.kb().stats(request.match_info["ns"]))

    async def kb_delete(request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest('the body must be {"ids": [...]} or {"source": "..."}')
        return ok(await services.kb().delete(request.match_info["ns"], doc))

    async def capabilities(request: web.Request) -> web.Response:
        return ok(plane.capabilities())

    async def tasks_catalog(request: web.Request) -> web.Response:
        return ok({"templates": services.task_runner().catalog()})

    async def tasks_run(request: web.Request) -> web.StreamResponse:
        logs.set_fields(request_id=logs.short_id())  # one id for every node's log lines
        runner = services.task_runner()
        doc, params = await read_json(request), query_parameters(request)
        streamed = params.pop("stream", False)
        plan = await runner.plan(doc, params)  # a request that does not check out: a plain 400
        if doc.get("run", True) is False:  # the plan only: one answer, streamed or not
            return ok({"planned": runner.explain(plan)})
        if not streamed:
            return ok(await runner.execute(plan, params))
        # JSON lines as the nodes start and finish, then the answer (or the error)
        lines = await Lines.start(request)
        try:
            await lines.emit({"event": "answer", **await runner.execute(plan, params, lines.emit)})
        except Exception as exc:  # the stream has started: no second response can be sent
            await lines.fail(exc, "task stream failed")
        return await lines.end()

    async def stream(request: web.Request) -> web.StreamResponse:
        """A stateful model's sequence over one request: the body is 16 kHz mono 16-bit
        little-endian PCM as it is captured (chunked), each 100 ms of it one request of the
        sequence; each response a JSON line as it comes, then {"event": "end"}."""
        name, params = request.match_info["model"], query_parameters(request)
        config = plane.model_config(name)
        if config.sequence_idle_s is None or [i.datatype for i in config.inputs] != ["INT16"]:
            raise InvalidRequest(
                f"model '{name}' is not a stateful model of one INT16 input: POST"
                " /v2/models/{model}/stream takes those (wake-word, vad-live)"
            )
        idle_s, tensor = config.sequence_idle_s, config.inputs[0].name
        lines = await Lines.start(request)
        sequences, started, pending = Sequences(limit=1), False, b""

        async def partial(response: InferResponse, _binary: dict[str, bool]) -> None:
            await lines.emit(response_document(response)[0])

        async def send(pcm: bytes, end: bool) -> None:
            nonlocal started
            samples = np.frombuffer(pcm, dtype="<i2").astype(np.int16)
            flags = {"sequence_id": 1, "sequence_start": not started, "sequence_end": end}
            call = InferRequest(inputs={tensor: samples}, parameters={**params, **flags})
            started = True
            await plane.infer(name, None, call, send=partial, sequences=sequences)

        try:
            while True:
                try:
                    data = await asyncio.wait_for(request.content.read(STREAM_CHUNK), idle_s)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"no audio for {idle_s:g} s: the sequence ends") from None
                if not data:
                    break
                pending += data
                if len(pending) >= STREAM_CHUNK:
                    whole = len(pending) - len(pending) % 2
                    await send(pending[:whole], False)
                    pending = pending[whole:]
            await send(pending[: len(pending) - len(pending) % 2], True)
            await lines.emit({"event": "end"})
        except Exception as exc:
            await lines.fail(exc, "stream failed")
        return await lines.end()

    async def embed(request: web.Request) -> web.Response:
        return ok(
            await default_models.embed(plane, await read_json(request), query_parameters(request))
        )

    async def intent(request: web.Request) -> web.Response:
        return ok(
            await default_models.intent(plane, await read_json(request), query_parameters(request))
        )

    async def ocr(request: web.Request) -> web.Response:
        return ok(
            await default_models.ocr(plane, await read_body(request), query_parameters(request))
        )

    async def vad(request: web.Request) -> web.Response:
        return ok(
            await default_models.vad(plane, await read_body(request), query_parameters(request))
        )

    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    app.add_routes(
        [
            web.get("/v2", server_metadata),
            web.get("/v2/health/live", live),
            web.get("/v2/health/ready", ready),
            web.get("/v2/models/stats", statistics),  # before /v2/models/{model}
            web.get("/v2/systemsharedmemory/status", shm_status),
            web.get("/v2/systemsharedmemory/region/{region}/status", shm_status),
            web.post("/v2/systemsharedmemory/region/{region}/register", shm_register),
            web.post("/v2/systemsharedmemory/region/{region}/unregister", shm_unregister),
            web.post("/v2/systemsharedmemory/unregister", shm_unregister),
            web.route("*", "/v2/cudasharedmemory{rest:.*}", cuda_shm),
            web.get(model + "/stats", statistics),
            web.get(versioned + "/stats", statistics),
            web.get(model, model_metadata),
            web.get(versioned, model_metadata),
            web.get(model + "/ready", model_ready),
            web.get(versioned + "/ready", model_ready),
            web.get(model + "/config", model_config),
            web.get(versioned + "/config", model_config),
            web.post(model + "/infer", infer),
            web.post(model + "/stream", stream),
            web.post(versioned + "/infer", infer),
            web.post("/v2/repository/index", repository_index),
            web.post("/v2/repository/models/{model}/load", repository_load),
            web.post("/v2/repository/models/{model}/unload", repository_unload),
            web.get("/v1/status", status),
            web.get("/v1/events", events),
            web.get("/v1/capabilities", capabilities),
            web.get("/v1/tasks", tasks_catalog),
            web.post("/v1/tasks", tasks_run),
            web.get("/v1/kb", kb_list),
            web.post("/v1/kb/{ns}/ingest", kb_ingest),
            web.post("/v1/kb/{ns}/search", kb_search),
            web.post("/v1/kb/{ns}/ask", kb_ask),
            web.get("/v1/kb/{ns}/stats", kb_stats),
            web.post("/v1/kb/{ns}/delete", kb_delete),
            web.get("/metrics", metrics_handler(plane.manager.metrics)),
            web.post("/v1/embed", embed),
            web.post("/v1/intent", intent),
            web.post("/v1/ocr", ocr),
            web.post("/v1/vad", vad),
        ]
    )
    return app
