"""One client connection of the binary protocol: feeds bytes to the frame codec, turns frames
into calls of the service layer (``_service.py``, where the operations live), and pushes follows.

Flow control both ways: a connection with more than ``MAX_PENDING_APPEND_BYTES`` of appends
not yet durable stops being read (TCP backpressure reaches the producer), and follows push
only while the client has granted credit and the socket is writable.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import __version__
from .._errors import (
    BatchTooLarge,
    InvalidArgument,
    ProtocolError,
    SlipstreamError,
    UnsupportedVersion,
)
from ..format import decode_header
from ..protocol import (
    PROTOCOL_VERSION,
    Append,
    AppendAck,
    BeginTxn,
    ClaimProducer,
    CreateStream,
    Credit,
    Cut,
    Data,
    DeleteStream,
    DescribeStream,
    Done,
    EndTxn,
    Error,
    Follow,
    FollowEnded,
    FollowFailed,
    Frame,
    FrameDecoder,
    GetCut,
    GetIdentity,
    Hello,
    InitProducer,
    ListStreams,
    ListTxns,
    Malformed,
    Message,
    Oversized,
    Payload,
    ProducerGrant,
    StreamList,
    TxnBegun,
    TxnList,
    Unfollow,
    Welcome,
    encode_frame,
)
from ._container import BATCH_ALIGNMENT
from ._service import Caller

if TYPE_CHECKING:
    from ._broker import Broker
    from ._segment import Segment

log = logging.getLogger("slipstream.session")

MAX_PENDING_APPEND_BYTES = 32 * 1024 * 1024
MAX_DATA_FRAME_BYTES = 4 * 1024 * 1024


def _unzeroed(size: int) -> memoryview:
    """Memory for one large received frame: from malloc, like ``bytearray(size)``, but not
    zero-filled first, since the socket overwrites all of it. ``perf`` put 11% of a bulk
    produce's broker samples in that ``memset``. (Arrow's pool, as the client uses, made the
    broker's first produce run slower: it keeps what it receives, so the pool grew into new
    pages; malloc hands back the heap the previous frames freed.)"""
    return np.empty(size, np.uint8).data


@dataclass(eq=False)
class _Follow:
    sub_id: int
    segment: Segment
    offset: int
    end_offset: int | None
    credit: int
    credited: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Session(asyncio.BufferedProtocol):
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.service = broker.service
        self.caller: Caller | None = None
        self.decoder = FrameDecoder(
            broker.config.max_batch_bytes + 64 * 1024,
            allocate=_unzeroed,
            align_payload=BATCH_ALIGNMENT,  # so the journal writes large batches in place
        )
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.greeted = False
        self.pending_bytes = 0
        self.reading_paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.follows: dict[int, _Follow] = {}
        self.tasks: set[asyncio.Task[Any]] = set()

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.caller = self.service.connect(self.peer)
        transport.set_write_buffer_limits(high=8 * 1024 * 1024)
        self.broker.sessions.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.broker.sessions.discard(self)
        if self.caller is not None:
            self.service.disconnect(self.caller)
        for task in self.tasks:
            task.cancel()
        self.writable.set()

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
                self._dispatch(item)
        except ProtocolError as exc:
            self._fatal(exc)

    # --- plumbing ----------------------------------------------------------------------------

    def send(
        self, message: Message, correlation_id: int = 0, payload: list[Any] | None = None
    ) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if payload:
            length = sum(len(p) for p in payload)
            transport.writelines([encode_frame(message, correlation_id, length), *payload])
        else:
            transport.write(encode_frame(message, correlation_id))

    def send_error(self, correlation_id: int, exc: SlipstreamError) -> None:
        self.send(Error(exc.code, exc.message, exc.details), correlation_id)

    def _fatal(self, exc: SlipstreamError, correlation_id: int = 0) -> None:
        log.warning("closing connection from %s: %s", self.peer, exc)
        self.send_error(correlation_id, exc)
        if self.transport is not None:
            self.transport.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # --- requests ----------------------------------------------------------------------------

    def _dispatch(self, item: Frame | Oversized | Malformed) -> None:
        if isinstance(item, Oversized):
            self.send_error(
                item.correlation_id,
                BatchTooLarge(
                    f"frame of {item.frame_length} bytes exceeds the broker's limit of "
                    f"{self.broker.config.max_batch_bytes} bytes per batch; send smaller batches",
                    limit=self.broker.config.max_batch_bytes,
                    size=item.frame_length,
                ),
            )
            return
        if isinstance(item, Malformed):
            self.send_error(item.correlation_id, ProtocolError(item.reason))
            return
        message, cid = item.message, item.correlation_id
        if not self.greeted:
            self._hello(message, cid)
            return
        try:
            if isinstance(message, Append):
                self._append(message, cid, item.payload)
            elif isinstance(message, Credit):
                self._credit(message)
            else:
                self._spawn(self._request(message, cid))
        except SlipstreamError as exc:
            self.send_error(cid, exc)

    def _hello(self, message: Message, cid: int) -> None:
        if not isinstance(message, Hello):
            self._fatal(ProtocolError("the first frame must be Hello"), cid)
            return
        if message.protocol_version != PROTOCOL_VERSION:
            self._fatal(
                UnsupportedVersion(
                    f"client speaks protocol {message.protocol_version}, this broker speaks "
                    f"{PROTOCOL_VERSION}; upgrade the older side",
                    supported=PROTOCOL_VERSION,
                ),
                cid,
            )
            return
        self.greeted = True
        log.debug("hello from %s (%s)", self.peer, message.client_name)
        self.send(Welcome(PROTOCOL_VERSION, __version__, self.broker.config.max_batch_bytes), cid)

    def _append(self, message: Append, cid: int, batch: Payload) -> None:
        assert self.caller is not None
        future, header = self.service.append(
            self.caller, message.stream, message.segment, message.txn, batch
        )
        size = len(batch)
        self.pending_bytes += size
        if (
            self.pending_bytes > MAX_PENDING_APPEND_BYTES
            and self.transport
            and not self.reading_paused
        ):
            self.reading_paused = True
            self.transport.pause_reading()

        def acknowledge(done: asyncio.Future[int] | asyncio.Future[None]) -> None:
            self.pending_bytes -= size
            if self.reading_paused and self.pending_bytes <= MAX_PENDING_APPEND_BYTES // 2:
                self.reading_paused = False
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.resume_reading()
            exc = done.exception()
            if exc is None:
                base = done.result()  # None: staged in a transaction, no offset yet
                self.send(AppendAck(-1 if base is None else base, header.event_count), cid)
            elif isinstance(exc, SlipstreamError):
                self.send_error(cid, exc)
            else:
                log.error("append failed unexpectedly", exc_info=exc)
                self.send_error(cid, SlipstreamError(f"internal error: {exc}"))

        future.add_done_callback(acknowledge)

    async def _request(self, message: Message, cid: int) -> None:
        try:
            reply = await self._handle(message)
        except SlipstreamError as exc:
            self.send_error(cid, exc)
        except Exception as exc:
            log.exception("request %s failed", type(message).__name__)
            self.send_error(cid, SlipstreamError(f"internal error: {exc}"))
        else:
            self.send(reply, cid)

    async def _handle(self, message: Message) -> Message:
        service, caller = self.service, self.caller
        assert caller is not None
        match message:
            case CreateStream(name, segments, retention_ms, retention_bytes):
                return await service.create_stream(
                    caller, name, segments, retention_ms, retention_bytes
                )
            case DeleteStream(name):
                await service.delete_stream(caller, name)
                return Done()
            case ListStreams(scope):
                return StreamList(service.list_streams(caller, scope))
            case DescribeStream(name):
                return service.describe_stream(caller, name)
            case GetCut(stream, at, timestamp_ms):
                return Cut(stream, await service.cut(caller, stream, at, timestamp_ms))
            case Follow():
                return self._follow(message)
            case Unfollow(sub_id):
                follow = self.follows.pop(sub_id, None)
                if follow is not None and follow.task is not None:
                    follow.task.cancel()
                return Done()
            case InitProducer(transactional_id):
                return ProducerGrant(*await service.init_producer(caller, transactional_id))
            case ClaimProducer(producer_id, epoch, token):
                service.claim_producer(caller, producer_id, epoch, token)
                return Done()
            case BeginTxn(producer_id, epoch, timeout_ms, label):
                return TxnBegun(
                    await service.begin_txn(caller, producer_id, epoch, timeout_ms, label)
                )
            case EndTxn(txn_id, commit, metadata, merge, operator):
                return await service.end_txn(
                    caller, txn_id, commit, metadata, merge, operator=operator
                )
            case ListTxns():
                return TxnList(service.list_txns(caller))
            case GetIdentity(transactional_id):
                return service.identity(caller, transactional_id)
            case Hello():
                raise ProtocolError("Hello was already sent on this connection")
        raise ProtocolError(f"{type(message).__name__} is not a request")

    # --- follows -----------------------------------------------------------------------------

    def _follow(self, message: Follow) -> Message:
        if message.sub_id in self.follows:
            raise InvalidArgument(f"follow id {message.sub_id} is already in use")
        if message.offset < 0 or message.credit < 0:
            raise InvalidArgument("offset and credit must not be negative")
        assert self.caller is not None
        segment = self.service.segment(self.caller, message.stream, message.segment)
        follow = _Follow(
            message.sub_id, segment, message.offset, message.end_offset, message.credit
        )
        self.follows[message.sub_id] = follow
        follow.task = self._spawn(self._pump(follow))
        return Done()

    def _credit(self, message: Credit) -> None:
        follow = self.follows.get(message.sub_id)
        if follow is not None:
            follow.credit += message.credit
            follow.credited.set()

    async def _pump(self, follow: _Follow) -> None:
        segment, service, caller = follow.segment, self.service, self.caller
        assert caller is not None
        try:
            while True:
                if follow.end_offset is not None and follow.offset >= follow.end_offset:
                    self.send(FollowEnded(follow.sub_id, follow.offset))
                    self.follows.pop(follow.sub_id, None)
                    return
                while follow.credit <= 0:
                    follow.credited.clear()
                    await follow.credited.wait()
                await self.writable.wait()
                batches = await service.read(
                    caller, segment, follow.offset, min(follow.credit, MAX_DATA_FRAME_BYTES)
                )
                if not batches:
                    if follow.offset >= segment.next_offset and not segment.deleted:
                        await segment.wait_for_change()
                    continue
                if follow.end_offset is not None:
                    batches = [
                        b for b in batches if decode_header(b).base_offset < follow.end_offset
                    ]
                follow.offset = decode_header(batches[-1]).next_offset
                follow.credit -= sum(len(b) for b in batches)
                self.send(Data(follow.sub_id), 0, batches)
        except SlipstreamError as exc:
            self.follows.pop(follow.sub_id, None)
            self.send(FollowFailed(follow.sub_id, exc.code, exc.message, exc.details))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("follow %d failed", follow.sub_id)
            self.follows.pop(follow.sub_id, None)
            self.send(FollowFailed(follow.sub_id, "internal", f"internal error: {exc}"))
