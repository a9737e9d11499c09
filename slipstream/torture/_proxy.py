"""A TCP proxy between the harness's clients and the broker that can cut or delay connections.

Runs on the harness's event loop. Each client connection gets its own connection to the
broker and two pumps (one per direction). A pump reads what arrives and hands it to a writer
through a bounded queue (backpressure: a full queue stops reading), stamped with the time it
may be forwarded, so a delay holds data back in order, as a slow network does, and the broker
or client may see it long after the other side gave up. ``cut()`` resets every connection at
once (RST: in-flight data is lost both ways). A client that connects while the broker is down
has its connection closed at once, as a refused connection would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

_QUEUE = 64  # chunks held back per direction while delayed


class _Pair:
    """One client connection and its broker connection: four tasks, a reader and a writer
    per direction, with a bounded queue between them."""

    def __init__(
        self,
        proxy: TorturingProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        broker: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.broker = broker
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def run(self) -> None:
        upstream: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE)
        downstream: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE)
        try:
            async with asyncio.TaskGroup() as group:
                self.tasks = [
                    group.create_task(self._read(self.client[0], upstream)),
                    group.create_task(self._write(upstream, self.broker[1])),
                    group.create_task(self._read(self.broker[0], downstream)),
                    group.create_task(self._write(downstream, self.client[1])),
                ]
        finally:
            self.close(reset=False)

    async def _read(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        try:
            while data := await reader.read(256 * 1024):
                await queue.put((time.monotonic() + self.proxy.delay, data))
            await queue.put((time.monotonic() + self.proxy.delay, b""))  # end, after the data
        except OSError:
            self.close(reset=False)

    async def _write(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        self.close(reset=False)

    def close(self, reset: bool) -> None:
        """Close both connections (``reset``: with RST, losing what is in flight) and end the
        pair's tasks."""
        if self.closed:
            return
        self.closed = True
        for writer in (self.client[1], self.broker[1]):
            if reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
            writer.close()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        self.proxy.pairs.discard(self)


class TorturingProxy:
    """Listens on ``127.0.0.1:<port>`` and forwards to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.delay = 0.0  # seconds every chunk is held back, in both directions
        self.pairs: set[_Pair] = set()
        self.cuts = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> TorturingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            broker = await asyncio.wait_for(asyncio.open_connection(*self.target), 5)
        except (OSError, TimeoutError):
            client_writer.close()
            return
        self.connections += 1
        pair = _Pair(self, (client_reader, client_writer), broker)
        self.pairs.add(pair)
        await pair.run()

    def cut(self) -> int:
        """Reset every connection through the proxy; returns how many there were."""
        pairs = list(self.pairs)
        for pair in pairs:
            pair.close(reset=True)
        self.cuts += 1
        return len(pairs)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
