"""The REST adapter's endpoints, one small method per route, grouped by resource: each reads
the request (``rest.io``), calls the data plane or a service, and answers. The route table is
``rest.routes``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from edged.admin import Admin
from edged.common import logs
from edged.common.errors import InvalidRequest, RequestTimeout
from edged.common.live import Live
from edged.config import ServerConfig
from edged.dataplane import default_models
from edged.dataplane.plane import DataPlane
from edged.metrics import Metrics
from edged.oip.tensors import (
    HEADER_LENGTH,
    InferRequest,
    InferResponse,
    decode_request,
    dump_json,
    encode_response,
    is_count,
    response_document,
)
from edged.request import Sequences
from edged.server.offload import decode_size, offload, place_outputs
from edged.server.rest.io import (
    Handler,
    Lines,
    check_admin,
    check_json_size,
    ok,
    peer_credentials,
    query_parameters,
    read_body,
    read_json,
    status_only,
)
from edged.server.services import Services

STREAM_CHUNK = 3200  # bytes of a streamed body per request of the sequence: 100 ms at 16 kHz


class Inference:
    """The Open Inference Protocol (/v2): metadata, health, inference, a stateful model's
    stream, statistics, configs and the repository."""

    def __init__(self, plane: DataPlane, settings: Live[ServerConfig]) -> None:
        self.plane, self.settings = plane, settings

    async def server_metadata(self, request: web.Request) -> web.Response:
        return ok(self.plane.server_metadata())

    async def live(self, request: web.Request) -> web.Response:
        return status_only(True)

    async def ready(self, request: web.Request) -> web.Response:
        return status_only(self.plane.ready)

    async def model_metadata(self, request: web.Request) -> web.Response:
        info = request.match_info
        return ok(self.plane.model_metadata(info["model"], info.get("version")))

    async def model_ready(self, request: web.Request) -> web.Response:
        info, plane = request.match_info, self.plane
        return status_only(plane.ready and plane.model_ready(info["model"], info.get("version")))

    async def statistics(self, request: web.Request) -> web.Response:
        info = request.match_info
        return ok(self.plane.statistics(info.get("model"), info.get("version")))

    async def model_config(self, request: web.Request) -> web.Response:
        info = request.match_info
        return ok(self.plane.model_config(info["model"], info.get("version")).as_json())

    async def infer(self, request: web.Request) -> web.Response:
        info, plane, settings = request.match_info, self.plane, self.settings.now()
        header = request.headers.get(HEADER_LENGTH)
        if header is not None and not is_count(header):
            raise InvalidRequest(f"{HEADER_LENGTH} must be a number of bytes, got '{header}'")
        json_size = int(header) if header is not None else request.content_length
        check_json_size(json_size, settings)
        body = await read_body(request)
        check_json_size(len(body) if header is None else None, settings)
        shm = plane.shared_memory(peer_credentials(request), settings.max_request_bytes)
        size = decode_size(len(body), b"shared_memory_region" in body, shm)
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

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """A stateful model's sequence over one request: the body is 16 kHz mono 16-bit
        little-endian PCM as it is captured (chunked), each 100 ms of it one request of the
        sequence; each response a JSON line as it comes, then {"event": "end"}."""
        plane = self.plane
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

    async def repository_index(self, request: web.Request) -> web.Response:
        return ok(self.plane.repository_index())

    async def repository_load(self, request: web.Request) -> web.Response:
        check_admin(request)
        await self.plane.load(request.match_info["model"])
        return ok({})

    async def repository_unload(self, request: web.Request) -> web.Response:
        check_admin(request)
        await self.plane.unload(request.match_info["model"])
        return ok({})


class SharedMemory:
    """System shared memory regions (/v2/systemsharedmemory), each its caller's own."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    async def register(self, request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest("body: an object {key, offset, byte_size}")
        self.plane.shm.register(
            peer_credentials(request),
            request.match_info["region"],
            doc.get("key"),
            doc.get("offset", 0),
            doc.get("byte_size"),
        )
        return ok({})

    async def unregister(self, request: web.Request) -> web.Response:
        self.plane.shm.unregister(peer_credentials(request), request.match_info.get("region"))
        return ok({})

    async def status(self, request: web.Request) -> web.Response:
        region = request.match_info.get("region")
        return ok(self.plane.shm.status(peer_credentials(request), region))

    async def cuda(self, request: web.Request) -> web.Response:
        raise InvalidRequest("CUDA shared memory: not on this edged (system shared memory is)")


class Daemon:
    """What edged says of itself: its status, its event log (admins), its capabilities."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    async def status(self, request: web.Request) -> web.Response:
        return ok(self.plane.status())

    async def events(self, request: web.Request) -> web.Response:
        check_admin(request)  # the daemon's log lines: what other callers sent shows there
        query = request.query
        return ok(self.plane.events_after(query.get("after", "0"), query.get("limit", "1000")))

    async def capabilities(self, request: web.Request) -> web.Response:
        return ok(self.plane.capabilities())


def metrics_handler(metrics: Metrics) -> Handler:
    """GET /metrics: Prometheus' text format."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


class DefaultModels:
    """The default models' calls (/v1/embed, /v1/intent, /v1/ocr, /v1/vad)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    async def embed(self, request: web.Request) -> web.Response:
        doc, params = await read_json(request), query_parameters(request)
        return ok(await default_models.embed(self.plane, doc, params))

    async def intent(self, request: web.Request) -> web.Response:
        doc, params = await read_json(request), query_parameters(request)
        return ok(await default_models.intent(self.plane, doc, params))

    async def ocr(self, request: web.Request) -> web.Response:
        body, params = await read_body(request), query_parameters(request)
        return ok(await default_models.ocr(self.plane, body, params))

    async def vad(self, request: web.Request) -> web.Response:
        body, params = await read_body(request), query_parameters(request)
        return ok(await default_models.vad(self.plane, body, params))


class Knowledge:
    """The knowledge store (/v1/kb): namespaces, ingest, search, ask, stats, delete."""

    def __init__(self, plane: DataPlane, services: Services) -> None:
        self.plane, self.services = plane, services

    async def namespaces(self, request: web.Request) -> web.Response:
        return ok({"namespaces": await self.services.kb().namespaces()})

    async def ingest(self, request: web.Request) -> web.Response:
        doc = await read_json(request)
        documents = doc.get("documents") if isinstance(doc, dict) else None
        return ok(await self.services.kb().ingest(request.match_info["ns"], documents))

    async def search(self, request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest('the body must be {"query": "...", "k": 5, "filter": ""}')
        k = doc.get("k", 5)
        if isinstance(k, bool) or not isinstance(k, int):
            raise InvalidRequest("'k' must be an integer")
        kb, where = self.services.kb(), doc.get("filter", "")
        return ok(await kb.search(request.match_info["ns"], doc.get("query"), k, where))

    async def ask(self, request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest('the body must be {"question": "...", "threshold": 0.6}')
        threshold = doc.get("threshold")
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float))
        ):
            raise InvalidRequest("'threshold' must be a number (a cosine score, -1 to 1)")
        params, kb = query_parameters(request), self.services.kb()
        # an escalation to the answer model may take seconds: the ask's own default deadline
        params.setdefault("timeout", round(kb.ask_settings.timeout_s * 1e6))
        _, route = self.plane.take_parameters(params)
        reply = await kb.ask(
            request.match_info["ns"],
            doc.get("question"),
            threshold,
            doc.get("filter", ""),
            private=route.private,
        )
        if params.get("explain") is True:
            reply["route_trace"] = route.decisions
        return ok(reply)

    async def stats(self, request: web.Request) -> web.Response:
        return ok(await self.services.kb().stats(request.match_info["ns"]))

    async def delete(self, request: web.Request) -> web.Response:
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise InvalidRequest('the body must be {"ids": [...]} or {"source": "..."}')
        return ok(await self.services.kb().delete(request.match_info["ns"], doc))


class Tasks:
    """Task graphs (/v1/tasks): the templates, and a task run (streamed as JSON lines)."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def catalog(self, request: web.Request) -> web.Response:
        return ok({"templates": self.services.task_runner().catalog()})

    async def run(self, request: web.Request) -> web.StreamResponse:
        logs.set_fields(request_id=logs.short_id())  # one id for every node's log lines
        runner = self.services.task_runner()
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


def _admin_only(act: Callable[[web.Request], Awaitable[Any]]) -> Handler:
    """``act``'s answer as JSON, for admins only."""

    async def answer(request: web.Request) -> web.Response:
        check_admin(request)
        return web.json_response(await act(request), dumps=dump_json)

    return answer


class AdminEndpoints:
    """/v1/admin (``edged.admin``): the routing policy, reload, drain and resume, versions,
    installs and rollbacks, A/B splits and their scores, the egress ledger. Admins only."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin

    def routes(self) -> list[web.RouteDef]:
        model, cloud = "/v1/admin/models/{model}", "/v1/admin/cloud/{model}/ab"
        table: list[tuple[str, str, Callable[[web.Request], Awaitable[Any]]]] = [
            ("GET", "/v1/admin/routing", self.routing),
            ("PATCH", "/v1/admin/routing", self.patch_routing),
            ("DELETE", "/v1/admin/routing", self.reset_routing),
            ("POST", "/v1/admin/reload", self.reload),
            ("POST", "/v1/admin/drain", self.drain),
            ("POST", "/v1/admin/resume", self.resume),
            ("GET", model, self.versions),
            ("DELETE", model, self.remove),
            ("POST", model + "/install", self.install),
            ("POST", model + "/activate", self.activate),
            ("POST", model + "/rollback", self.rollback),
            ("PUT", cloud, self.split),
            ("POST", cloud + "/scores", self.scores),
            ("GET", "/v1/admin/egress", self.egress),
            ("GET", "/v1/admin/egress/verify", self.verify_egress),
        ]
        return [
            web.get(path, _admin_only(act))
            if method == "GET"  # HEAD too, as web.get gives
            else web.route(method, path, _admin_only(act))
            for method, path, act in table
        ]

    async def routing(self, request: web.Request) -> Any:
        return self.admin.routing.show()

    async def patch_routing(self, request: web.Request) -> Any:
        return self.admin.routing.patch(await read_json(request))

    async def reset_routing(self, request: web.Request) -> Any:
        return self.admin.routing.reset()

    async def reload(self, request: web.Request) -> Any:
        return await self.admin.reload()

    async def drain(self, request: web.Request) -> Any:
        doc = await read_json(request) if request.can_read_body else None
        return await self.admin.drain.drain(doc)

    async def resume(self, request: web.Request) -> Any:
        return self.admin.drain.resume()

    async def versions(self, request: web.Request) -> Any:
        return self.admin.versions.show(request.match_info["model"])

    async def install(self, request: web.Request) -> Any:
        # finished even when the caller hangs up: a version half switched helps no one
        doc = await read_json(request)
        return await asyncio.shield(self.admin.versions.install(request.match_info["model"], doc))

    async def remove(self, request: web.Request) -> Any:
        return await asyncio.shield(self.admin.versions.remove(request.match_info["model"]))

    async def activate(self, request: web.Request) -> Any:
        doc = await read_json(request) if request.can_read_body else None
        return await self.admin.versions.activate(request.match_info["model"], doc)

    async def rollback(self, request: web.Request) -> Any:
        return await self.admin.versions.activate(request.match_info["model"], None)

    async def split(self, request: web.Request) -> Any:
        return self.admin.cloud_ab.set_split(request.match_info["model"], await read_json(request))

    async def scores(self, request: web.Request) -> Any:
        return self.admin.cloud_ab.score(request.match_info["model"], await read_json(request))

    async def egress(self, request: web.Request) -> Any:
        return await self.admin.egress.entries(request.query)

    async def verify_egress(self, request: web.Request) -> Any:
        unknown = set(request.query) - {"checkpoint"}
        if unknown:
            raise InvalidRequest(f"'{sorted(unknown)[0]}' is not a parameter here: checkpoint")
        return await self.admin.egress.verify(request.query.getall("checkpoint", []))
