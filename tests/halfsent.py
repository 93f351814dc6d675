"""Half-sent requests against a server with a connection cap (edged's REST socket, the fleet
service's API): which of the connections it holds, once it has seen them all."""

from __future__ import annotations

import socket
import time


def held_after(sockets: list[socket.socket], cap: int, within_s: float) -> list[socket.socket]:
    """The connections still held unanswered once the server has seen them all (each of the
    others answered 503 over the cap), or once ``within_s`` has passed since this call: none of
    them may be closed or answered otherwise this early."""
    started = time.monotonic()
    waiting = list(sockets)
    while True:
        still = []
        for sock in waiting:
            sock.setblocking(False)
            try:
                first = sock.recv(64)[:12]
            except BlockingIOError:
                still.append(sock)
                continue
            except ConnectionResetError:  # refused before it had sent: the 503 discarded
                first = b"HTTP/1.1 503"
            assert first == b"HTTP/1.1 503", first  # no held one is closed this early
        waiting = still
        if len(waiting) <= cap or time.monotonic() - started > within_s:
            return waiting
        time.sleep(0.1)
