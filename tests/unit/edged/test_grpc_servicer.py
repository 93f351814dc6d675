"""The gRPC servicer alone (issue 45): Triton's GRPCInferenceService over a fake data plane,
served by a real grpc.aio server on a Unix socket and called with Triton's generated stub.
Who calls comes from the relay in the daemon (``grpc.relay``: the kernel's SO_PEERCRED); here
the test says who calls, which is what the servicer is given. What it must do with a call:
reach the plane with the request's names and tensors, map errors to gRPC codes, check the
caller first, and answer what edged does not serve with UNIMPLEMENTED."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from edged.common.errors import NotFound, Overloaded
from edged.common.live import Live
from edged.config import ServerConfig
from edged.dataplane.plane import DataPlane
from edged.oip.shm import Bound, Regions
from edged.oip.tensors import InferRequest, InferResponse
from edged.server.access import Access, Peer
from edged.server.grpc.servicer import Service

ROOT = Peer(pid=1, uid=0, gid=0)
SOMEONE = Peer(pid=2, uid=54321, gid=54321)


class FakePlane:
    def __init__(self) -> None:
        self.ready = True
        self.calls: list[tuple[Any, ...]] = []
        self.fail: Exception | None = None
        self.regions = Regions(4, 4)

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def shared_memory(self, caller: Any, limit: int) -> Bound:
        return Bound(self.regions, caller, limit)

    def model_ready(self, name: str, version: str | None) -> bool:
        if name != "m":
            raise NotFound(f"no model '{name}'")
        return True

    async def infer(
        self,
        name: str,
        version: str | None,
        request: InferRequest,
        deadline: float | None = None,
        *rest: Any,
    ) -> Any:
        self.calls.append(
            ("infer", name, version, {k: v.tolist() for k, v in request.inputs.items()})
        )
        if self.fail is not None:
            raise self.fail
        return InferResponse(
            name, version or "1", {k: v + 1 for k, v in request.inputs.items()}
        ), {}

    async def load(self, name: str) -> None:
        self.calls.append(("load", name))


Calls = Callable[[pb_grpc.GRPCInferenceServiceStub, list[Peer | None]], Awaitable[None]]


def serve(plane: FakePlane, settings: ServerConfig, body: Calls, path: Path) -> None:
    async def main() -> None:
        caller: list[Peer | None] = [SOMEONE]
        service = Service(cast(DataPlane, plane), Access(Live(settings)), lambda peer: caller[0])
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
                await body(pb_grpc.GRPCInferenceServiceStub(channel), caller)
        finally:
            await server.stop(None)

    asyncio.run(main())


def infer_request(model: str, values: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version="2")
    tensor = request.inputs.add(name="x", datatype="INT32", shape=[len(values)])
    tensor.contents.int_contents.extend(values)
    return request


async def code_of(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


def test_health_readiness_and_an_inference_reach_the_plane(tmp_path: Path) -> None:
    plane = FakePlane()

    async def body(stub: pb_grpc.GRPCInferenceServiceStub, caller: list[Peer | None]) -> None:
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
        plane.ready = False
        assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
        plane.ready = True
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="m"))).ready
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="x"))).ready  # as Triton
        reply = await stub.ModelInfer(infer_request("m", [1, 2, 3]))
        assert (reply.model_name, reply.model_version) == ("m", "2")
        (out,) = reply.outputs
        assert (out.name, out.datatype, list(out.shape)) == ("x", "INT32", [3])
        raw = reply.raw_output_contents[0] if reply.raw_output_contents else None
        values = np.frombuffer(raw, "<i4").tolist() if raw else list(out.contents.int_contents)
        assert values == [2, 3, 4]

    serve(plane, ServerConfig(), body, tmp_path / "g.sock")
    assert plane.calls == [("infer", "m", "2", {"x": [1, 2, 3]})]


def test_errors_become_grpc_codes_and_a_bug_says_nothing_of_itself(tmp_path: Path) -> None:
    plane = FakePlane()

    async def body(stub: pb_grpc.GRPCInferenceServiceStub, caller: list[Peer | None]) -> None:
        plane.fail = NotFound("no version 2 of 'm'")
        assert await code_of(stub.ModelInfer(infer_request("m", [1]))) == (
            grpc.StatusCode.NOT_FOUND,
            "no version 2 of 'm'",
        )
        plane.fail = Overloaded("queue full", retry_after=1.2)
        call = stub.ModelInfer(infer_request("m", [1]))
        code, _ = await code_of(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "2") in tuple(await call.trailing_metadata() or ())
        plane.fail = KeyError("secret detail")
        generic = "internal error; the daemon's log has the details"
        got = await code_of(stub.ModelInfer(infer_request("m", [1])))
        assert got == (grpc.StatusCode.INTERNAL, generic)

    serve(plane, ServerConfig(), body, tmp_path / "g.sock")


def test_the_caller_is_checked_first_and_what_is_not_served_is_unimplemented(
    tmp_path: Path,
) -> None:
    plane = FakePlane()
    settings = ServerConfig(allowed_uids=[0, SOMEONE.uid])

    async def body(stub: pb_grpc.GRPCInferenceServiceStub, caller: list[Peer | None]) -> None:
        load = pb.RepositoryModelLoadRequest(model_name="m")
        code, why = await code_of(stub.RepositoryModelLoad(load))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in why
        caller[0] = ROOT
        await stub.RepositoryModelLoad(load)
        caller[0] = None  # not one of the relay's: refused whatever it asks (fail closed)
        code, _ = await code_of(stub.ServerLive(pb.ServerLiveRequest()))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        caller[0] = SOMEONE
        code, why = await code_of(stub.TraceSetting(pb.TraceSettingRequest()))
        assert code == grpc.StatusCode.UNIMPLEMENTED
        assert why == "edged does not implement TraceSetting (see docs/API.md)"

    serve(plane, settings, body, tmp_path / "g.sock")
    assert plane.calls == [("load", "m")]  # only root's
