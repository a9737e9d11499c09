"""The Python API: ``AsyncClient`` (asyncio) and ``Client`` (blocking, any thread).

``Client`` runs an ``AsyncClient`` on an event loop in a background thread; producers and
readers hand work across with thread-safe queues, never one loop round trip per event.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from .._errors import InvalidArgument
from ..format import Event, events_of
from ..protocol import (
    CreateStream,
    DeleteStream,
    DescribeStream,
    ListStreams,
    StreamInfo,
    StreamList,
)
from ..streams import Router, StreamCut, parse_duration_ms, parse_size_bytes
from ._connection import DEFAULT_ADDRESS, Connection
from ._producer import BulkReceipt, ProducerCore, Receipt
from ._reader import Delivery, ReaderCore, Start, decode_delivery, tail_cut, with_position

T = TypeVar("T")


def default_address() -> str:
    """``SLIPSTREAM_BROKER`` if set, else 127.0.0.1:7070."""
    return os.environ.get("SLIPSTREAM_BROKER") or DEFAULT_ADDRESS


def _retention_ms(value: str | int | dt.timedelta | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, dt.timedelta):
        return int(value.total_seconds() * 1000)
    return parse_duration_ms(value)


def _retention_bytes(value: str | int | None) -> int | None:
    return parse_size_bytes(value) if isinstance(value, str) else value


def _router(info: StreamInfo) -> Router:
    return Router([(s.number, s.key_lo, s.key_hi) for s in info.segments if not s.sealed])


class AsyncClient:
    """A connection to a broker for asyncio code. Create with ``await connect_async(...)``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    @classmethod
    async def connect(cls, address: str | None = None, *, timeout: float = 10.0) -> AsyncClient:
        return cls(await Connection.open(address or default_address(), timeout=timeout))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.connection.close()

    async def create_stream(
        self,
        name: str,
        segments: int = 1,
        *,
        retention_time: str | int | dt.timedelta | None = None,
        retention_bytes: str | int | None = None,
    ) -> StreamInfo:
        """Create ``scope/name`` with a fixed number of segments. ``retention_time`` ("7d",
        milliseconds or a timedelta) and ``retention_bytes`` ("10GiB" or bytes) bound how much
        history is kept; without them, everything is kept. Raises StreamExists, InvalidName."""
        reply, _ = await self.connection.request(
            CreateStream(
                name, segments, _retention_ms(retention_time), _retention_bytes(retention_bytes)
            )
        )
        assert isinstance(reply, StreamInfo)
        return reply

    async def delete_stream(self, name: str) -> None:
        """Delete a stream and all its data. Readers following it get StreamNotFound."""
        await self.connection.request(DeleteStream(name))

    async def list_streams(self, scope: str | None = None) -> list[StreamInfo]:
        reply, _ = await self.connection.request(ListStreams(scope))
        assert isinstance(reply, StreamList)
        return reply.streams

    async def describe_stream(self, name: str) -> StreamInfo:
        """Segments with key ranges, offsets, bytes and first/last event timestamps."""
        reply, _ = await self.connection.request(DescribeStream(name))
        assert isinstance(reply, StreamInfo)
        return reply

    async def tail(self, stream: str) -> StreamCut:
        """The StreamCut of the current durable end: a bounded reader stops there."""
        return await tail_cut(self.connection, stream)

    async def producer(self, stream: str, **options: Any) -> AsyncProducer:
        """A producer for one stream; see :class:`Producer` for the options."""
        info = await self.describe_stream(stream)
        loop = asyncio.get_running_loop()
        return AsyncProducer(ProducerCore(self.connection, loop, stream, _router(info), **options))

    def reader(
        self, stream: str, start: Start = "earliest", end: StreamCut | None = None
    ) -> AsyncReader:
        """An async iterator of events; see :class:`Reader`."""
        return AsyncReader(self.connection, stream, start, end)


class AsyncProducer:
    """The asyncio producer. ``await send(...)`` waits only for buffer space, not for the
    acknowledgement: await the returned Receipt (or ``flush()``) for that."""

    def __init__(self, core: ProducerCore) -> None:
        self.core = core

    async def send(
        self,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> Receipt:
        await self.core.space_available()
        return self.core.send(value, key, headers, timestamp)

    async def send_many(
        self,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | None = None,
        timestamps: Sequence[int] | np.ndarray | None = None,
    ) -> BulkReceipt:
        await self.core.space_available()
        return self.core.send_many(values, keys, timestamps)

    async def flush(self) -> None:
        """Wait until every event sent so far is acknowledged; raises the first failure."""
        futures = self.core.flush_nowait()
        if futures:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    async def close(self) -> None:
        try:
            await self.flush()
        finally:
            self.core.closed = True

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncReader:
    """Events of a stream for asyncio code: ``async for event in reader`` or
    ``async for batch in reader.batches()``. Close it (or use ``async with``) to stop."""

    def __init__(
        self, connection: Connection, stream: str, start: Start, end: StreamCut | None
    ) -> None:
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.core = ReaderCore(connection, stream, start, end, self._queue.put_nowait)

    async def _positioned(self) -> AsyncIterator[tuple[int, int, pa.RecordBatch]]:
        remaining = set(await self.core.open())
        try:
            while remaining:
                delivery = await self._queue.get()
                if delivery.error is not None:
                    raise delivery.error
                if delivery.payload is None:
                    remaining.discard(delivery.segment)
                    continue
                for item in decode_delivery(delivery, self.core.starts, self.core.ends):
                    yield item
                self.core.grant(delivery.segment, len(delivery.payload))
        finally:
            await self.core.close()

    async def batches(self) -> AsyncIterator[pa.RecordBatch]:
        async for segment, base, record in self._positioned():
            yield with_position(segment, base, record)

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for segment, base, record in self._positioned():
            for event in events_of(record, segment, base):
                yield event

    async def close(self) -> None:
        await self.core.close()

    async def __aenter__(self) -> AsyncReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect_async(address: str | None = None, *, timeout: float = 10.0) -> AsyncClient:
    """Connect to a broker from asyncio code (``SLIPSTREAM_BROKER`` or 127.0.0.1:7070 by
    default). Raises BrokerUnavailable if none answers."""
    return await AsyncClient.connect(address, timeout=timeout)


# --- the blocking client ----------------------------------------------------------------------


class _LoopThread:
    """An event loop in a daemon thread, owned by one Client and stopped by its close()."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="slipstream-client", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class Client:
    """A blocking connection to a broker, safe to share between threads.

    Create with ``slipstream.connect("host:port")``; use as a context manager or call
    ``close()``. Every method raises the typed errors of ``slipstream.errors``.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 10.0) -> None:
        self._loop = _LoopThread()
        try:
            self._async = self._loop.run(AsyncClient.connect(address, timeout=timeout))
        except BaseException:
            self._loop.stop()
            raise
        self.address = self._async.connection.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.thread.is_alive():
            self._loop.run(self._async.close())
            self._loop.stop()

    def create_stream(
        self,
        name: str,
        segments: int = 1,
        *,
        retention_time: str | int | dt.timedelta | None = None,
        retention_bytes: str | int | None = None,
    ) -> StreamInfo:
        """Create ``scope/name``; see :meth:`AsyncClient.create_stream`."""
        return self._loop.run(
            self._async.create_stream(
                name, segments, retention_time=retention_time, retention_bytes=retention_bytes
            )
        )

    def delete_stream(self, name: str) -> None:
        self._loop.run(self._async.delete_stream(name))

    def list_streams(self, scope: str | None = None) -> list[StreamInfo]:
        return self._loop.run(self._async.list_streams(scope))

    def describe_stream(self, name: str) -> StreamInfo:
        return self._loop.run(self._async.describe_stream(name))

    def tail(self, stream: str) -> StreamCut:
        """The StreamCut of the current durable end of ``stream``."""
        return self._loop.run(self._async.tail(stream))

    def producer(
        self,
        stream: str,
        *,
        linger_ms: float = 5.0,
        batch_bytes: int = 1024 * 1024,
        compression: str | None = None,
        max_in_flight: int = 8,
        buffer_bytes: int = 64 * 1024 * 1024,
    ) -> Producer:
        """A producer for ``stream``.

        Events with the same key go to the same segment and keep their order; keyless events
        fill one segment's batch at a time. A batch is sent when it holds ``batch_bytes``, when
        ``linger_ms`` passed since its first event, or at once when nothing is in flight.
        ``compression``: None, "lz4" or "zstd" (Arrow IPC buffer compression). ``send`` blocks
        while more than ``buffer_bytes`` are waiting for acknowledgement (backpressure).
        """
        info = self.describe_stream(stream)
        core = ProducerCore(
            self._async.connection,
            self._loop.loop,
            stream,
            _router(info),
            linger_ms=linger_ms,
            batch_bytes=batch_bytes,
            compression=compression,
            max_in_flight=max_in_flight,
            buffer_bytes=buffer_bytes,
        )
        return Producer(core)

    def reader(
        self, stream: str, start: Start = "earliest", end: StreamCut | None = None
    ) -> Reader:
        """Iterate over the events of ``stream`` from ``start``.

        ``start``: "earliest", "latest", an ISO-8601 time or datetime (first events at or after
        it), milliseconds since the epoch, or a StreamCut. With ``end`` (a StreamCut, e.g.
        ``client.tail(stream)``) iteration stops there; without it, it follows the tail and
        yields new events as soon as they are durable. Raises OffsetOutOfRange if retention
        removed the start position.
        """
        return Reader(self._loop, self._async.connection, stream, start, end)


class Producer:
    """The blocking producer; see :meth:`Client.producer`. Use as a context manager: leaving
    the block flushes, so every event sent inside it is acknowledged (or raised) by then."""

    def __init__(self, core: ProducerCore) -> None:
        self.core = core

    def send(
        self,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> Receipt:
        """Queue one event; returns at once with a Receipt (``receipt.result()`` -> Position).

        ``timestamp`` is the event time in ms since the epoch (default: now). Raises
        BatchTooLarge for an event bigger than a batch.
        """
        return self.core.send(value, key, headers, timestamp)

    def send_many(
        self,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | None = None,
        timestamps: Sequence[int] | np.ndarray | None = None,
    ) -> BulkReceipt:
        """Queue many events column-wise: a list of bytes or an Arrow binary array. The
        fastest way in; with ``keys``, events are routed per key like ``send``."""
        return self.core.send_many(values, keys, timestamps)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every event sent so far is acknowledged; raises the first failure."""
        for future in self.core.flush_nowait():
            future.result(timeout)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.core.closed = True

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Reader:
    """The blocking reader; see :meth:`Client.reader`. Iterate for events, or call
    ``batches()`` for Arrow record batches (columns key, value, timestamp, headers, segment,
    offset) without per-event decoding."""

    def __init__(
        self,
        loop: _LoopThread,
        connection: Connection,
        stream: str,
        start: Start,
        end: StreamCut | None,
    ) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self.core = ReaderCore(connection, stream, start, end, self._queue.put)
        self._started = False

    def _positioned(self) -> Iterator[tuple[int, int, pa.RecordBatch]]:
        if self._started:
            raise InvalidArgument("a reader can be iterated once; create a new one to read again")
        self._started = True
        remaining = set(self._loop.run(self.core.open()))
        try:
            while remaining:
                delivery = self._queue.get()
                if delivery.error is not None:
                    raise delivery.error
                if delivery.payload is None:
                    remaining.discard(delivery.segment)
                    continue
                yield from decode_delivery(delivery, self.core.starts, self.core.ends)
                self._loop.call(self.core.grant, delivery.segment, len(delivery.payload))
        finally:
            self.close()

    def batches(self) -> Iterator[pa.RecordBatch]:
        for segment, base, record in self._positioned():
            yield with_position(segment, base, record)

    def __iter__(self) -> Iterator[Event]:
        for segment, base, record in self._positioned():
            yield from events_of(record, segment, base)

    def close(self) -> None:
        """Stop following; safe to call twice."""
        if self._loop.thread.is_alive():
            self._loop.run(self.core.close())

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str | None = None, *, timeout: float = 10.0) -> Client:
    """Connect to a broker (``SLIPSTREAM_BROKER`` or 127.0.0.1:7070 by default) and handshake.
    Raises BrokerUnavailable if none answers within ``timeout`` seconds."""
    return Client(address, timeout=timeout)
