"""One client connection of the binary protocol: feeds bytes to the frame codec, turns frames
into calls of the service layer (``_service.py``, where the operations live), and pushes follows.

Flow control both ways: a connection with more than ``MAX_PENDING_APPEND_BYTES`` of appends
not yet durable stops being read (TCP backpressure reaches the producer), and follows push
only while the client has granted credit and the socket is writable.

Bounds (``ConnectionLimits``), so that a slow, silent or dead client cannot pin memory or a
connection: TCP keepalive (and ``TCP_USER_TIMEOUT``) finds dead peers; a connection that sends
no Hello in time, or nothing at all for ``idle_timeout`` while it has no follow, request or
append open, is closed with ``idle_timeout``; one whose socket takes no bytes for
``write_timeout`` is dropped; follows, requests awaiting an answer and a follow's unused
credit are capped with typed errors; at most ``MAX_CONCURRENT_READS`` follow reads per
connection are in memory at once. What one connection can hold is then about: the write
buffer's high-water mark (8 MiB) plus those reads (4 x 4 MiB), appends not yet durable
(32 MiB) and one frame being received (``--max-batch`` + 64 KiB).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .. import __version__
from .._errors import (
    AuthenticationFailed,
    BatchTooLarge,
    CreditLimitExceeded,
    IdleTimeout,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    ProtocolError,
    SegmentNotFound,
    SlipstreamError,
    StreamNotFound,
    TlsError,
    TooManyFollows,
    TooManyRequests,
    UnsupportedVersion,
)
from .._tls import TLS_HANDSHAKE_BYTE
from ..format import decode_header
from ..protocol import (
    PROTOCOL_VERSION,
    Append,
    AppendAck,
    AppendAudit,
    ApplyBatch,
    BeginTxn,
    CheckAccess,
    ClaimProducer,
    CommitPositions,
    CreateStream,
    CreateSubscription,
    CreateToken,
    Credit,
    Cut,
    Data,
    DeleteStream,
    DeleteSubscription,
    DescribeCluster,
    DescribeStream,
    DescribeSubscription,
    Done,
    EndSeal,
    EndTxn,
    Error,
    EventsDelivered,
    EventsFound,
    FetchEvents,
    FindEvents,
    Follow,
    FollowEnded,
    FollowFailed,
    FoundEvent,
    Frame,
    FrameDecoder,
    GetCut,
    GetIdentity,
    GetScaleHistory,
    GrantRule,
    GroupJoined,
    HandOverIdentity,
    Hello,
    HoldPositions,
    IdentityList,
    InitProducer,
    JoinGroup,
    LeaveGroup,
    ListIdentities,
    ListQuotas,
    ListRules,
    ListStreams,
    ListSubscriptions,
    ListTokens,
    ListTxns,
    Malformed,
    Message,
    Oversized,
    Payload,
    PollGroup,
    PrepareSeal,
    ProducerGrant,
    QuotaList,
    ReadSegment,
    ReleasePositions,
    ResetSubscription,
    RevokeRule,
    RevokeToken,
    RuleList,
    ScaleHistory,
    ScaleStream,
    SegmentData,
    SetQuota,
    Settled,
    SettleEvents,
    StreamList,
    SubscriptionList,
    TokenList,
    TxnBegun,
    TxnList,
    Unfollow,
    UpdateStream,
    Welcome,
    encode_frame,
)
from ..security._quotas import CONSUME, PRODUCE, REQUESTS
from ._container import BATCH_ALIGNMENT
from ._service import Caller, decision_message, rule_message

if TYPE_CHECKING:
    from ._broker import Broker
    from ._segment import Segment

log = logging.getLogger("slipstream.session")

MAX_PENDING_APPEND_BYTES = 32 * 1024 * 1024
MAX_DATA_FRAME_BYTES = 4 * 1024 * 1024
MAX_CONCURRENT_READS = 4  # follow reads of one connection in memory at once
WRITE_BUFFER_HIGH = 8 * 1024 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection bounds (docs/operations.md lists them with what a client sees)."""

    hello_timeout: float = 10.0  #: seconds from connect to Hello
    #: seconds without a received frame after which a connection with no follow, request or
    #: append open is closed (checked about once per this period)
    idle_timeout: float = 300.0
    write_timeout: float = 300.0  #: seconds a socket may take no bytes before it is dropped
    keepalive_idle: int = 60  #: seconds of silence before TCP keepalive probes
    keepalive_interval: int = 10
    keepalive_count: int = 6
    max_follows: int = 4096  #: open follows (a reader opens one per segment, up to 1024)
    max_requests: int = 4096  #: requests and appends awaiting their answer
    max_follow_credit: int = 256 * 1024 * 1024  #: unused credit of one follow, in bytes


def _unzeroed(size: int) -> memoryview:
    """Memory for one large received frame: from malloc, like ``bytearray(size)``, but not
    zero-filled first, since the socket overwrites all of it. ``perf`` put 11% of a bulk
    produce's broker samples in that ``memset``. (Arrow's pool, as the client uses, made the
    broker's first produce run slower: it keeps what it receives, so the pool grew into new
    pages; malloc hands back the heap the previous frames freed.)"""
    return np.empty(size, np.uint8).data


@dataclass(frozen=True, slots=True)
class _WithPayload:
    """An answer that carries data after its message (EventsDelivered's batches)."""

    message: Message
    payload: list[Any]


@dataclass(eq=False)
class _Follow:
    sub_id: int
    segment: Segment
    offset: int
    end_offset: int | None
    credit: int
    credited: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


def _keepalive(sock: Any, limits: ConnectionLimits) -> None:
    """TCP keepalive, so that a peer that vanished (power off, a cut cable) is noticed while the
    connection is quiet, and a user timeout for when it is not (data sent but never acked)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; macOS names the first TCP_KEEPALIVE
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, limits.keepalive_idle)
    if hasattr(socket, "TCP_KEEPINTVL"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, limits.keepalive_interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, limits.keepalive_count)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # not shorter than the write timeout
        probing = limits.keepalive_idle + limits.keepalive_interval * limits.keepalive_count
        user_timeout = max(probing, limits.write_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout * 1000))


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
        self._first_bytes = True  # nothing received yet (a TLS ClientHello is told apart)
        self._buffer = memoryview(b"")  # the first buffer handed to the transport, until it is read
        self.pending_bytes = 0
        self.reading_paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.follows: dict[int, _Follow] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.requests: set[asyncio.Task[Any]] = set()  # of self.tasks: run to the end
        self.limits: ConnectionLimits = broker.config.connection
        self.in_flight = 0  # requests and appends not answered yet
        self.read_slots = asyncio.Semaphore(MAX_CONCURRENT_READS)
        self.last_received = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._quota_timer: asyncio.TimerHandle | None = None  # reading held by a quota
        self._expiry_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock, self.limits)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.caller = self.service.connect(self.peer)
        self.caller.end = self._close  # a revoked or expired token ends the connection
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self.broker.sessions.add(self)
        loop = asyncio.get_running_loop()
        self.last_received = loop.time()
        self._idle_timer = loop.call_later(self.limits.hello_timeout, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.broker.sessions.discard(self)
        if self._quota_timer is not None:
            self._quota_timer.cancel()
        if self.caller is not None:
            self.service.disconnect(self.caller)
        for timer in (self._idle_timer, self._stall_timer, self._expiry_timer):
            if timer is not None:
                timer.cancel()
        # follows stop with the connection; requests run to their end (their answer goes
        # nowhere), so that a change a request began (a commit, a reset) is never half made:
        # stored but not applied to the live state. Only a stopping broker cancels them.
        stopping = self.broker.stopping
        for task in self.tasks:
            if stopping or task not in self.requests:
                task.cancel()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()
        if self._stall_timer is None:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self.limits.write_timeout, self._write_stalled
            )

    def resume_writing(self) -> None:
        self.writable.set()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def get_buffer(self, sizehint: int) -> memoryview:
        buffer = self.decoder.get_buffer(sizehint)
        if self._first_bytes:  # kept only until the first bytes arrive
            self._buffer = buffer
        return buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = asyncio.get_running_loop().time()
        if not self.greeted and self._first_bytes and nbytes:
            self._first_bytes = False
            first, self._buffer = self._buffer[0], memoryview(b"")
            if first == TLS_HANDSHAKE_BYTE and self.broker.tls is None:
                # a TLS client's ClientHello: say so now, rather than read it as a frame
                self._fatal(
                    TlsError(
                        "this broker does not use TLS (started without --tls-cert); connect "
                        "without tls=True / --tls / SLIPSTREAM_TLS_CA"
                    )
                )
                return
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
        self.broker.metrics.rejected(exc.code)
        self.send(Error(exc.code, exc.message, exc.details), correlation_id)

    def _fatal(self, exc: SlipstreamError, correlation_id: int = 0) -> None:
        log.warning("closing connection from %s: %s", self.peer, exc)
        if not self.greeted and not isinstance(exc, AuthenticationFailed):  # that one is
            # audited where it is decided; any other refusal before Hello is audited here
            # (a TLS client on a plaintext port, garbage, a wrong protocol version, a quota)
            self.service.audit.record(
                "connection_refused", subject=None, peer=self.peer, reason=exc.code
            )
        self.send_error(correlation_id, exc)
        if self.transport is not None:
            self.transport.close()

    def _check_idle(self) -> None:
        """Close a connection that never said Hello, or that has been silent for
        ``idle_timeout`` with nothing open; otherwise look again later."""
        self._idle_timer = None
        transport, limits = self.transport, self.limits
        if transport is None or transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        if not self.greeted:
            self._close(
                IdleTimeout(
                    f"no Hello within {limits.hello_timeout:g} s of connecting; connect again "
                    "and send Hello first",
                    timeout=limits.hello_timeout,
                )
            )
            return
        silent = loop.time() - self.last_received
        busy = self.follows or self.in_flight or self.pending_bytes
        if not busy and silent >= limits.idle_timeout:
            self._close(
                IdleTimeout(
                    f"nothing received for {silent:.0f} s with no follow or request open "
                    f"(limit {limits.idle_timeout:g} s); connect again when there is work",
                    timeout=limits.idle_timeout,
                )
            )
            return
        wait = limits.idle_timeout - silent if not busy else limits.idle_timeout
        self._idle_timer = loop.call_later(max(wait, 0.01), self._check_idle)

    def _close(self, exc: SlipstreamError) -> None:
        log.info("closing connection from %s: %s", self.peer, exc)
        self.send_error(0, exc)
        if self.transport is not None:
            self.transport.close()

    def _write_stalled(self) -> None:
        self._stall_timer = None
        if self.transport is not None and not self.transport.is_closing():
            log.warning(
                "dropping connection from %s: its socket took no bytes for %g s",
                self.peer,
                self.limits.write_timeout,
            )
            self.transport.abort()  # close() would wait for a flush that never comes

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _spawn_request(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._spawn(coro)
        self.requests.add(task)
        task.add_done_callback(self.requests.discard)

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
        if isinstance(message, Credit):
            self._credit(message)
            return
        if self.in_flight >= self.limits.max_requests:
            self.send_error(
                cid,
                TooManyRequests(
                    f"{self.in_flight} requests on this connection await their answer (limit "
                    f"{self.limits.max_requests}); wait for answers before sending more",
                    limit=self.limits.max_requests,
                ),
            )
            return
        if isinstance(message, ApplyBatch):  # here, not in a task: batches keep their order
            try:
                self._apply_batch(message, cid, item.payload)
            except SlipstreamError as exc:
                self.send_error(cid, exc)
            return
        try:
            if isinstance(message, Append):
                self._append(message, cid, item.payload)
            else:
                self.in_flight += 1
                self._spawn_request(self._request(message, cid))
        except (StreamNotFound, SegmentNotFound) as exc:
            if not self.service.cluster.enabled:
                self.send_error(cid, exc)
                return
            # made by another broker a moment ago? Known once the catalog is read again
            assert isinstance(message, Append)
            self.in_flight += 1
            self._spawn_request(self._append_after_refresh(message, cid, item.payload))
        except SlipstreamError as exc:
            self.send_error(cid, exc)

    async def _append_after_refresh(self, message: Append, cid: int, batch: Payload) -> None:
        """An append to a stream or segment unknown here, in a cluster: tried once more after
        the catalog is read again (refreshes run in order, so appends retried this way keep
        the order they came in)."""
        self.in_flight -= 1
        try:
            # a refresh running meanwhile may have read it already: retry whatever this says
            await self.broker.refresh_catalog()
            self._append(message, cid, batch)
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
        if self.service.auth:
            assert self.caller is not None
            try:
                self.service.authenticate(
                    self.caller, message.credentials, self._certificate_subject()
                )
            except AuthenticationFailed as exc:
                self._fatal(exc, cid)
                return
            self._watch_expiry()
        assert self.caller is not None
        try:
            self.service.admit(self.caller)  # the connection quota of its token's scope
        except LimitExceeded as exc:
            self._fatal(exc, cid)
            return
        self.greeted = True
        # from now on the idle rule applies: look first after idle_timeout, not hello_timeout
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self.limits.idle_timeout, self._check_idle)
        log.debug("hello from %s (%s)", self.peer, message.client_name)
        self.send(Welcome(PROTOCOL_VERSION, __version__, self.broker.config.max_batch_bytes), cid)

    def _certificate_subject(self) -> str | None:
        """The common name of the client certificate the TLS layer verified against
        ``--tls-client-ca`` (None without mutual TLS or without a CN)."""
        tls = self.broker.config.tls
        if tls is None or tls.client_ca is None or self.transport is None:
            return None
        certificate = self.transport.get_extra_info("peercert")
        for entry in (certificate or {}).get("subject", ()):
            for name, value in entry:
                if name == "commonName" and value:
                    return str(value)
        return None

    def _watch_expiry(self) -> None:
        """A token's connection ends when the token expires, not at its next request: an
        expired token holds nothing open, follows included."""
        principal = self.caller.principal if self.caller is not None else None
        if principal is None or principal.expires_at is None:
            return
        loop = asyncio.get_running_loop()
        left = max(0.0, principal.expires_at - time.time())
        self._expiry_timer = loop.call_later(left, self._expired)

    def _expired(self) -> None:
        self._expiry_timer = None
        principal = self.caller.principal if self.caller is not None else None
        self.service.audit.record(
            "authentication_failed",
            subject=principal.subject if principal else None,
            peer=self.peer,
            reason="expired",
            token_id=principal.token_id if principal else None,
        )
        self._close(
            AuthenticationFailed(
                "authentication failed: the token has expired; connect again with a new one",
                reason="expired",
            )
        )

    def _apply_batch(self, message: ApplyBatch, cid: int, batch: Payload) -> None:
        """Another broker's committed transaction's batch for a segment served here (or,
        without a batch, its question for the next sequence): answered with AppendAck."""
        assert self.caller is not None
        future, count = self.service.apply_batch(
            self.caller, message.stream, message.segment, message.producer_id, message.epoch, batch
        )
        self.in_flight += 1

        def answered(done: asyncio.Future[int]) -> None:
            self.in_flight -= 1
            exc = done.exception()
            if exc is None:
                self.send(AppendAck(done.result(), count), cid)
            elif isinstance(exc, SlipstreamError):
                self.send_error(cid, exc)
            else:
                log.error("a transaction's batch failed unexpectedly", exc_info=exc)
                self.send_error(cid, SlipstreamError(f"internal error: {exc}"))

        future.add_done_callback(answered)

    def _append(self, message: Append, cid: int, batch: Payload) -> None:
        started = time.perf_counter()
        assert self.caller is not None
        future, header = self.service.append(
            self.caller, message.stream, message.segment, message.txn, batch
        )
        self.in_flight += 1
        size = len(batch)
        self.pending_bytes += size
        scope = self.service.quota_scope(self.caller, message.stream)
        delay = max(self._throttle(PRODUCE, scope, size), self._throttle(REQUESTS, scope, 1))
        if (
            self.pending_bytes > MAX_PENDING_APPEND_BYTES
            and self.transport
            and not self.reading_paused
        ):
            self.reading_paused = True
            self.transport.pause_reading()

        def acknowledge(done: asyncio.Future[int] | asyncio.Future[None]) -> None:
            self.in_flight -= 1
            self.pending_bytes -= size
            if self.reading_paused and self.pending_bytes <= MAX_PENDING_APPEND_BYTES // 2:
                self.reading_paused = False
                transport = self.transport
                if transport and not transport.is_closing() and self._quota_timer is None:
                    transport.resume_reading()
            exc = done.exception()
            if exc is None:
                base = done.result()  # None: staged in a transaction, no offset yet
                self.send(AppendAck(-1 if base is None else base, header.event_count), cid)
                self.broker.metrics.appended(started)
            elif isinstance(exc, LeaseLost) and self.service.cluster.enabled:
                # not acknowledged, and the container is moving: the client retries at its
                # next holder (an idempotent producer's retry is deduplicated there)
                container = int(exc.details.get("container", 0))
                self.send_error(cid, self.service.cluster.wrong_broker(container, str(exc)))
            elif isinstance(exc, SlipstreamError):
                self.send_error(cid, exc)
            else:
                log.error("append failed unexpectedly", exc_info=exc)
                self.send_error(cid, SlipstreamError(f"internal error: {exc}"))

        if delay:  # over a quota: acknowledged when durable and the delay has passed
            due = asyncio.get_running_loop().time() + delay
            future.add_done_callback(
                lambda done: asyncio.get_running_loop().call_at(due, acknowledge, done)
            )
            return
        future.add_done_callback(acknowledge)

    async def _request(self, message: Message, cid: int) -> None:
        try:
            assert self.caller is not None
            stream = getattr(message, "stream", None) or getattr(message, "name", None)
            scope = self.service.quota_scope(
                self.caller, stream if isinstance(stream, str) else None
            )
            delay = self._throttle(REQUESTS, scope, 1)
            if delay:  # over the request quota: answered later, not refused
                await asyncio.sleep(delay)
            try:
                reply = await self._handle(message)
            except (StreamNotFound, SegmentNotFound):
                # in a cluster: made by another broker a moment ago? Once more after a refresh
                if not self.service.cluster.enabled:
                    raise
                await self.broker.refresh_catalog()  # (it may have been read meanwhile)
                reply = await self._handle(message)
        except SlipstreamError as exc:
            self.send_error(cid, exc)
        except Exception as exc:
            log.exception("request %s failed", type(message).__name__)
            self.send_error(cid, SlipstreamError(f"internal error: {exc}"))
        else:
            if isinstance(reply, _WithPayload):
                self.send(reply.message, cid, reply.payload)
            else:
                self.send(reply, cid)
        finally:
            self.in_flight -= 1

    async def _handle(self, message: Message) -> Message | _WithPayload:
        service, caller = self.service, self.caller
        assert caller is not None
        match message:
            case CreateStream(name, segments, retention_ms, retention_bytes, scaling):
                return await service.create_stream(
                    caller, name, segments, retention_ms, retention_bytes, scaling
                )
            case UpdateStream(name, retention_ms, retention_bytes, scaling):
                return await service.update_stream(
                    caller, name, retention_ms, retention_bytes, scaling
                )
            case DeleteStream(name):
                await service.delete_stream(caller, name)
                return Done()
            case ListStreams(scope, local):
                return StreamList(await service.list_streams_live(caller, scope, local))
            case DescribeStream(name, local):
                return await service.stream_info(caller, name, local)
            case GetCut(stream, at, timestamp_ms, local):
                return Cut(stream, await service.cut(caller, stream, at, timestamp_ms, local))
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
            case EndTxn(txn_id, commit, metadata, merge, operator, positions):
                return await service.end_txn(
                    caller, txn_id, commit, metadata, merge, operator=operator, positions=positions
                )
            case CreateSubscription(stream, name, mode, at, timestamp_ms, positions, options):
                return await service.create_subscription(
                    caller, stream, name, mode, at, timestamp_ms, positions, options
                )
            case ListSubscriptions(stream):
                return SubscriptionList(service.list_subscriptions(caller, stream))
            case DescribeSubscription(stream, name, local):
                return await service.describe_subscription(caller, stream, name, local)
            case DeleteSubscription(stream, name):
                await service.delete_subscription(caller, stream, name)
                return Done()
            case ResetSubscription(stream, name, at, timestamp_ms, positions):
                return await service.reset_subscription(
                    caller, stream, name, at, timestamp_ms, positions
                )
            case JoinGroup(stream, subscription, mode, member_name, session_timeout_ms):
                return GroupJoined(
                    *service.join_group(
                        caller, stream, subscription, mode, member_name, session_timeout_ms
                    )
                )
            case PollGroup(member_id, released, wait_ms):
                return await service.poll_group(caller, member_id, released, wait_ms)
            case CommitPositions(stream, subscription, member_id, generation, positions):
                await service.commit_positions(
                    caller, stream, subscription, member_id, generation, positions
                )
                return Done()
            case ScaleStream(stream, segments, into):
                return await service.scale_stream(caller, stream, segments, into)
            case PrepareSeal(stream, segments, epoch, coordinator, wait_ms, max_rate):
                return await service.prepare_seal(
                    caller, stream, segments, epoch, coordinator, wait_ms, max_rate
                )
            case EndSeal(stream, segments, epoch, committed):
                await service.end_seal(caller, stream, segments, epoch, committed)
                return Done()
            case GetScaleHistory(stream):
                return ScaleHistory(stream, service.scale_history(caller, stream))
            case LeaveGroup(member_id):
                service.leave_group(caller, member_id)
                return Done()
            case FetchEvents(member_id, max_events, wait_ms):
                deliveries, batches = await service.fetch_events(
                    caller, member_id, max_events, wait_ms
                )
                members = service.subscriptions.members
                self.broker.metrics.delivered(members.get(member_id), len(deliveries), batches)
                member = members.get(member_id)
                if member is not None:
                    await self._consume_quota(member.group.stream.name, batches)
                return _WithPayload(EventsDelivered(deliveries), batches)
            case HoldPositions(hold_id, txn_id, subject, ttl_ms, consumed):
                return await service.hold_positions(
                    caller, hold_id, txn_id, subject, ttl_ms, consumed
                )
            case ReleasePositions(hold_id, stored):
                return await service.release_positions(caller, hold_id, stored)
            case AppendAudit(broker_id, records):
                return await self.broker.append_audit(caller, broker_id, records)
            case ReadSegment(stream, segment, offset, max_bytes):
                batches, after, end, sealed = await service.read_segment(
                    caller, stream, segment, offset, max_bytes
                )
                return _WithPayload(SegmentData(after, end, sealed), batches)
            case SettleEvents(member_id, acks, nacks, delay_ms):
                return Settled(
                    await service.settle_events(caller, member_id, acks, nacks, delay_ms)
                )
            case FindEvents(stream, key, start_ms, end_ms, limit, newest_first, local):
                found = await service.find_events(
                    caller,
                    stream,
                    key=key,
                    start_ms=start_ms,
                    end_ms=end_ms,
                    limit=limit,
                    newest_first=newest_first,
                    local=local,
                )
                return EventsFound(
                    [
                        FoundEvent(
                            e.segment, e.offset, e.timestamp, e.key, e.value, dict(e.headers)
                        )
                        for e in found.events
                    ],
                    found.batches_read,
                    found.truncated,
                    list(found.searched),
                )
            case ListTxns():
                return TxnList(service.list_txns(caller))
            case GetIdentity(transactional_id):
                return service.identity(caller, transactional_id)
            case HandOverIdentity(transactional_id, subject):
                await service.hand_over_identity(caller, transactional_id, subject)
                return Done()
            case ListIdentities(prefix):
                return IdentityList(service.list_identities(caller, prefix))
            case DescribeCluster():
                return await service.describe_cluster()
            case SetQuota(quota):
                return QuotaList(await service.set_quota(caller, quota))
            case ListQuotas():
                return QuotaList(service.list_quotas(caller))
            case CreateToken(subject, role, scope, expires_s, algorithm):
                return await service.create_token(
                    caller, subject, role, scope, expires_s, algorithm
                )
            case RevokeToken(token_id):
                await service.revoke_token(caller, token_id)
                return Done()
            case ListTokens():
                return TokenList(service.list_tokens(caller))
            case SetQuota(quota):
                return QuotaList(await service.set_quota(caller, quota))
            case ListQuotas():
                return QuotaList(service.list_quotas(caller))
            case GrantRule(rule):
                granted = await service.grant(caller, rule.subject, rule.action, rule.pattern)
                return RuleList([rule_message(granted)])
            case RevokeRule(rule):
                removed = await service.revoke(caller, rule.subject, rule.action, rule.pattern)
                return RuleList([rule] if removed else [])
            case ListRules():
                return RuleList([rule_message(r) for r in service.list_rules(caller)])
            case CheckAccess(subject, action, stream, role, scope):
                decision = service.check_access(caller, subject, action, stream, role, scope)
                return decision_message(decision)
            case Hello():
                raise ProtocolError("Hello was already sent on this connection")
        raise ProtocolError(f"{type(message).__name__} is not a request")

    # --- quotas ------------------------------------------------------------------------------

    def _throttle(self, kind: str, scope: str | None, units: int) -> float:
        """Charge a quota (``Service.quotas``); over it, hold reading this connection for the
        delay too, so the client's window fills and it slows down. -> seconds to delay."""
        delay = self.service.quotas.charge(scope, kind, units)
        if delay:
            assert scope is not None
            self.broker.metrics.throttled(scope, kind, delay)
            self._hold_reading(delay)
        return delay

    def _hold_reading(self, delay: float) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        if self._quota_timer is not None:
            if self._quota_timer.when() >= due:
                return
            self._quota_timer.cancel()
        else:
            transport.pause_reading()
        self._quota_timer = loop.call_at(due, self._release_reading)

    def _release_reading(self) -> None:
        self._quota_timer = None
        transport = self.transport
        if not self.reading_paused and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _frame_bytes(self, segment: Segment, credit: int) -> int:
        """The most bytes of the next data frame: the credit, up to 4 MiB, and up to one
        second of the consume quota (a small quota gets a steady flow, not bursts)."""
        assert self.caller is not None
        scope = self.service.quota_scope(self.caller, segment.stream_name)
        burst = self.service.quotas.burst(scope, CONSUME) or MAX_DATA_FRAME_BYTES
        return min(credit, MAX_DATA_FRAME_BYTES, burst)

    async def _consume_quota(self, stream: str, batches: list[Any]) -> None:
        """Data sent from ``stream``: over its scope's consume quota, wait before sending
        more (this follow's next frame, or this fetch's answer); other work goes on."""
        assert self.caller is not None
        scope = self.service.quota_scope(self.caller, stream)
        delay = self.service.quotas.charge(scope, CONSUME, sum(len(b) for b in batches))
        if delay:
            assert scope is not None
            self.broker.metrics.throttled(scope, CONSUME, delay)
            await asyncio.sleep(delay)

    # --- follows -----------------------------------------------------------------------------

    def _follow(self, message: Follow) -> Message:
        if message.sub_id in self.follows:
            raise InvalidArgument(f"follow id {message.sub_id} is already in use")
        if message.offset < 0 or message.credit < 0:
            raise InvalidArgument("offset and credit must not be negative")
        limits = self.limits
        if len(self.follows) >= limits.max_follows:
            raise TooManyFollows(
                f"this connection has {len(self.follows)} follows open (limit "
                f"{limits.max_follows}); unfollow some, or read through another connection",
                limit=limits.max_follows,
            )
        if message.credit > limits.max_follow_credit:
            raise self._too_much_credit(message.credit)
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
        if follow is None:
            return
        credit = follow.credit + message.credit
        if credit > self.limits.max_follow_credit:  # Credit has no answer: the follow ends
            del self.follows[message.sub_id]
            if follow.task is not None:
                follow.task.cancel()
            exc = self._too_much_credit(credit)
            self.send(FollowFailed(follow.sub_id, exc.code, exc.message, exc.details))
            return
        follow.credit = credit
        follow.credited.set()

    def _too_much_credit(self, credit: int) -> CreditLimitExceeded:
        limit = self.limits.max_follow_credit
        return CreditLimitExceeded(
            f"a follow may hold at most {limit} bytes of unused credit, not {credit}; grant "
            "credit as data is consumed",
            limit=limit,
            credit=credit,
        )

    async def _pump(self, follow: _Follow) -> None:
        segment, service, caller = follow.segment, self.service, self.caller
        assert caller is not None
        try:
            while True:
                ended = follow.end_offset is not None and follow.offset >= follow.end_offset
                if ended or (segment.sealed and follow.offset >= segment.next_offset):
                    self.send(FollowEnded(follow.sub_id, follow.offset))
                    self.follows.pop(follow.sub_id, None)
                    return
                while follow.credit <= 0:
                    follow.credited.clear()
                    await follow.credited.wait()
                async with self.read_slots:  # bounds what this connection's reads hold
                    await self.writable.wait()
                    batches = await service.read(
                        caller, segment, follow.offset, self._frame_bytes(segment, follow.credit)
                    )
                    if batches:
                        if follow.end_offset is not None:
                            end = follow.end_offset
                            batches = [b for b in batches if decode_header(b).base_offset < end]
                        sent_from = follow.offset
                        follow.offset = decode_header(batches[-1]).next_offset
                        follow.credit -= sum(len(b) for b in batches)
                        self.send(Data(follow.sub_id), 0, batches)
                        self.broker.metrics.consumed(segment, follow.offset - sent_from, batches)
                        await self._consume_quota(segment.stream_name, batches)
                        continue
                if follow.offset >= segment.next_offset and not segment.deleted:
                    await segment.wait_for_change()
        except SlipstreamError as exc:
            self.follows.pop(follow.sub_id, None)
            self.send(FollowFailed(follow.sub_id, exc.code, exc.message, exc.details))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("follow %d failed", follow.sub_id)
            self.follows.pop(follow.sub_id, None)
            self.send(FollowFailed(follow.sub_id, "internal", f"internal error: {exc}"))
