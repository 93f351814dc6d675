"""The REST adapter alone (issue 45): its route table and middleware over a fake data plane
that records what it is asked, served on a real Unix socket (so the caller's credentials are
the kernel's: this test's uid) and on TCP (no credentials: an unknown peer). What the daemon
does with the calls is the integration tests'; here, what the adapter does with a request:
which endpoint it reaches with what, how errors become statuses, what is refused before the
data plane is asked."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from edged.common.errors import NotFound, Overloaded, Unavailable
from edged.common.live import Live
from edged.config import ServerConfig
from edged.dataplane.plane import DataPlane
from edged.oip.shm import Regions
from edged.oip.tensors import InferRequest, InferResponse
from edged.request import CALLER
from edged.server.rest import routes
from edged.server.rest.routes import create_app


class FakePlane:
    """What the adapter calls of a DataPlane, answering from a script and keeping the calls."""

    def __init__(self) -> None:
        self.ready = True
        self.inflight = 0
        self.calls: list[tuple[Any, ...]] = []
        self.shm = Regions(4, 4)
        self.fail: Exception | None = None
        self.manager = type("Manager", (), {"metrics": type("M", (), {"render": bytes})()})()

    def begin(self) -> None:
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1

    def check_ready(self) -> None:
        pass

    def shared_memory(self, caller: Any, limit: int) -> Any:
        return None

    def _raise(self) -> None:
        if self.fail is not None:
            raise self.fail

    def server_metadata(self) -> dict[str, Any]:
        self._raise()
        return {"name": "edged"}

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        self.calls.append(("metadata", name, version))
        if name != "m":
            raise NotFound(f"no model '{name}'")
        return {"name": name, "versions": ["1"]}

    def model_ready(self, name: str, version: str | None) -> bool:
        return name == "m"

    def status(self) -> dict[str, Any]:
        self.calls.append(("status", CALLER.get()))
        return {"inflight": self.inflight}

    async def infer(self, name: str, version: str | None, request: InferRequest) -> Any:
        self.calls.append(
            ("infer", name, version, {k: v.tolist() for k, v in request.inputs.items()})
        )
        self._raise()
        doubled = {k: v * 2 for k, v in request.inputs.items()}
        return InferResponse(name, version or "1", doubled), {}

    async def load(self, name: str) -> None:
        self.calls.append(("load", name))


Call = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


def serve(plane: FakePlane, settings: ServerConfig, body: Call, unix: Path | None) -> None:
    """The app on a Unix socket at ``unix`` (else TCP on loopback), ``body`` run against it."""

    async def main() -> None:
        app = create_app(cast(DataPlane, plane), Live(settings))
        runner = web.AppRunner(app)
        await runner.setup()
        if unix is not None:
            site: web.BaseSite = web.UnixSite(runner, str(unix))
            connector: aiohttp.BaseConnector = aiohttp.UnixConnector(str(unix))
            base = "http://edged"
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            connector = aiohttp.TCPConnector()
        await site.start()
        if unix is None:
            port = runner.addresses[0][1]
            base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                await body(session, base)
        finally:
            await runner.cleanup()

    asyncio.run(main())


@pytest.fixture
def plane() -> FakePlane:
    return FakePlane()


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "edged.sock"


def test_create_app_is_a_route_table_of_endpoint_methods() -> None:
    """Each route is a method of an endpoint class (or the metrics handler), and the function
    that lists them is a table, not a closure of handlers (it was 299 lines)."""
    source = inspect.getsource(create_app)
    assert len(source.splitlines()) < 60
    assert "async def" not in source
    app = create_app(cast(DataPlane, FakePlane()), Live(ServerConfig()))
    owners = set()
    for route in app.router.routes():
        handler = route.handler
        owner = getattr(handler, "__self__", None)
        owners.add(type(owner).__name__ if owner is not None else handler.__qualname__)
    assert owners == {
        "Inference",
        "SharedMemory",
        "Daemon",
        "DefaultModels",
        "Knowledge",
        "Tasks",
        "metrics_handler.<locals>.handler",
    }
    assert routes.__doc__ and "route table" in routes.__doc__


def test_health_and_metadata_reach_the_plane_with_the_path_s_names(
    plane: FakePlane, sock: Path
) -> None:
    async def body(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(base + "/v2/health/live") as r:
            assert r.status == 200
        async with session.get(base + "/v2/health/ready") as r:
            assert r.status == 200
        plane.ready = False
        async with session.get(base + "/v2/health/ready") as r:
            assert r.status == 503
        async with session.get(base + "/v2/models/m/ready") as r:
            assert r.status == 503  # the model is, the server is not
        plane.ready = True
        async with session.get(base + "/v2/models/m/versions/7") as r:
            assert (r.status, await r.json()) == (200, {"name": "m", "versions": ["1"]})
        async with session.get(base + "/v2/models/x") as r:
            assert (r.status, await r.json()) == (404, {"error": "no model 'x'"})

    serve(plane, ServerConfig(), body, sock)
    assert plane.calls == [("metadata", "m", "7"), ("metadata", "x", None)]


def test_errors_become_their_statuses_and_a_bug_a_500_that_says_nothing_of_it(
    plane: FakePlane, sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(session: aiohttp.ClientSession, base: str) -> None:
        plane.fail = Overloaded("queue full", retry_after=2.4)
        async with session.get(base + "/v2") as r:
            assert (r.status, r.headers["Retry-After"]) == (429, "3")
        plane.fail = Unavailable("loading")
        async with session.get(base + "/v2") as r:
            assert (r.status, r.headers["Retry-After"], await r.json()) == (
                503,
                "1",
                {"error": "loading"},
            )
        plane.fail = KeyError("secret detail")
        async with session.get(base + "/v2") as r:
            doc = await r.json()
            assert r.status == 500 and "secret" not in json.dumps(doc)
            assert doc == {"error": "internal error; the daemon's log has the details"}

    serve(plane, ServerConfig(), body, sock)
    assert "secret detail" in caplog.text  # the log has it
    assert plane.inflight == 0  # counted in and out, errors too


def test_an_infer_call_is_decoded_passed_and_encoded(plane: FakePlane, sock: Path) -> None:
    request = {"inputs": [{"name": "x", "shape": [2], "datatype": "INT32", "data": [1, 2]}]}

    async def body(session: aiohttp.ClientSession, base: str) -> None:
        async with session.post(base + "/v2/models/m/versions/3/infer", json=request) as r:
            doc = await r.json()
            assert r.status == 200, doc
            assert (doc["model_name"], doc["model_version"]) == ("m", "3")
            assert [(o["name"], o["data"]) for o in doc["outputs"]] == [("x", [2, 4])]

    serve(plane, ServerConfig(), body, sock)
    assert plane.calls == [("infer", "m", "3", {"x": [1, 2]})]


def test_what_is_refused_before_the_plane_is_asked(plane: FakePlane, sock: Path) -> None:
    settings = ServerConfig(max_request_bytes=4096, max_json_bytes=1024)
    big = {"inputs": [{"name": "x", "shape": [600], "datatype": "INT32", "data": [1] * 600}]}

    async def body(session: aiohttp.ClientSession, base: str) -> None:
        async with session.post(base + "/v2/models/m/infer", data=b"x" * 5000) as r:
            assert r.status == 413 and "server.max_request_bytes" in (await r.json())["error"]
        async with session.post(base + "/v2/models/m/infer", json=big) as r:
            assert r.status == 413 and "server.max_json_bytes" in (await r.json())["error"]
        async with session.post(base + "/v2/models/m/infer", data=b"{not json") as r:
            assert r.status == 400
        async with session.post(base + "/v1/embed?private=maybe", json={"texts": ["a"]}) as r:
            assert (r.status, await r.json()) == (
                400,
                {"error": "query parameter 'private' must be true or false"},
            )
        async with session.get(base + "/v2/cudasharedmemory/status") as r:
            assert r.status == 400 and "CUDA shared memory" in (await r.json())["error"]

    serve(plane, settings, body, sock)
    assert plane.calls == []  # none of them reached the data plane


def test_the_caller_is_the_kernel_s_word_and_admin_calls_need_an_admin(
    plane: FakePlane, sock: Path
) -> None:
    """On the Unix socket the caller is this test's process (its uid, admin as root); on TCP
    there is no such word: an unknown peer, refused what needs an admin."""

    async def unix(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(base + "/v1/status") as r:
            assert r.status == 200
        async with session.post(base + "/v2/repository/models/m/load") as r:
            assert r.status == (200 if os.geteuid() == 0 else 403)

    async def tcp(session: aiohttp.ClientSession, base: str) -> None:
        async with session.post(base + "/v2/repository/models/m/load") as r:
            doc = await r.json()
            assert r.status == 403 and doc["error"].startswith("an unknown peer is not allowed")
        async with session.get(base + "/v1/events") as r:
            assert r.status == 403

    serve(plane, ServerConfig(), unix, sock)
    assert plane.calls[0] == ("status", os.geteuid())
    serve(plane, ServerConfig(), tcp, None)
    loads = [c for c in plane.calls if c[0] == "load"]
    assert loads == ([("load", "m")] if os.geteuid() == 0 else [])


def test_outputs_keep_their_datatype(plane: FakePlane, sock: Path) -> None:
    request = {"inputs": [{"name": "f", "shape": [1, 2], "datatype": "FP32", "data": [0.5, 1]}]}

    async def body(session: aiohttp.ClientSession, base: str) -> None:
        async with session.post(base + "/v2/models/m/infer", json=request) as r:
            (out,) = (await r.json())["outputs"]
            assert (out["datatype"], out["shape"], out["data"]) == ("FP32", [1, 2], [1.0, 2.0])

    serve(plane, ServerConfig(), body, sock)
    assert plane.calls == [("infer", "m", None, {"f": [[0.5, 1.0]]})]
