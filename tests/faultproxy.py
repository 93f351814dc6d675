"""A fault-injecting TCP proxy on loopback: the network between edged and its cloud, for tests.

It forwards bytes both ways between 127.0.0.1:<port> and a target, and can, at any moment:

- ``delay(seconds)``: hold each chunk that long in each direction (an RTT of twice that), in
  order, without limiting how many requests are in flight;
- ``erratic(probability, seconds)``: hold a chunk ``seconds`` more with that probability (and
  what follows it on its connection, as TCP would): a path with spikes;
- ``bandwidth(bytes_per_s)``: pace the bytes (each direction);
- ``blackhole()``: stop forwarding (bytes wait, as TCP retransmits over a cut link) and let new
  connections in without forwarding anything; ``restore()`` lets everything flow again;
- ``reset()``: abort every connection (RST) and refuse new ones until ``restore()``.

``sent()`` returns every byte that went towards the target since the last call (what the cloud
was sent, whatever the protocol), for tests that check what left the device.

It runs an asyncio loop in a thread of the test process; ``close()`` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.latency = 0.0  # seconds per direction
        self.rate = 0.0  # bytes per second per direction (0: unlimited)
        self.spike_probability = 0.0
        self.spike = 0.0
        self.random = random.Random(0)
        self.refusing = False  # reset
        self.connections: set[asyncio.StreamWriter] = set()
        self.accepted = 0
        self._sent = bytearray()  # towards the target, until sent() takes it
        self.loop = asyncio.new_event_loop()
        self.flowing = asyncio.Event()  # cleared while blackholed
        self.flowing.set()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(sock,), daemon=True)
        self._thread.start()
        self._ready.wait(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ---- faults (called from the test's thread) --------------------------------------------

    def delay(self, seconds: float) -> None:
        self.latency = seconds

    def erratic(self, probability: float, seconds: float) -> None:
        self.spike_probability, self.spike = probability, seconds

    def bandwidth(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s

    def blackhole(self) -> None:
        self.loop.call_soon_threadsafe(self.flowing.clear)

    def reset(self) -> None:
        self.refusing = True
        self._run(self._abort_all())

    def restore(self) -> None:
        self.refusing = False
        self.latency = self.rate = self.spike_probability = self.spike = 0.0
        self.loop.call_soon_threadsafe(self.flowing.set)

    def sent(self) -> bytes:
        """Every byte forwarded towards the target since the last call."""
        return asyncio.run_coroutine_threadsafe(self._take(), self.loop).result(5)

    async def _take(self) -> bytes:
        taken = bytes(self._sent)
        self._sent.clear()  # in place: the connections' pumps hold this one
        return taken

    def close(self) -> None:
        """Abort every connection, stop the loop and its thread."""
        self._run(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    # ---- inside the loop -------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(5)

    async def _shutdown(self) -> None:
        self.server.close()
        await self._abort_all()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _abort_all(self) -> None:
        for writer in list(self.connections):
            writer.transport.abort()
        self.connections.clear()

    def _main(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._client, sock=sock))
        self._ready.set()
        self.loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections |= {writer, up_writer}
        # close() cancels this: end quietly (asyncio logs a handler task that ends cancelled)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(
                self._pump(reader, up_writer, self._sent),
                self._pump(up_reader, writer),
                return_exceptions=True,
            )
        for w in (writer, up_writer):
            self.connections.discard(w)
            w.transport.abort()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: bytearray | None = None,
    ) -> None:
        """Read chunks as they come; a second task delivers each after the latency, in order
        (and appends it to ``record`` as it goes out)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    writer.write_eof() if writer.can_write_eof() else None
                    return
                await self.flowing.wait()
                if self.spike_probability and self.random.random() < self.spike_probability:
                    due += self.spike
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.rate:
                    await asyncio.sleep(len(chunk) / self.rate)
                writer.write(chunk)
                if record is not None:
                    record.extend(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                chunk = await reader.read(65536)
                await queue.put((time.monotonic() + self.latency, chunk))
                if not chunk:
                    break
            await sender
        finally:
            sender.cancel()
