"""The bytes of a cloud call, made where the egress ledger can see them before they leave.

REST: the body is made by tritonclient's own ``generate_request_body`` (the same bytes its
client would send: the JSON header, then binary tensors when the server takes them), the
ledger records its length and SHA-256, and it is posted here over aiohttp; the answer is read
by tritonclient's ``InferResult.from_response_body``. gRPC: the request message goes through a
client interceptor on the channel, which records the message's serialized bytes (what gRPC
puts in the frame) before handing it on; the call's ledger fields travel in a context
variable (``SENDING``), set by the caller for that call only.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

# the current cloud call's recorder: bytes about to be sent -> None (raises: do not send)
SENDING: contextvars.ContextVar[Callable[[bytes], None] | None] = contextvars.ContextVar(
    "edged_sending", default=None
)


def rest_body(
    inputs: list[Any], outputs: list[Any], request_id: str, timeout_us: int
) -> tuple[bytes, dict[str, str]]:
    """The body of ``POST /v2/models/{m}/infer`` as tritonclient makes it, and the headers
    that go with it (the JSON header's length when binary tensors follow)."""
    body, json_size = triton_http.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs or None, request_id=request_id, timeout=timeout_us
    )
    raw = body.encode() if isinstance(body, str) else bytes(body)
    headers = {} if json_size is None else {"Inference-Header-Content-Length": str(json_size)}
    return raw, headers


async def rest_infer(
    session: aiohttp.ClientSession, base_url: str, model: str, body: bytes, headers: dict[str, str]
) -> Any:
    """POST the body; the answer as tritonclient's InferResult. An error status is an
    InferenceServerException with the status and the server's message, as tritonclient's."""
    url = f"{base_url}/v2/models/{quote(model)}/infer"
    async with session.post(url, data=body, headers=headers) as response:
        data = await response.read()
        if response.status != 200:
            try:
                message = json.loads(data).get("error", "")
            except (ValueError, AttributeError):
                message = data[:200].decode(errors="replace")
            raise InferenceServerException(msg=str(message), status=str(response.status))
        # aiohttp asks for gzip and has decoded the body already: Triton compresses its answer
        # when the request accepts it (MLServer does not), so no encoding is left to undo
        return triton_http.InferResult.from_response_body(
            data, False, response.headers.get("Inference-Header-Content-Length"), None
        )


class Recorder(grpc.aio.UnaryUnaryClientInterceptor):
    """A gRPC client interceptor (grpc.aio's unary-unary kind): the request's serialized
    bytes to the call's recorder (``SENDING``), then the call. A recorder that raises stops
    the call before anything is sent."""

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        record = SENDING.get()
        if record is not None:
            record(request.SerializeToString())
        return await continuation(details, request)


def grpc_client(address: str, credentials: Any = None) -> Any:
    """A tritonclient gRPC asyncio client whose channel carries a ``Recorder`` (grpc.aio
    takes interceptors only when a channel is made, and tritonclient makes its own: it is made
    again here with the same target, options and credentials; the first, never used, is
    closed)."""
    import tritonclient.grpc.aio as triton_grpc
    from tritonclient.grpc import service_pb2_grpc

    client = triton_grpc.InferenceServerClient(
        address, creds=credentials, channel_args=GRPC_OPTIONS
    )
    unused = client._channel
    if credentials is None:
        channel = grpc.aio.insecure_channel(
            address, options=GRPC_OPTIONS, interceptors=[Recorder()]
        )
    else:
        channel = grpc.aio.secure_channel(
            address, credentials, options=GRPC_OPTIONS, interceptors=[Recorder()]
        )
    client._channel = channel
    client._client_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    closing = asyncio.ensure_future(unused.close())
    closing.add_done_callback(lambda f: f.exception())  # nothing to report: it never connected
    return client


# tritonclient's defaults (message sizes, its keep-alive settings)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.keepalive_time_ms", 2**31 - 1),
    ("grpc.keepalive_timeout_ms", 20000),
    ("grpc.keepalive_permit_without_calls", False),
    ("grpc.http2.max_pings_without_data", 2),
]
