"""The gRPC relay: edged accepts each connection on the public Unix socket, reads the caller's
credentials (SO_PEERCRED, SO_PEERGROUPS) and relays the bytes, unparsed, to grpc's own server on
a socket in a 0700 directory, from a client socket named for that caller (``p<n>``); the
servicer (``grpc.servicer``) maps the call's peer back to the caller."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import cast

import grpc
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from edged.common.errors import ConfigError
from edged.config import ServerConfig
from edged.dataplane.plane import DataPlane
from edged.server.access import Access, Peer, peer_of
from edged.server.grpc.servicer import Service

log = logging.getLogger("edged.server.grpc")  # the log's name, as before the split


PEER_PREFIX = "p"
SOCKET_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL


EOF_GRACE_S = 5.0  # a relayed pair one side of which ended: closed this long after


class _Half(asyncio.Protocol):
    """One side of a relayed connection: what it reads goes to the other side, as it came.

    Every byte read is handed over, including those read before the other side exists: they
    wait in ``held`` (and reading pauses) until ``pair`` joins the two. Pausing alone does not
    hold them back: before Python 3.11.5 (Debian 12's 3.11.2, JetPack 6's 3.10) a transport
    starts reading after ``connection_made`` even when that paused it, so a caller's HTTP/2
    preface could arrive first and, dropped, fail the connection ("Connect string mismatch")."""

    def __init__(self, relay: GrpcServer) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.other: _Half | None = None
        self.name: str | None = None  # the inner side's: the peer grpc names
        self.held: list[bytes] = []  # read before the pair was made (a preface: a few bytes)
        self.eof = False  # the end came before the pair was made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is none of asyncio's

    def _peer(self) -> asyncio.Transport | None:
        return self.other.transport if self.other is not None else None

    def data_received(self, data: bytes) -> None:
        other = self._peer()
        if other is None:
            self.held.append(data)
            assert self.transport is not None
            self.transport.pause_reading()  # effective now that the transport is reading
        elif not other.is_closing():
            other.write(data)

    def eof_received(self) -> bool:
        self._close_later()
        other = self._peer()
        if other is None:
            self.eof = True
            return True  # passed on by pair(): the answer may still come back
        if other.can_write_eof() and not other.is_closing():
            other.write_eof()
            return True  # the other direction may still carry the answer
        return False

    def _close_later(self) -> None:
        """A side that ended keeps the pair open for the answer, for EOF_GRACE_S at most: a
        caller's closed channel whose other half grpc did not close held both sides (and grpc's
        own) for good, about one pair in two of 600 fresh channels (found by the 500-channel
        test on a loaded machine: edged past its 256 connections)."""
        loop = asyncio.get_running_loop()
        loop.call_later(EOF_GRACE_S, self._close_both)

    def _close_both(self) -> None:
        for transport in (self.transport, self._peer()):
            if transport is not None and not transport.is_closing():
                transport.close()

    def pair(self, other: _Half) -> None:
        """Join this side to ``other``: what this side held goes to it first, then reading
        resumes."""
        self.other = other
        assert self.transport is not None and other.transport is not None
        held, self.held = b"".join(self.held), []
        if held:
            other.transport.write(held)
        if self.eof:
            if other.transport.can_write_eof():
                other.transport.write_eof()
        else:
            self.transport.resume_reading()

    def pause_writing(self) -> None:  # the other side reads no faster than this one writes
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()  # what is buffered is written first
        self.relay.lost(self)


class _Front(_Half):
    """A caller's connection to the public socket: its credentials read once, then relayed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # its first read is held (and pauses) until paired
        self.relay.accepted(self)


class GrpcServer:
    """GRPCInferenceService on the public Unix socket ``sock``: connections accepted and
    relayed here (at most ``settings.max_connections`` at once; more are closed at once), served
    by grpc on a socket in the private directory ``private``."""

    def __init__(
        self,
        plane: DataPlane,
        sock: socket.socket,
        settings: ServerConfig,
        access: Access,
        private: Path,
    ) -> None:
        self.sock = sock
        self.settings = settings
        self.private = private
        self.inner = str(private / "grpc.sock")
        self.peers: dict[str, Peer] = {}  # p<n> -> the caller relayed from that name
        self.halves: set[_Half] = set()
        self.fronts = 0
        self.names = itertools.count(1)
        self.tasks: set[asyncio.Task[None]] = set()
        self.listener: asyncio.AbstractServer | None = None
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", settings.max_request_bytes),
                ("grpc.max_send_message_length", -1),
            ]
        )
        service = Service(plane, access, self.peer, settings.max_request_bytes)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, self.server)

    def peer(self, name: str) -> Peer | None:
        """The caller behind grpc's peer ``name`` (``unix:<private>/p<n>``), or None."""
        if not name.startswith("unix:"):
            return None
        return self.peers.get(name.rsplit("/", 1)[-1])

    async def start(self) -> None:
        old = os.umask(0o077)
        try:
            self.server.add_insecure_port(f"unix:{self.inner}")
        finally:
            os.umask(old)
        await self.server.start()
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_unix_server(lambda: _Front(self), sock=self.sock)

    def accepted(self, front: _Front) -> None:
        self.halves.add(front)
        self.fronts += 1
        assert front.transport is not None
        if self.fronts > self.settings.max_connections:
            front.transport.close()
            return
        task = asyncio.get_running_loop().create_task(self._connect(front), name="grpc-relay")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _connect(self, front: _Front) -> None:
        assert front.transport is not None
        name = f"{PEER_PREFIX}{next(self.names)}"
        path = self.private / name
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        inner.setblocking(False)
        back = _Half(self)
        back.name = name
        loop = asyncio.get_running_loop()
        try:
            caller = peer_of(front.transport.get_extra_info("socket"))  # gone already: OSError
            inner.bind(str(path))
            try:
                await loop.sock_connect(inner, self.inner)
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()  # the socket keeps its name; the file is not needed
            if caller is not None:
                self.peers[name] = caller  # before grpc can see a byte from it
            self.halves.add(back)
            await loop.create_unix_connection(lambda: back, sock=inner)
        except (Exception, asyncio.CancelledError) as exc:  # grpc gone, edged stopping, a bug
            if not isinstance(exc, (OSError, asyncio.CancelledError)):
                log.exception("relaying a gRPC connection failed")
            inner.close()
            self.halves.discard(back)
            self.peers.pop(name, None)
            front.transport.close()
            return
        if front.transport.is_closing():  # the caller left meanwhile
            assert back.transport is not None
            back.transport.close()
            return
        back.pair(front)
        front.pair(back)

    def lost(self, half: _Half) -> None:
        if half in self.halves:
            self.halves.discard(half)
            if isinstance(half, _Front):
                self.fronts -= 1
        if half.name is not None:
            self.peers.pop(half.name, None)

    async def stop(self, grace: float = 0) -> None:
        """No new connections; the calls in flight may take ``grace`` seconds; then all goes."""
        if self.listener is not None:
            self.listener.close()
        else:
            self.sock.close()
        for task in list(self.tasks):
            task.cancel()
        await self.server.stop(grace)
        for half in list(self.halves):
            if half.transport is not None:
                half.transport.close()
        if self.listener is not None:
            await self.listener.wait_closed()
        shutil.rmtree(self.private, ignore_errors=True)


def private_directory(public: Path) -> Path:
    """A fresh 0700 directory for grpc's own socket: ``.<name>.d`` beside the public socket
    (one left by a run that crashed is replaced), else a temporary one when that path would be
    too long for a socket."""
    candidate = public.with_name(f".{public.name}.d")
    longest = len(os.fsencode(candidate)) + len("/p") + 20  # and grpc.sock
    if longest > SOCKET_PATH_MAX:
        return Path(tempfile.mkdtemp(prefix="edged-grpc-"))
    try:
        info = candidate.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise ConfigError(f"{candidate} is not a directory of edged's own; remove it")
        shutil.rmtree(candidate)
    try:
        candidate.mkdir(mode=0o700)
        os.chmod(candidate, 0o700)
    except OSError as exc:
        raise ConfigError(f"cannot create {candidate}: {exc.strerror}") from None
    return candidate


async def start_server(
    plane: DataPlane, sock: socket.socket, path: Path, settings: ServerConfig, access: Access
) -> GrpcServer:
    """Serve GRPCInferenceService on the listening Unix socket ``sock`` at ``path`` (bound by
    the caller, with its mode), with ``access``'s checks."""
    try:
        private = private_directory(path)
    except BaseException:
        sock.close()
        raise
    server = GrpcServer(plane, sock, settings, access, private)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    return server
