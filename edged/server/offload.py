"""What both adapters do with large bodies: decode them and write outputs into shared memory
off the event loop (a 38 MiB JSON held the loop for 4.6 s)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from edged.oip.shm import Bound
from edged.oip.tensors import InferResponse, RequestedOutput, place

# Bodies past this are decoded in a thread: a 38 MiB JSON held the event loop for 4.6 s
OFFLOAD_BYTES = 64 * 1024


def decode_size(size: int, names_region: bool, shm: Bound) -> int:
    """The size ``offload`` weighs for decoding a request of ``size`` bytes: past the limit
    when it names a region whose reading copies (a file's: ``pread``), since the region's bytes
    are read in the decoding; a sealed memfd's are a view, read on the loop."""
    if names_region and size <= OFFLOAD_BYTES and shm.copies:
        return OFFLOAD_BYTES + 1
    return size


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
