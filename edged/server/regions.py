"""The region socket: where a local caller asks edged for a shared-memory region that edged
reads in place, with no copy, and may call models over it (an extension beside Triton's system
shared memory).

A region of Triton's kind is the caller's own file, which the caller could shrink under a
mapping (SIGBUS, which Python cannot catch): edged copies it with ``pread``. A region made here
cannot shrink: edged makes a memfd, seals it (no shrinking, no growing, no further seal), maps
it, registers it as the caller's, and hands the descriptor over this socket (SCM_RIGHTS). The
caller maps it and writes its tensors there; an input that names the region is a view of
edged's mapping (edged.oip.shm), on REST and gRPC alike, and its use, status and unregistering
are Triton's own calls.

One ``SOCK_SEQPACKET`` Unix socket (``server.shm_socket``: beside ``server.socket`` as
``<name>-shm.sock``, with its mode), one JSON message in each direction at a time:

- a region: ``{"name": "frame", "byte_size": 6220800}`` -> ``{"name", "byte_size", "key":
  "memfd:frame"}`` with the memfd attached;
- an inference, for a camera loop that sends only the name of its frame: an OIP request
  document with the model's name in ``model`` (and ``model_version``) -> the OIP response
  document (outputs as JSON data, or placed in a region as asked), through the same data
  plane as REST and gRPC (routing, privacy, statistics), without HTTP;
- a refusal: ``{"status": 400, "error": "byte_size: an integer from 1 to 67108864 ..."}``.

The way in is hostile by default: the caller is the kernel's (SO_PEERCRED) and must pass
``server.allowed_uids``/``allowed_gids`` (403); a message is at most 64 KiB (413 above), one
JSON object (400), a region message with the two keys and no other (400 naming the key); the
region quotas, ``server.max_request_bytes`` and ``server.shm_memfd_mb_per_uid`` bound what
one uid holds (400); an answer past
64 KiB is refused (413: ask for the outputs in a region); at most ``MAX_CONNECTIONS``
connections at once (503 to the next, then closed); a connection idle for
``server.read_timeout_s``, or one that does not read its answers, is closed; descriptors a
caller sends are closed by the kernel, unread (``recv`` takes no ancillary data). A region goes
when the process that asked for it exits, or when it is unregistered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import traceback
from typing import Any

from edged.common.errors import EdgedError, InvalidRequest, PayloadTooLarge
from edged.common.live import Live
from edged.config import ServerConfig
from edged.dataplane.plane import DataPlane
from edged.oip.shm import Regions
from edged.oip.tensors import decode_document, encode_response, parse_json
from edged.request import CALLER
from edged.server.access import Access, Peer, peer_of
from edged.server.offload import place_outputs

log = logging.getLogger(__name__)
MAX_MESSAGE = 64 * 1024
MAX_CONNECTIONS = 64
KEYS = ("name", "byte_size")
NO_BINARY = memoryview(b"")


def message_of(access: Access, peer: Peer | None, message: bytes) -> dict[str, Any]:
    """The caller's message as a JSON object, once the caller is allowed (EdgedError)."""
    access.check_allowed(peer, "the region socket")
    if len(message) > MAX_MESSAGE:
        raise PayloadTooLarge(f"a message is at most {MAX_MESSAGE} bytes")
    doc = parse_json(message)
    if not isinstance(doc, dict):
        raise InvalidRequest(
            'a message is one JSON object: {"name": ..., "byte_size": ...} or an inference'
            ' request with "model"'
        )
    return doc


def create(
    regions: Regions, peer: Peer | None, doc: dict[str, Any], settings: ServerConfig
) -> tuple[dict[str, Any], int]:
    """A region for the caller: its reply and its memfd (EdgedError, OSError)."""
    for key in doc:
        if key not in KEYS:
            raise InvalidRequest(f"{key[:64]!r}: not a key here (name, byte_size; or model)")
    limit, per_uid = settings.max_request_bytes, settings.shm_memfd_mb_per_uid << 20
    fd = regions.create(peer, doc.get("name"), doc.get("byte_size"), limit, per_uid)
    name, size = doc["name"], doc["byte_size"]
    return {"name": name, "byte_size": size, "key": f"memfd:{name}"}, fd


def refusal(exc: EdgedError) -> dict[str, Any]:
    traceback.clear_frames(exc.__traceback__)  # the request's data goes now
    return {"status": exc.status, "error": exc.message}


class RegionSocket:
    """Serves the region socket on the running event loop."""

    def __init__(self, plane: DataPlane, access: Access, settings: Live[ServerConfig]) -> None:
        self.plane = plane
        self.access = access
        self.settings = settings
        self.connections: set[asyncio.Task[None]] = set()
        self.accepting: asyncio.Task[None] | None = None
        self.sock: socket.socket | None = None

    def start(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.accepting = asyncio.get_running_loop().create_task(self._accept(sock), name="regions")

    async def stop(self) -> None:
        tasks = [t for t in (self.accepting, *self.connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.sock is not None:
            self.sock.close()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and the like: the caller retries; edged goes on
                log.warning("region socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            if len(self.connections) >= MAX_CONNECTIONS:
                with contextlib.suppress(OSError):
                    busy = {"status": 503, "error": f"{MAX_CONNECTIONS} connections are open"}
                    conn.send(json.dumps(busy).encode())
                conn.close()
                continue
            task = loop.create_task(self._serve(conn), name="region connection")
            self.connections.add(task)
            task.add_done_callback(self.connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer = peer_of(conn)
        CALLER.set(peer.uid if peer is not None else None)  # this connection's task only
        try:
            while True:
                timeout = self.settings.now().read_timeout_s
                try:
                    message = await asyncio.wait_for(loop.sock_recv(conn, MAX_MESSAGE + 1), timeout)
                except (asyncio.TimeoutError, OSError):
                    return
                if not message:
                    return
                reply, fd = await self._answer(peer, message)
                if not self._send(conn, reply, fd, peer):
                    return
        finally:
            conn.close()

    async def _answer(self, peer: Peer | None, message: bytes) -> tuple[Any, int | None]:
        """The reply to one message (a document, or an answer's bytes) and the descriptor to
        send with it (None: none)."""
        settings = self.settings.now()
        try:
            doc = message_of(self.access, peer, message)
            if "model" in doc:
                return await self._infer(peer, doc, settings), None
            return create(self.plane.shm, peer, doc, settings)
        except EdgedError as exc:
            return refusal(exc), None
        except OSError as exc:  # no memory or no descriptor left for a memfd
            log.warning("region socket: cannot make a region for %s: %s", peer, exc)
            return {"status": 503, "error": f"cannot make a region now: {exc.strerror}"}, None
        except Exception:
            log.exception("region socket: a call failed")
            return {
                "status": 500,
                "error": "internal error; the daemon's log has the details",
            }, None

    async def _infer(self, peer: Peer | None, doc: dict[str, Any], settings: ServerConfig) -> bytes:
        """An OIP request document naming its model: the answer, JSON (EdgedError)."""
        model, version = doc.get("model"), doc.get("model_version")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model: a model's name")
        if version is not None and not isinstance(version, str):
            raise InvalidRequest("model_version: a version, as a string")
        shm = self.plane.shared_memory(peer, settings.max_request_bytes)
        request = decode_document(doc, NO_BINARY, shm)  # a region's bytes: views
        self.plane.begin()
        try:
            response, _ = await self.plane.infer(model, version, request)
            placed = await place_outputs(response, request.outputs, shm)
        finally:
            self.plane.end()
        payload, _ = encode_response(response, {}, placed)
        if len(payload) > MAX_MESSAGE:
            raise PayloadTooLarge(
                f"the answer is {len(payload)} bytes, past {MAX_MESSAGE} on the region socket:"
                " ask for the outputs in a region (shared_memory_region)"
            )
        return payload

    def _send(self, conn: socket.socket, reply: Any, fd: int | None, peer: Peer | None) -> bool:
        """Send ``reply`` (with ``fd``, which is closed here); False: the caller does not
        read its answers (its region, if one was made, is unregistered)."""
        payload = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        try:
            if fd is None:
                conn.send(payload)
            else:
                socket.send_fds(conn, [payload], [fd])
            return True
        except OSError:  # a full buffer, or gone
            if fd is not None:
                with contextlib.suppress(EdgedError):
                    self.plane.shm.unregister(peer, reply["name"])
            return False
        finally:
            if fd is not None:
                os.close(fd)
