"""The region socket: where a local caller asks edged for a shared-memory region that edged
reads in place, with no copy (an extension beside Triton's system shared memory).

A region of Triton's kind is the caller's own file, which the caller could shrink under a
mapping (SIGBUS, which Python cannot catch): edged copies it with ``pread``. A region made here
cannot shrink: edged makes a memfd, seals it (no shrinking, no growing, no further seal), maps
it, registers it as the caller's, and hands the descriptor over this socket (SCM_RIGHTS). The
caller maps it and writes its tensors there; an input that names the region is a view of
edged's mapping (edged.oip.shm), on REST and gRPC alike, and its use, status and unregistering
are Triton's own calls.

One ``SOCK_SEQPACKET`` Unix socket (``server.shm_socket``: beside ``server.socket`` as
``<name>-shm.sock``, with its mode), a message in each direction at a time:

    {"name": "frame", "byte_size": 6220800}
    -> {"name": "frame", "byte_size": 6220800, "key": "memfd:frame"}  (+ the memfd)
    -> {"status": 400, "error": "byte_size: an integer from 1 to 67108864 ..."}  (no memfd)

The way in is hostile by default: the caller is the kernel's (SO_PEERCRED) and must pass
``server.allowed_uids``/``allowed_gids`` (403); a message is at most 4 KiB (413 above), one
JSON object with these two keys and no other (400 naming the key); the region quotas and
``server.max_request_bytes`` bound what one uid holds (400); at most ``MAX_CONNECTIONS``
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
from typing import Any

from edged.common.errors import EdgedError, InvalidRequest, PayloadTooLarge
from edged.common.live import Live
from edged.config import ServerConfig
from edged.oip.shm import Regions
from edged.server.access import Access, Peer, peer_of

log = logging.getLogger(__name__)
MAX_MESSAGE = 4096
MAX_CONNECTIONS = 64
KEYS = ("name", "byte_size")


def answer(
    regions: Regions, access: Access, peer: Peer | None, message: bytes, limit: int
) -> tuple[dict[str, Any], int | None]:
    """The reply to one message, and the descriptor to send with it (None: a refusal)."""
    try:
        access.check_allowed(peer, "the region socket")
        if len(message) > MAX_MESSAGE:
            raise PayloadTooLarge(f"a message is at most {MAX_MESSAGE} bytes")
        try:
            doc = json.loads(message)
        except (ValueError, RecursionError):
            raise InvalidRequest("a message is one JSON object (UTF-8)") from None
        if not isinstance(doc, dict):
            raise InvalidRequest('a message is one JSON object: {"name": ..., "byte_size": ...}')
        for key in doc:
            if key not in KEYS:
                raise InvalidRequest(f"{key[:64]!r}: not a key here (name, byte_size)")
        fd = regions.create(peer, doc.get("name"), doc.get("byte_size"), limit)
    except EdgedError as exc:
        return {"status": exc.status, "error": exc.message}, None
    except OSError as exc:  # no memory or no descriptor left for a memfd
        log.warning("region socket: cannot make a region for %s: %s", peer, exc)
        return {"status": 503, "error": f"cannot make a region now: {exc.strerror}"}, None
    name, size = doc["name"], doc["byte_size"]
    return {"name": name, "byte_size": size, "key": f"memfd:{name}"}, fd


class RegionSocket:
    """Serves the region socket on the running event loop."""

    def __init__(self, regions: Regions, access: Access, settings: Live[ServerConfig]) -> None:
        self.regions = regions
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
                    conn.send(
                        json.dumps(
                            {"status": 503, "error": f"{MAX_CONNECTIONS} connections are open"}
                        ).encode()
                    )
                conn.close()
                continue
            task = loop.create_task(self._serve(conn), name="region connection")
            self.connections.add(task)
            task.add_done_callback(self.connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer = peer_of(conn)
        try:
            while True:
                timeout = self.settings.now().read_timeout_s
                try:
                    message = await asyncio.wait_for(loop.sock_recv(conn, MAX_MESSAGE + 1), timeout)
                except (asyncio.TimeoutError, OSError):
                    return
                if not message:
                    return
                settings = self.settings.now()
                reply, fd = answer(
                    self.regions, self.access, peer, message, settings.max_request_bytes
                )
                if not self._send(conn, reply, fd, peer):
                    return
        finally:
            conn.close()

    def _send(
        self, conn: socket.socket, reply: dict[str, Any], fd: int | None, peer: Peer | None
    ) -> bool:
        """Send ``reply`` (with ``fd``, which is closed here); False: the caller does not
        read its answers (its region, if one was made, is unregistered)."""
        payload = json.dumps(reply).encode()
        try:
            if fd is None:
                conn.send(payload)
            else:
                socket.send_fds(conn, [payload], [fd])
            return True
        except OSError:  # a full buffer, or gone
            if fd is not None:
                with contextlib.suppress(EdgedError):
                    self.regions.unregister(peer, reply["name"])
            return False
        finally:
            if fd is not None:
                os.close(fd)
