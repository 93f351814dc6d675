"""A cloud call's REST answer as tritonclient reads it (edged/wire.py), from a server that
compresses as Triton does: Triton gzips its answer when the request accepts gzip, which
aiohttp's requests do; aiohttp decodes the body, so nothing is left to undo (the first call to
the real Triton failed: "Not a gzipped file")."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from edged.wire import rest_infer

ANSWER = {
    "model_name": "m",
    "model_version": "1",
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 3], "data": [0.5, 0.25, 0.25]}],
}


def server(compress: bool) -> web.Application:
    """A stand-in for the server's answer: gzipped when the request accepts it and
    ``compress`` (Triton), else plain (MLServer)."""

    async def answer(request: web.Request) -> web.Response:
        body = json.dumps(ANSWER).encode()
        if compress and "gzip" in request.headers.get("Accept-Encoding", ""):
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            return web.Response(body=gzip.compress(body), headers=headers)
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v2/models/m/infer", answer)
    return app


async def call(compress: bool) -> np.ndarray:
    runner = web.AppRunner(server(compress))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v2/models/m/infer", data=b"{}") as response:
                encoding = response.headers.get("Content-Encoding")
                assert encoding == ("gzip" if compress else None), encoding
            result = await rest_infer(session, base, "m", b"{}", {})
            out: np.ndarray = result.as_numpy("y")
            return out
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("compress", [False, True])
def test_an_answer_gzipped_as_triton_sends_it_is_read_once(compress: bool) -> None:
    np.testing.assert_array_equal(asyncio.run(call(compress)), [[0.5, 0.25, 0.25]])
