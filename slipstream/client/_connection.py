"""One TCP connection to a broker: requests with correlation ids, and follow pushes.

Runs on an asyncio loop; the sync client runs that loop in a background thread.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Sequence
from typing import Any, cast

import pyarrow as pa

from .. import __version__
from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    ProtocolError,
    SlipstreamError,
    error_from_wire,
)
from ..protocol import (
    PROTOCOL_VERSION,
    Data,
    Error,
    FollowEnded,
    FollowFailed,
    Frame,
    FrameDecoder,
    Hello,
    Malformed,
    Message,
    Oversized,
    Payload,
    Welcome,
    encode_frame,
)

DEFAULT_ADDRESS = "127.0.0.1:7070"
#: Called with a pushed message (Data, FollowEnded, FollowFailed) and its payload, or with the
#: error that ended the connection.
FollowHandler = Callable[[Message | SlipstreamError, Payload], None]


def _pooled(size: int) -> memoryview:
    """Memory for one large received frame, from Arrow's pool, uninitialised.

    ``bytearray(size)`` of a 4 MiB Data frame gets fresh pages from the OS each time, which the
    kernel zero-fills on first touch (and on a VM that hands idle memory back to its host, that
    touch costs about ten times a warm one). The pool (mimalloc or jemalloc) hands the memory of
    frames the application has dropped out again, warm: a replay of 1 KiB events took 0.07
    instead of 0.10 s of client CPU per 200 MB. The broker takes plain malloc memory instead
    (``broker/_session.py::_unzeroed``): it holds the batches it receives (tail cache,
    transactions), so a pool would have to grow, and its new pages cost more than glibc's
    reused heap (a first produce run: broker CPU 0.21 -> 0.26-0.42 s). The memory is freed
    when the last view of it (payload, record batch) is gone.
    """
    return memoryview(pa.allocate_buffer(size)).cast("B")


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises InvalidArgument with the expected form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"broker address {address!r} must look like 127.0.0.1:7070")
    return host.strip("[]"), int(port)


class Connection(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.decoder = FrameDecoder(1 << 30, allocate=_pooled)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[tuple[Message, Payload]]] = {}
        self.follows: dict[int, FollowHandler] = {}
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed: SlipstreamError | None = None
        self.address = "?"
        self.max_batch_bytes = 8 * 1024 * 1024
        self.broker_version = "?"
        self._ids = itertools.count(1)
        self.follow_ids = itertools.count(1)

    @classmethod
    async def open(
        cls, address: str, *, client_name: str = "slipstream-python", timeout: float = 10.0
    ) -> Connection:
        """Connect and handshake; raises BrokerUnavailable with the address if nobody answers."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):  # no inner task to orphan if we are cancelled
                _, connection = await loop.create_connection(cls, host, port)
        except (OSError, TimeoutError) as exc:
            raise BrokerUnavailable(
                f"no broker at {address} ({exc}); start one with 'slipstream up' or pass "
                "--broker / SLIPSTREAM_BROKER",
                address=address,
            ) from exc
        connection.address = address
        try:
            welcome, _ = await asyncio.wait_for(
                connection.request(Hello(PROTOCOL_VERSION, f"{client_name}/{__version__}")),
                timeout,
            )
        except BaseException:
            connection.close()
            raise
        if not isinstance(welcome, Welcome):
            raise ProtocolError(f"expected Welcome, got {type(welcome).__name__}")
        connection.max_batch_bytes = welcome.max_batch_bytes
        connection.broker_version = welcome.broker_version
        return connection

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=16 * 1024 * 1024)

    def connection_lost(self, exc: Exception | None) -> None:
        self._shutdown(
            BrokerUnavailable(f"connection to {self.address} lost" + (f": {exc}" if exc else ""))
        )

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        try:
            while (item := self.decoder.next_item()) is not None:
                if isinstance(item, Frame):
                    self._deliver(item)
                elif isinstance(item, Oversized | Malformed):
                    raise ProtocolError(f"broker sent a bad frame: {item}")
        except ProtocolError as exc:
            self._shutdown(exc)
            if self.transport is not None:
                self.transport.close()

    def _deliver(self, frame: Frame) -> None:
        message = frame.message
        if frame.correlation_id == 0:
            if isinstance(message, Data | FollowEnded | FollowFailed):
                handler = self.follows.get(message.sub_id)
                if handler is not None:
                    handler(message, frame.payload)
            elif isinstance(message, Error):  # the broker is closing this connection
                self._shutdown(error_from_wire(message.code, message.message, message.details))
            return
        future = self.pending.pop(frame.correlation_id, None)
        if future is None or future.done():
            return
        if isinstance(message, Error):
            future.set_exception(error_from_wire(message.code, message.message, message.details))
        else:
            future.set_result((message, frame.payload))

    def _shutdown(self, error: SlipstreamError) -> None:
        if self.closed is not None:
            return
        self.closed = error
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        follows, self.follows = self.follows, {}
        for handler in follows.values():
            handler(error, bytearray())
        self.writable.set()

    # --- requests ----------------------------------------------------------------------------

    def send_request(
        self, message: Message, payload: Sequence[Any] = ()
    ) -> asyncio.Future[tuple[Message, Payload]]:
        """Send a request now; the future resolves with the response or a typed error."""
        future: asyncio.Future[tuple[Message, Payload]] = asyncio.get_running_loop().create_future()
        if self.closed is not None:
            future.set_exception(self.closed)
            return future
        assert self.transport is not None
        correlation_id = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        self.pending[correlation_id] = future
        length = sum(len(p) for p in payload)
        head = encode_frame(message, correlation_id, length)
        if payload:
            self.transport.writelines([head, *payload])
        else:
            self.transport.write(head)
        return future

    async def request(
        self, message: Message, payload: Sequence[Any] = ()
    ) -> tuple[Message, Payload]:
        return await self.send_request(message, payload)

    def send_oneway(self, message: Message) -> None:
        """Send a message that has no response (Credit)."""
        if self.closed is None and self.transport is not None:
            self.transport.write(encode_frame(message, 0))

    def close(self, error: SlipstreamError | None = None) -> None:
        """Close; pending requests fail with ``error`` (default: closed by the client)."""
        if self.transport is not None:
            self.transport.abort()
        self._shutdown(error or BrokerUnavailable("connection closed by the client"))
