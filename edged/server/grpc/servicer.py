"""GRPCInferenceService over the data plane: Triton's messages decoded into the data plane's
requests and its answers encoded back, every call's caller checked (``edged.server.access``),
what edged does not serve answered UNIMPLEMENTED. The callers' credentials come from the relay
(``grpc.relay``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from edged.common.errors import EdgedError, Forbidden, InvalidRequest, NotFound, retry_after
from edged.dataplane.plane import EMPTY_FINAL, DataPlane
from edged.oip.shm import Bound, use_of
from edged.oip.tensors import (
    DATATYPES,
    InferRequest,
    InferResponse,
    RequestedOutput,
    check_output_region,
    check_shape,
    datatype_of,
    element_count,
    from_binary,
    from_json,
    from_region,
    to_binary,
)
from edged.request import CALLER, Sequences
from edged.server.access import Access, Peer
from edged.server.offload import decode_size, offload, place_outputs

log = logging.getLogger("edged.server.grpc")  # the log's name, as before the split
T = TypeVar("T")

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# Which typed field of InferTensorContents holds each datatype (FP16 and BF16: raw only).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _parameters(message: Any) -> dict[str, Any]:
    """A protobuf map<string, InferParameter> as plain values."""
    out: dict[str, Any] = {}
    for key, param in message.items():
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which else None
    return out


def decode_infer(request: pb.ModelInferRequest, shm: Bound | None = None) -> InferRequest:
    """A ModelInferRequest as the data plane's InferRequest (raw or typed contents, or a
    shared-memory region read through ``shm``: raw contents are the other inputs', in order)."""
    if not request.inputs:
        raise InvalidRequest("request needs at least one input")
    raw = list(request.raw_input_contents)
    uses = [use_of(f"input '{t.name}'", _parameters(t.parameters)) for t in request.inputs]
    carried = sum(use is None for use in uses)
    if raw and len(raw) != carried:
        raise InvalidRequest(
            f"raw_input_contents has {len(raw)} entries for {carried} inputs not in shared memory"
        )
    inputs: dict[str, np.ndarray] = {}
    refused: InvalidRequest | None = None  # a region refused: InferRequest.refused
    chunks = iter(raw)
    for tensor, use in zip(request.inputs, uses):
        name = tensor.name
        if name in inputs:
            raise InvalidRequest(f"tensor '{name}' is given twice")
        if tensor.datatype not in DATATYPES:
            raise InvalidRequest(
                f"tensor '{name}': datatype {tensor.datatype!r} is not one of"
                f" {', '.join(DATATYPES)}"
            )
        shape = check_shape(name, list(tensor.shape), tensor.datatype)
        if use is not None:
            try:
                inputs[name] = from_region(name, tensor.datatype, shape, use, shm)
            except InvalidRequest as exc:
                refused = refused or exc
            continue
        if raw:
            inputs[name] = from_binary(name, tensor.datatype, shape, next(chunks))
            continue
        field = CONTENTS.get(tensor.datatype)
        if field is None:
            raise InvalidRequest(f"tensor '{name}': {tensor.datatype} goes in raw_input_contents")
        values = list(getattr(tensor.contents, field))
        if tensor.datatype == "BYTES":
            array = np.empty(len(values), dtype=object)
            array[:] = values
            count = element_count(shape)
            if array.size != count:
                raise InvalidRequest(
                    f"tensor '{name}': shape {shape} needs {count} elements, contents has"
                    f" {array.size}"
                )
            inputs[name] = array.reshape(shape)
        else:
            inputs[name] = from_json(name, tensor.datatype, shape, values, finite=False)
    outputs = []
    for wanted in request.outputs:
        params = _parameters(wanted.parameters)
        classification = params.get("classification", 0)
        if not isinstance(classification, int) or classification < 0:
            raise InvalidRequest(f"output '{wanted.name}': classification must be an integer >= 0")
        use = use_of(f"output '{wanted.name}'", params)
        if use is not None and refused is None:
            try:
                check_output_region(wanted.name, use, shm)
            except InvalidRequest as exc:
                refused = exc
        outputs.append(RequestedOutput(wanted.name, True, classification, use))
    return InferRequest(
        inputs=inputs,
        id=request.id or None,
        parameters=_parameters(request.parameters),
        outputs=outputs,
        binary_output=True,
        refused=refused,
    )


def encode_infer(
    response: InferResponse, placed: dict[str, dict[str, Any]]
) -> pb.ModelInferResponse:
    """A response as a ModelInferResponse: outputs as raw contents, or, for those ``placed``
    in shared memory, their region's parameters only (as Triton answers)."""
    reply = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id or "",
    )
    for name, array in response.outputs.items():
        tensor = reply.outputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
        if name in placed:
            for key, value in placed[name].items():
                field = "string_param" if isinstance(value, str) else "int64_param"
                setattr(tensor.parameters[key], field, value)
        else:
            reply.raw_output_contents.append(to_binary(array))
    for key, value in response.parameters.items():
        param = reply.parameters[key]
        if isinstance(value, bool):  # before int: a bool is one
            param.bool_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            param.double_param = float(value)
    return reply


STREAM_IN_FLIGHT = 64  # requests of one stream being answered at once

# Calls that change what serves: admin only. (The shared-memory, trace and log settings calls
# change state too; edged answers them UNIMPLEMENTED, to anyone allowed.)
ADMIN_METHODS = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})


class Service(pb_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService over the data plane; every call checked by ``access`` against the
    caller that ``peers`` names for its ``context.peer()``."""

    def __init__(
        self,
        plane: DataPlane,
        access: Access | None = None,
        peers: Callable[[str], Peer | None] = lambda peer: None,
        limit: int = 64 << 20,
    ) -> None:
        self.plane = plane
        self.access = access
        self.peers = peers
        self.limit = limit  # bytes a shared-memory input may hold (server.max_request_bytes)

    async def _check(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """PERMISSION_DENIED, naming what is needed, unless the caller may make this call."""
        peer = self.peers(context.peer())
        CALLER.set(peer.uid if peer is not None else None)  # this call's task only
        if self.access is None:
            return
        try:
            self.access.check_allowed(peer, "gRPC")
            if method in ADMIN_METHODS:
                self.access.check_admin(peer, method, "gRPC")
        except Forbidden as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)

    async def _call(self, context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[T]]) -> T:
        self.plane.begin()
        try:
            return await work()
        except EdgedError as exc:
            traceback.clear_frames(exc.__traceback__)  # as REST: the request's data goes now
            seconds = retry_after(exc)
            if seconds is not None:  # as REST's Retry-After header
                context.set_trailing_metadata((("retry-after", str(seconds)),))
            await context.abort(CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
        except Exception:
            log.exception("gRPC call failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, "internal error; the daemon's log has the details"
            )
        finally:
            self.plane.end()
        raise AssertionError("unreachable: context.abort raises")

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.ready)

    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        async def work() -> pb.ModelReadyResponse:
            try:
                ready = self.plane.model_ready(request.name, request.version or None)
            except NotFound:  # as Triton answers (tritonclient's is_model_ready would raise)
                ready = False
            return pb.ModelReadyResponse(ready=self.plane.ready and ready)

        return await self._call(context, work)

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        meta = self.plane.server_metadata()
        return pb.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        async def work() -> pb.ModelMetadataResponse:
            meta = self.plane.model_metadata(request.name, request.version or None)
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=meta["name"],
                versions=meta["versions"],
                platform=meta["platform"],
                inputs=[tensor(**t) for t in meta["inputs"]],
                outputs=[tensor(**t) for t in meta["outputs"]],
            )

        return await self._call(context, work)

    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        async def work() -> pb.ModelConfigResponse:
            config = self.plane.model_config(request.name, request.version or None)
            return pb.ModelConfigResponse(config=config.proto)

        return await self._call(context, work)

    async def _infer(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext,
        write: Callable[[pb.ModelInferResponse], Awaitable[None]] | None = None,
        sequences: Sequences | None = None,
    ) -> pb.ModelInferResponse:
        """One inference request, as ModelInfer and ModelStreamInfer answer it (EdgedError when
        it is refused). On a stream, ``write`` sends a decoupled model's responses as they come;
        the one returned is then the final one, with no outputs."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        shm = self.plane.shared_memory(self.peers(context.peer()), self.limit)
        size = decode_size(
            sum(len(chunk) for chunk in request.raw_input_contents),
            any("shared_memory_region" in t.parameters for t in request.inputs),
            shm,
        )
        decoded = await offload(size, decode_infer, request, shm)  # as REST bodies are

        async def reply(response: InferResponse) -> pb.ModelInferResponse:
            return encode_infer(response, await place_outputs(response, decoded.outputs, shm))

        async def send(response: InferResponse, _binary: dict[str, bool]) -> None:
            assert write is not None
            await write(await reply(response))

        response, _ = await self.plane.infer(
            request.model_name,
            request.model_version or None,
            decoded,
            deadline,
            send if write is not None else None,
            sequences,
        )
        return await reply(response)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        return await self._call(context, lambda: self._infer(request, context))

    async def ModelStreamInfer(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        """Bidirectional streaming: each request answered as ModelInfer answers it (the same
        admission, priority, deadline and routing), in the order they finish, at most
        ``STREAM_IN_FLIGHT`` at once (the stream is not read further meanwhile); a refused
        request is answered with ``error_message`` (and its id) and the stream goes on. The
        stream's deadline bounds every request in it. A decoupled model's responses are
        written as they come; its end is an empty response (``triton_final_response`` true)
        only when the request asked for it (``triton_enable_empty_final_response``), as
        Triton does. Writes wait for the caller to read (back-pressure)."""
        room = asyncio.Semaphore(STREAM_IN_FLIGHT)
        writing = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()
        sequences = Sequences()
        # the last request of each (model, sequence id): the next one waits for it (in order)
        last: dict[tuple[str, Any], asyncio.Task[None]] = {}

        async def write(reply: pb.ModelStreamInferResponse) -> None:
            async with writing:
                await context.write(reply)

        def forget(key: tuple[str, Any], done: asyncio.Task[None]) -> None:
            if last.get(key) is done:
                del last[key]

        async def partial(response: pb.ModelInferResponse) -> None:
            await write(pb.ModelStreamInferResponse(infer_response=response))

        async def answer(request: pb.ModelInferRequest, after: asyncio.Task[None] | None) -> None:
            if after is not None:  # the sequence's previous request first (its errors its own)
                await asyncio.wait([after])
            self.plane.begin()
            reply: pb.ModelStreamInferResponse | None = None
            try:
                final = await self._infer(request, context, partial, sequences)
                empty = request.parameters.get(EMPTY_FINAL)
                if final.outputs or (empty is not None and empty.bool_param):
                    reply = pb.ModelStreamInferResponse(infer_response=final)
            except EdgedError as exc:
                traceback.clear_frames(exc.__traceback__)
                reply = pb.ModelStreamInferResponse(
                    error_message=exc.message,
                    infer_response=pb.ModelInferResponse(
                        id=request.id, model_name=request.model_name
                    ),
                )
            except Exception:
                log.exception("gRPC stream request failed")
                reply = pb.ModelStreamInferResponse(
                    error_message="internal error; the daemon's log has the details",
                    infer_response=pb.ModelInferResponse(id=request.id),
                )
            finally:
                self.plane.end()
                room.release()
            if reply is not None:
                await write(reply)

        try:
            while True:
                await room.acquire()
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                sid = _parameters(request.parameters).get("sequence_id") or None
                key = (request.model_name, sid) if sid is not None else None
                after = last.get(key) if key is not None else None
                task = asyncio.get_running_loop().create_task(answer(request, after))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if key is not None:
                    last[key] = task
                    task.add_done_callback(functools.partial(forget, key))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # the caller went away: what it asked is not answered
                task.cancel()

    async def SystemSharedMemoryRegister(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        async def work() -> pb.SystemSharedMemoryRegisterResponse:
            self.plane.shm.register(
                self.peers(context.peer()),
                request.name,
                request.key,
                request.offset,
                request.byte_size,
            )
            return pb.SystemSharedMemoryRegisterResponse()

        return await self._call(context, work)

    async def SystemSharedMemoryUnregister(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        async def work() -> pb.SystemSharedMemoryUnregisterResponse:
            self.plane.shm.unregister(self.peers(context.peer()), request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()

        return await self._call(context, work)

    async def SystemSharedMemoryStatus(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        async def work() -> pb.SystemSharedMemoryStatusResponse:
            found = self.plane.shm.status(self.peers(context.peer()), request.name or None)
            reply = pb.SystemSharedMemoryStatusResponse()
            for row in found:
                reply.regions[row["name"]].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**row)
                )
            return reply

        return await self._call(context, work)

    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        async def work() -> pb.ModelStatisticsResponse:
            doc = self.plane.statistics(request.name or None, request.version or None)
            reply = pb.ModelStatisticsResponse()
            return json_format.ParseDict(doc, reply, ignore_unknown_fields=True)

        return await self._call(context, work)

    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        async def work() -> pb.RepositoryIndexResponse:
            index = pb.RepositoryIndexResponse.ModelIndex
            rows = self.plane.repository_index()
            if request.ready:
                rows = [r for r in rows if r["state"] == "READY"]
            return pb.RepositoryIndexResponse(
                models=[
                    index(
                        name=r["name"],
                        version=r.get("version", ""),
                        state=r["state"],
                        reason=r.get("reason", ""),
                    )
                    for r in rows
                ]
            )

        return await self._call(context, work)

    async def RepositoryModelLoad(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        async def work() -> pb.RepositoryModelLoadResponse:
            await self.plane.load(request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await self._call(context, work)

    async def RepositoryModelUnload(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        async def work() -> pb.RepositoryModelUnloadResponse:
            await self.plane.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._call(context, work)


def _unimplemented(name: str) -> Callable[..., Awaitable[None]]:
    async def method(self: Service, request: Any, context: Any) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, f"edged does not implement {name} (see docs/API.md)"
        )

    return method


def _guarded(name: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def guarded(self: Service, request: Any, context: Any) -> Any:
        await self._check(context, name)
        return await method(self, request, context)

    return guarded


# What edged does not serve answers UNIMPLEMENTED in one line; the generated servicer's own
# default raises NotImplementedError, which grpc logs at ERROR with a traceback, per call.
# Every method, served or not, checks its caller first.
for _name in dir(pb_grpc.GRPCInferenceServiceServicer):
    if _name[0].isupper():
        _method = Service.__dict__.get(_name) or _unimplemented(_name)
        setattr(Service, _name, _guarded(_name, _method))
