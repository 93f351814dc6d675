"""Open Inference Protocol gRPC (Triton's GRPCInferenceService) on a Unix socket.

The service definition is Triton's own, from tritonclient, so ``tritonclient.grpc`` and any
other client generated from Triton's protos works unchanged: ``InferenceServerClient(
"unix:///run/edged/edged-grpc.sock")``. Like the REST adapter this is thin: every call goes to
the same ``DataPlane``. A gRPC deadline becomes the request's timeout in the scheduler.

Access: gRPC offers no peer credentials on a Unix socket, so this socket is guarded by its
file mode alone (``server.socket_mode``); ``server.allowed_uids``/``allowed_gids`` apply to the
REST socket. Set ``server.grpc = false`` where that matters.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from edged.errors import EdgedError, InvalidRequest, NotFound, retry_after
from edged.protocol.tensors import (
    DATATYPES,
    InferRequest,
    RequestedOutput,
    check_shape,
    datatype_of,
    element_count,
    from_binary,
    from_json,
    to_binary,
)
from edged.server.dataplane import DataPlane

log = logging.getLogger(__name__)
T = TypeVar("T")

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
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


def decode_infer(request: pb.ModelInferRequest) -> InferRequest:
    """A ModelInferRequest as the data plane's InferRequest (raw or typed contents)."""
    if not request.inputs:
        raise InvalidRequest("request needs at least one input")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise InvalidRequest(f"tensor '{name}' is given twice")
        if tensor.datatype not in DATATYPES:
            raise InvalidRequest(
                f"tensor '{name}': datatype {tensor.datatype!r} is not one of"
                f" {', '.join(DATATYPES)}"
            )
        shape = check_shape(name, list(tensor.shape), tensor.datatype)
        if raw:
            inputs[name] = from_binary(name, tensor.datatype, shape, raw[i])
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
        outputs.append(RequestedOutput(wanted.name, True, classification))
    return InferRequest(
        inputs=inputs,
        id=request.id or None,
        parameters=_parameters(request.parameters),
        outputs=outputs,
        binary_output=True,
    )


class Service(pb_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService over the data plane."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

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
            return pb.ModelConfigResponse(config=self.plane.model_config(request.name).proto)

        return await self._call(context, work)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        async def work() -> pb.ModelInferResponse:
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            decoded = decode_infer(request)
            response, _ = await self.plane.infer(
                request.model_name, request.model_version or None, decoded, deadline
            )
            reply = pb.ModelInferResponse(
                model_name=response.model_name,
                model_version=response.model_version,
                id=request.id,
            )
            for name, array in response.outputs.items():
                reply.outputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
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


# What edged does not serve answers UNIMPLEMENTED in one line; the generated servicer's own
# default raises NotImplementedError, which grpc logs at ERROR with a traceback, per call.
for _name in dir(pb_grpc.GRPCInferenceServiceServicer):
    if _name[0].isupper() and _name not in Service.__dict__:
        setattr(Service, _name, _unimplemented(_name))


async def start_server(plane: DataPlane, path: Path, mode: int, max_bytes: int) -> grpc.aio.Server:
    """Serve GRPCInferenceService on the Unix socket ``path`` (created with ``mode``)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", -1),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Service(plane), server)
    old = os.umask(0o777 & ~mode)  # the socket file is created here, with ``mode`` at once
    try:
        server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    await server.start()
    os.chmod(path, mode)
    return server
