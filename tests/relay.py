"""A loopback TCP port relayed to a Unix socket, for clients that speak only TCP
(tritonclient.http): each connection is a new connection to the socket, bytes passed both
ways as they come. Started and stopped by the test that needs it."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tcp_relay(target: Path) -> Iterator[str]:
    """``host:port`` on 127.0.0.1 whose connections reach the Unix socket ``target``."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            inner.connect(str(target))

            def pump(src: socket.socket, dst: socket.socket) -> None:
                with contextlib.suppress(OSError):
                    while data := src.recv(1 << 16):
                        dst.sendall(data)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

            back = threading.Thread(target=pump, args=(inner, self.request), daemon=True)
            back.start()
            pump(self.request, inner)
            back.join()
            inner.close()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
