"""The producer: batches events per segment, sends them pipelined, reports positions.

Batching rule: a segment's batch is sent when it reaches ``batch_bytes``, when ``linger_ms``
has passed since its first event and ``max_in_flight`` leaves room for it, or at once when the
producer has nothing in flight (so a lone event does not wait for the linger time, and under
load batches grow while the previous ones are being made durable: group commit on the client
side).

``send`` may be called from any thread; the network side runs on the client's event loop.

Idempotence (on by default): the producer has a producer id and epoch from the broker and
numbers each segment's events; a batch keeps its sequence numbers and bytes until it is
acknowledged. When the connection drops, the producer reconnects and sends every
unacknowledged batch again, in the original order: the broker stores the ones it does not have
and answers the others with their original offsets, so nothing is lost or duplicated. At most
``WINDOW`` batches are in flight, so every retry falls in the broker's window of remembered
batches.

Scaling (issue 17) is invisible to the producer's user: when a split or merge seals a segment,
the broker refuses appends to it with SegmentSealed (storing nothing of them). The producer then
pauses sending, waits for the answers of everything in flight, describes the stream again, and
re-splits every refused batch, and every batch still buffered for a sealed segment, by key
over the segments open now, oldest first, ahead of anything newer: each key's events keep
their send order, none is lost or stored twice. Receipts resolve to where each event finally
landed. Sequences are per segment, so successors start at 0; a transaction's re-routed
appends stay in the transaction. A scale that fails (a merge across brokers called off) opens
its segments again: still open in the description after REOPENED_AFTER_S, they get their
refused batches again, from the oldest one's sequence.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from .._errors import (
    BatchTooLarge,
    BrokerShuttingDown,
    BrokerUnavailable,
    InvalidArgument,
    KeyOutOfRange,
    OutOfOrderSequence,
    SegmentSealed,
    SlipstreamError,
    WrongBroker,
)
from ..format import (
    COMPRESSIONS,
    EVENT_SCHEMA,
    binary_array,
    encode_body,
    encode_body_parts,
    encode_header,
    headers_array,
    int64_values,
    make_record_batch,
    numpy_array,
    read_body,
    timestamp_array,
)
from ..protocol import Append, AppendAck, StreamInfo
from ..streams import WINDOW, Position, Router, next_sequence
from ._cluster import Links
from ._connection import Connection
from ._rerouting import KeyRanges, open_ranges, resplit

#: how long a producer waits for segments that refused its batches (a scale sealing them) to
#: show as sealed before it sends to them again: the scale failed and they are open again
REOPENED_AFTER_S = 1.0
_EVENT_OVERHEAD = 24  # bytes of Arrow offsets and timestamp per event, for sizing batches


class Acknowledgement(concurrent.futures.Future[int]):
    """A batch's acknowledgement (its base offset), resolved on the producer's ``loop``:
    a receipt knows from it whether waiting would block the very loop that resolves it.

    A batch that a sealed segment refused and the producer re-routed resolves to -1 with
    ``landed`` set: per event, the Position where it was stored or the error that lost it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.landed: list[Position | BaseException] | None = None


def _landed(
    future: concurrent.futures.Future[int], segment: int, base: int, index: int
) -> Position:
    """Event ``index`` of a batch sent to ``segment`` whose future resolved to ``base``."""
    landed = getattr(future, "landed", None)
    if landed is None:
        return Position(segment, base + index)
    outcome: Position | BaseException = landed[index]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


class _Landing:
    """Joins the parts of a re-routed batch: once every part is answered, the batch's own
    future resolves with ``landed`` (see :class:`Acknowledgement`)."""

    __slots__ = ("future", "landed", "on_done", "pending")

    def __init__(
        self,
        future: concurrent.futures.Future[int],
        count: int,
        parts: int,
        on_done: Callable[[concurrent.futures.Future[int]], None],
    ) -> None:
        self.future = future
        self.landed: list[Position | BaseException | None] = [None] * count
        self.pending = parts
        self.on_done = on_done

    def part_done(
        self, segment: int, rows: np.ndarray, part: concurrent.futures.Future[int]
    ) -> None:
        error = part.exception()
        for i, row in enumerate(rows.tolist()):
            if error is not None:
                self.landed[row] = error
            else:
                try:
                    self.landed[row] = _landed(part, segment, part.result(), i)
                except BaseException as exc:  # a part of the part was lost
                    self.landed[row] = exc
        self.pending -= 1
        if self.pending == 0:
            future = self.future
            future.landed = self.landed  # type: ignore[attr-defined]
            future.set_result(-1)
            self.on_done(future)


def _check_blocking(future: concurrent.futures.Future[int], timeout: float | None) -> None:
    if (
        timeout != 0
        and not future.done()
        and isinstance(future, Acknowledgement)
        and _on_loop(future.loop)
    ):
        raise InvalidArgument(
            "result() would block the event loop that delivers the acknowledgement (it would "
            "never return); in asyncio code write 'await receipt' instead"
        )


class _Batch:
    """One batch of one segment: rows accumulate here until it is sealed and sent.

    Keyless and keyed events go to separate batches (``keys`` is None for a keyless one).
    Timestamps and headers are lists only once some event of the batch has one: the common
    event costs two list appends.
    """

    __slots__ = (
        "bytes",
        "created",
        "created_ms",
        "future",
        "headers",
        "keys",
        "segment",
        "timestamps",
        "values",
    )

    def __init__(self, segment: int, keyed: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.segment = segment
        self.keys: list[bytes] | None = [] if keyed else None
        self.values: list[bytes] = []
        self.timestamps: list[int | None] | None = None
        self.headers: list[Mapping[str, bytes] | None] | None = None
        self.bytes = 0
        self.created = time.monotonic()
        self.created_ms = time.time_ns() // 1_000_000
        self.future: concurrent.futures.Future[int] = Acknowledgement(loop)

    def add_extras(
        self, index: int, timestamp: int | None, headers: Mapping[str, bytes] | None
    ) -> None:
        if self.timestamps is None:
            self.timestamps = [None] * index
        self.timestamps.append(timestamp)
        if self.headers is None:
            self.headers = [None] * index
        self.headers.append(headers)

    def pad_extras(self) -> None:
        """Keep the optional columns as long as ``values`` (called when an event has none)."""
        if self.timestamps is not None:
            self.timestamps.append(None)
        if self.headers is not None:
            self.headers.append(None)

    def time_range(self) -> tuple[int, int]:
        if self.timestamps is None:
            return self.created_ms, self.created_ms
        present = [self.created_ms if t is None else t for t in self.timestamps]
        return min(present), max(present)

    def record_batch(self) -> pa.RecordBatch:
        count = len(self.values)
        if self.timestamps is None:
            timestamps = np.full(count, self.created_ms, dtype=np.int64)
        else:
            now = self.created_ms
            timestamps = np.array(
                [now if t is None else t for t in self.timestamps], dtype=np.int64
            )
        return make_record_batch(
            pa.nulls(count, pa.binary()) if self.keys is None else binary_array(self.keys),
            binary_array(self.values),
            timestamp_array(timestamps),
            headers_array(self.headers) if self.headers is not None else None,
        )


class _InFlight:
    """A batch sent and not yet acknowledged: kept whole so that it can be sent again."""

    __slots__ = (
        "connection",
        "count",
        "first_sent",
        "future",
        "order",
        "parts",
        "segment",
        "sent",
        "sequence",
        "size",
    )

    def __init__(
        self,
        order: int,
        segment: int,
        parts: list[Any],
        future: concurrent.futures.Future[int],
        size: int,
        count: int,
        sequence: int = -1,
    ) -> None:
        self.order = order
        self.sequence = sequence  # of its first event (idempotent producers; else -1)
        self.segment = segment
        self.parts = parts
        self.future = future
        self.size = size
        self.count = count
        self.first_sent = self.sent = time.monotonic()
        self.connection: Connection | None = None


class Receipt:
    """The outcome of one ``send``: ``result()`` blocks until the event is acknowledged and
    returns its Position; ``await receipt`` does the same in asyncio code. If a split or
    merge sealed the segment first, the event went to the successor owning its key, and the
    Position is there.

    An acknowledgement means the broker has made the event durable (with the broker's default
    ``fsync=always``: on stable storage). If the batch failed, ``result()`` raises the typed
    error (e.g. StorageFull) and the event was not stored.

    In asyncio code, ``result()`` works once ``done()``; before that it raises
    InvalidArgument instead of blocking the loop that would deliver the answer forever.
    """

    __slots__ = ("_future", "_index", "_segment")

    def __init__(self, future: concurrent.futures.Future[int], segment: int, index: int) -> None:
        self._future = future
        self._segment = segment
        self._index = index

    def result(self, timeout: float | None = None) -> Position:
        _check_blocking(self._future, timeout)
        return _landed(self._future, self._segment, self._future.result(timeout), self._index)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Generator[Any, None, Position]:
        base = yield from asyncio.wrap_future(self._future).__await__()
        return _landed(self._future, self._segment, base, self._index)


class BulkReceipt:
    """The outcome of ``send_many``: ``result()`` returns every event's Position, in order;
    ``await receipt`` does the same in asyncio code (see :class:`Receipt`)."""

    def __init__(self, parts: list[tuple[concurrent.futures.Future[int], int, np.ndarray]]) -> None:
        self._parts = parts  # (batch future, segment, row indexes of the input in that batch)
        self.count = sum(len(rows) for _, _, rows in parts)

    def result(self, timeout: float | None = None) -> list[Position]:
        for future, _, _ in self._parts:
            _check_blocking(future, timeout)
        return self._positions([future.result(timeout) for future, _, _ in self._parts])

    def _positions(self, bases: Sequence[int]) -> list[Position]:
        out: list[Position | None] = [None] * self.count
        for base, (future, segment, rows) in zip(bases, self._parts, strict=True):
            for i, row in enumerate(rows.tolist()):
                out[row] = _landed(future, segment, base, i)
        return out  # type: ignore[return-value]

    def done(self) -> bool:
        return all(f.done() for f, _, _ in self._parts)

    def __await__(self) -> Generator[Any, None, list[Position]]:
        bases = yield from asyncio.gather(
            *(asyncio.wrap_future(future) for future, _, _ in self._parts)
        ).__await__()
        return self._positions(bases)


class ProducerCore:
    """Shared by the sync and asyncio producers. Thread-safe ``send``; the rest runs on the
    connection's loop."""

    def __init__(
        self,
        connection: Connection,
        loop: asyncio.AbstractEventLoop,
        stream: str,
        router: Router,
        *,
        linger_ms: float = 5.0,
        # 2 MiB: per-batch costs (a frame, an acknowledgement, the GIL handed to the network
        # thread) amortised over twice the events of 1 MiB: 1 KiB produce used 10-15% less
        # CPU in client and broker; linger, not size, bounds the latency of a slow stream.
        batch_bytes: int = 2 * 1024 * 1024,
        compression: str | None = "lz4",  # kept only where it saves a fifth (format)
        max_in_flight: int = 8,
        buffer_bytes: int = 64 * 1024 * 1024,
        identity: tuple[int, int] | None = None,
        txn: int | None = None,
        reconnect: Callable[[], Awaitable[Connection]] | None = None,
        delivery_timeout: float = 120.0,
        request_timeout: float = 30.0,
        eager: bool = True,
        describe: Callable[[], Awaitable[StreamInfo]] | None = None,
        links: Links | None = None,
    ) -> None:
        if identity is not None and not 1 <= max_in_flight <= WINDOW:
            raise InvalidArgument(
                f"an idempotent producer keeps 1 to {WINDOW} batches in flight, not {max_in_flight}"
            )
        if compression is not None and compression not in COMPRESSIONS:
            raise InvalidArgument(f"compression must be one of {COMPRESSIONS} or None")
        if batch_bytes > connection.max_batch_bytes - 64 * 1024:
            raise InvalidArgument(
                f"batch_bytes {batch_bytes} is above the broker's limit "
                f"({connection.max_batch_bytes} bytes, less room for the Arrow framing)"
            )
        self.connection = connection
        self.loop = loop
        self.stream = stream
        self.router = router
        # the open segments by key range, as of the last re-route (send_many checks against it)
        self._routed = frozenset(router.segments)
        self._ranges: KeyRanges | None = None
        self.linger = linger_ms / 1000
        self.batch_bytes = batch_bytes
        self.compression = compression
        self.max_in_flight = max_in_flight
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._open: dict[int, _Batch] = {}  # keyed events, by segment
        self._keyless: _Batch | None = None
        self._sealed: list[_Batch | tuple[pa.RecordBatch, int, concurrent.futures.Future[int]]] = []
        self._buffered = 0  # bytes accepted but not yet acknowledged
        self._in_flight = 0
        self._unacked: set[concurrent.futures.Future[int]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._space_waiters: list[asyncio.Future[None]] = []
        self._wakeup_pending = False
        self._sticky = 0
        self.closed = False
        self.error: SlipstreamError | None = None
        #: events the broker acknowledged (made durable), over the producer's life
        self.acknowledged = 0
        #: events whose batch failed for good, over the producer's life
        self.failed = 0
        #: events sent again to successors after a split or merge sealed their segment
        #: (counted once per re-route), over the producer's life
        self.rerouted = 0
        # failures not yet raised by flush()/close(): the first error and how many events
        self._unreported: BaseException | None = None
        self._unreported_events = 0
        self.identity = identity  # (producer id, epoch), or None: not idempotent
        self.txn = txn  # stage every batch in this transaction
        self._reconnect = reconnect
        self.delivery_timeout = delivery_timeout
        self.request_timeout = request_timeout
        self._flights: dict[int, _InFlight] = {}  # sent, not answered; oldest first
        self._watchdog: asyncio.TimerHandle | None = None
        # eager: send a batch before it is full (linger, or nothing in flight). A transaction's
        # batches are invisible until it commits, so they are sent only when full or flushed.
        self.eager = eager
        self._next_sequence: dict[int, int] = {}
        self._order = itertools.count()
        self._retry: list[_InFlight] = []
        # refused by a sealed segment: re-routed once everything in flight is answered
        self._refused: list[_InFlight] = []
        # open segments that refused a batch for a key outside their range (KeyOutOfRange):
        # the router is stale or wrong; their later batches in flight are refused too
        self._stale: set[int] = set()
        # per segment, of its newest acknowledged batch: (send order, the sequence after it)
        self._stored: dict[int, tuple[int, int]] = {}
        self._describe = describe
        # where each segment's batches go (several brokers); None: all on ``connection``
        self._links = links
        self._recovery: asyncio.Task[None] | None = None

    # --- any thread --------------------------------------------------------------------------

    def send(
        self,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> Receipt:
        # The hot path of the whole client: keep it to a few list appends under one lock.
        if self.closed:
            raise InvalidArgument("the producer is closed")
        if key is None:
            size = len(value) + _EVENT_OVERHEAD
        else:
            if key.__class__ is str:
                key = key.encode()
            size = len(value) + len(key) + _EVENT_OVERHEAD
        if size > self.batch_bytes:
            raise BatchTooLarge(
                f"an event of {size} bytes does not fit in a batch of {self.batch_bytes} bytes",
                size=size,
                limit=self.batch_bytes,
            )
        with self._lock:
            if self._buffered > self.buffer_bytes:
                self._wait_for_space()
            if key is None:
                batch = self._keyless or self._open_batch(self._sticky_segment(), keyed=False)
            else:
                segment = self.router.segment_for(key)  # type: ignore[arg-type]
                batch = self._open.get(segment) or self._open_batch(segment, keyed=True)
                batch.keys.append(key)  # type: ignore[union-attr,arg-type]
            index = len(batch.values)
            batch.values.append(value)
            if timestamp is not None or headers:
                batch.add_extras(index, timestamp, headers)
            elif batch.timestamps is not None:
                batch.pad_extras()
            batch.bytes += size
            self._buffered += size
            if batch.bytes >= self.batch_bytes:
                self._seal(batch)
                self._wake()
                full = True
            else:
                full = False
        if full:
            # A thread sending in a tight loop holds the GIL for whole switch intervals (5 ms);
            # let the network thread send this batch and take acknowledgements now.
            time.sleep(0)
        return Receipt(batch.future, batch.segment, index)

    async def space_available(self) -> None:
        """Wait (on the loop) until the buffer is below ``buffer_bytes``: the asyncio
        producer's backpressure, woken by acknowledgements rather than by polling."""
        while self._buffered > self.buffer_bytes:
            waiter = self.loop.create_future()
            self._space_waiters.append(waiter)
            await waiter

    def _wait_for_space(self) -> None:
        while self._buffered > self.buffer_bytes and not _on_loop(self.loop):
            self._space.wait()  # never blocks the loop itself; AsyncProducer waits before

    def _open_batch(self, segment: int, keyed: bool) -> _Batch:
        batch = _Batch(segment, keyed, self.loop)
        if keyed:
            self._open[segment] = batch
        else:
            self._keyless = batch
        self._wake()
        return batch

    def _seal(self, batch: _Batch) -> None:
        if batch.keys is None:
            self._keyless = None
            self._sticky += 1  # the next keyless batch goes to the next segment
        else:
            del self._open[batch.segment]
        self._sealed.append(batch)

    def send_many(
        self,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | pa.Array | None = None,
        timestamps: Sequence[int] | np.ndarray | pa.Array | None = None,
        headers: pa.Array | None = None,
    ) -> BulkReceipt:
        """Send many events at once, column-wise (no per-event Python work without keys).

        ``keys`` may be an Arrow binary array (null: keyless), ``timestamps`` an Arrow
        timestamp array, ``headers`` an Arrow array of the events' header type."""
        if self.closed:
            raise InvalidArgument("the producer is closed")
        value_array = (
            values.cast(pa.binary()) if isinstance(values, pa.Array) else binary_array(values)
        )
        count = len(value_array)
        if timestamps is None:
            ts_array = timestamp_array(np.full(count, time.time_ns() // 1_000_000, dtype=np.int64))
        elif isinstance(timestamps, pa.Array):
            ts_array = timestamps.cast(EVENT_SCHEMA.field(2).type)
        else:
            ts_array = timestamp_array(timestamps)
        if keys is None or (isinstance(keys, pa.Array) and keys.null_count == len(keys)):
            key_array = pa.nulls(count, pa.binary())
            segments = None
        else:
            encoded = (
                keys.cast(pa.binary()).to_pylist()
                if isinstance(keys, pa.Array)
                else [k.encode() if isinstance(k, str) else k for k in keys]
            )
            key_array = (
                keys.cast(pa.binary()) if isinstance(keys, pa.Array) else binary_array(encoded)
            )
            keyless = self._sticky_segment()
            segments = np.fromiter(
                (self.router.segment_for(k) if k is not None else keyless for k in encoded),
                dtype=np.int64,
                count=count,
            )
        columns = [key_array, value_array, ts_array]
        if headers is not None:
            columns.append(headers.cast(EVENT_SCHEMA.field(3).type))
        # Size batches by what a sample really encodes to (nbytes leaves out IPC framing and
        # the offsets of an all-null key column), with a margin for rows longer than average.
        sample = min(count, 1024)
        sample_bytes = len(encode_body(make_record_batch(*[c.slice(0, sample) for c in columns])))
        per_row = int(sample_bytes / max(1, sample) * 1.1) + 8
        rows_per_batch = max(1, (self.batch_bytes - 64 * 1024) // per_row)
        groups = (
            [(None, np.arange(count))]
            if segments is None
            else [(int(s), np.flatnonzero(segments == s)) for s in np.unique(segments)]
        )
        parts = []
        for segment, rows in groups:
            for start in range(0, len(rows), rows_per_batch):
                chunk_rows = rows[start : start + rows_per_batch]
                target = self._sticky_segment() if segment is None else segment
                if segment is None:
                    self._sticky += 1
                    part = [c.slice(int(chunk_rows[0]), len(chunk_rows)) for c in columns]
                else:
                    indices = numpy_array(chunk_rows)
                    part = [c.take(indices) for c in columns]
                # Each batch gets its own headers column: a slice of one big null list array
                # would drag the whole array's offsets into the IPC body.
                record = make_record_batch(*part)
                with self._lock:
                    self._wait_for_space()
                    pieces: list[tuple[int, np.ndarray | None, pa.RecordBatch]]
                    if segment is None or target in self._routed:
                        pieces = [(target, None, record)]
                    else:  # routed before a re-route sealed the segment: sent after it, so
                        # queued after the re-routed batches, it must go to the successors now
                        assert self._ranges is not None  # only a re-route changes the routing
                        pieces = list(resplit(record, self._ranges, self._sticky_segment()))
                    for piece_segment, picked, piece in pieces:
                        future: concurrent.futures.Future[int] = Acknowledgement(self.loop)
                        self._buffered += piece.nbytes
                        self._sealed.append((piece, piece_segment, future))
                        piece_rows = chunk_rows if picked is None else chunk_rows[picked]
                        parts.append((future, piece_segment, piece_rows))
                    self._wake()
        return BulkReceipt(parts)

    def _sticky_segment(self) -> int:
        # Keyless events fill one segment's batch at a time, then move on when it is sealed
        # (Kafka's sticky partitioner): big batches, and an even spread over time.
        segments = self.router.segments
        return segments[self._sticky % len(segments)]

    def _wake(self) -> None:
        if not self._wakeup_pending:
            self._wakeup_pending = True
            if _on_loop(self.loop):
                self.loop.call_soon(self._dispatch)
            else:
                self.loop.call_soon_threadsafe(self._dispatch)

    def flush_nowait(self) -> list[concurrent.futures.Future[int]]:
        """Seal every open batch and return the futures of everything not yet acknowledged."""
        with self._lock:
            self._seal_all()
            self._wake()
            return list(self._unacked) + [
                b.future if isinstance(b, _Batch) else b[2] for b in self._sealed
            ]

    # --- loop thread -------------------------------------------------------------------------

    def _open_batches(self) -> list[_Batch]:
        batches = list(self._open.values())
        if self._keyless is not None:
            batches.append(self._keyless)
        return batches

    def _seal_all(self) -> None:
        for batch in self._open_batches():
            self._seal(batch)

    def _dispatch(self) -> None:
        with self._lock:
            self._wakeup_pending = False
            if self._recovery is not None:
                return  # new batches wait until the unacknowledged ones went out again
            if not self.eager:
                pass
            elif self._in_flight == 0:
                self._seal_all()
            elif (self._open or self._keyless) and self._timer is None:
                self._seal_lingered()
            room = self.max_in_flight - self._in_flight
            ready, self._sealed = self._sealed[:room], self._sealed[room:]
            for item in ready:  # flush_nowait must see them while _send encodes them
                self._unacked.add(item.future if isinstance(item, _Batch) else item[2])
        for item in ready:
            self._send(item)

    def _seal_lingered(self) -> None:
        """Seal the open batches whose linger time is up, oldest first, as far as the
        in-flight window has room for them, and set the timer for the next one. A batch that
        finds the window full stays open and keeps growing until an acknowledgement makes
        room (``_acked`` dispatches again): sealed at once, it would only queue up behind the
        window at its small size, and a paced producer whose round trips grow (a loaded
        machine, more segments) would send ever more, ever smaller batches, each round trip
        carrying ``max_in_flight`` of them (2026-11-24: paced 2 x 50,000/s into 8 segments,
        35 events a batch, acknowledged 60-80% of what was sent on a busy machine)."""
        now = time.monotonic()
        room = self.max_in_flight - self._in_flight - len(self._sealed)
        for batch in sorted(self._open_batches(), key=lambda b: b.created):
            if now - batch.created < self.linger:
                self._timer = self.loop.call_later(
                    batch.created + self.linger - now, self._linger_expired
                )
                return
            if room <= 0:
                return  # something is in flight: its acknowledgement dispatches again
            self._seal(batch)
            room -= 1

    def _linger_expired(self) -> None:
        self._timer = None
        self._dispatch()

    def _send(
        self, item: _Batch | tuple[pa.RecordBatch, int, concurrent.futures.Future[int]]
    ) -> None:
        if isinstance(item, _Batch):
            record, segment, future, size = (
                item.record_batch(),
                item.segment,
                item.future,
                item.bytes,
            )
            min_ts, max_ts = item.time_range()
        else:
            record, segment, future = item
            size = record.nbytes
            timestamps = int64_values(record.column(2))
            min_ts, max_ts = int(timestamps.min()), int(timestamps.max())
        body = encode_body_parts(record, self.compression)
        count = record.num_rows
        sequence = -1
        if self.identity is None:
            head = encode_header(
                body, event_count=count, min_timestamp=min_ts, max_timestamp=max_ts
            )
        else:
            sequence = self._next_sequence.get(segment, 0)
            self._next_sequence[segment] = next_sequence(sequence, count)
            head = encode_header(
                body,
                event_count=count,
                min_timestamp=min_ts,
                max_timestamp=max_ts,
                producer_id=self.identity[0],
                producer_epoch=self.identity[1],
                sequence=sequence,
            )
        self._unacked.add(future)
        self._transmit(
            _InFlight(next(self._order), segment, [head, *body], future, size, count, sequence)
        )

    def _transmit(self, flight: _InFlight) -> None:
        connection = self.connection
        if self._links is not None:
            found = self._links.cached(flight.segment)
            if found is None:  # not connected (or claimed) there yet: nothing was sent
                self._retry.append(flight)
                self._start_recovery()
                return
            connection = found
        flight.sent = time.monotonic()
        flight.connection = connection
        self._flights[flight.order] = flight
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self.request_timeout, self._check_stalled)
        self._in_flight += 1
        reply = connection.send_request(Append(self.stream, flight.segment, self.txn), flight.parts)
        reply.add_done_callback(lambda done: self._acked(done, flight))

    def _check_stalled(self) -> None:
        """A connection that answers nothing for ``request_timeout`` is as good as lost:
        close it, so that the batches go out again on a new one."""
        self._watchdog = None
        if not self._flights:
            return
        oldest = min(self._flights.values(), key=lambda f: f.sent)
        waited = time.monotonic() - oldest.sent
        if waited >= self.request_timeout and oldest.connection is not None:
            oldest.connection.close(
                BrokerUnavailable(
                    f"no answer from {oldest.connection.address} in {self.request_timeout:g} s"
                )
            )
            waited = 0.0
        self._watchdog = self.loop.call_later(
            max(0.001, self.request_timeout - waited), self._check_stalled
        )

    def _acked(self, done: asyncio.Future[Any], flight: _InFlight) -> None:
        self._flights.pop(flight.order, None)
        self._in_flight -= 1
        exc = done.exception()
        if (
            isinstance(exc, WrongBroker)
            and self._links is not None
            and self._links.follows_move(exc, flight.segment)
            and self._resendable(flight)
        ):
            self._links.moved(exc)  # nothing of it was stored: send it to the new owner
            self._retry.append(flight)
            self._start_recovery()
            return
        if exc is not None and self._retriable(exc, flight):
            self._retry.append(flight)
            self._start_recovery()
            return
        if isinstance(exc, SegmentSealed) and self._describe is not None and not self.closed:
            self._refused.append(flight)  # nothing of it was stored: it goes to the successors
            self._start_recovery()
            return
        if self._describe is not None and not self.closed and self._out_of_range(exc, flight):
            self._refused.append(flight)  # nothing of it was stored: routed again
            self._start_recovery()
            return
        future = flight.future
        self._unacked.discard(future)
        if exc is not None:
            if isinstance(exc, SlipstreamError):
                self.error = exc
            self._record_failure(exc, flight.count)
            future.set_exception(exc)
        else:
            ack, _ = done.result()
            assert isinstance(ack, AppendAck)
            if flight.sequence >= 0:  # where its segment's sequence goes on (see _reroute)
                self._stored[flight.segment] = (
                    flight.order,
                    next_sequence(flight.sequence, flight.count),
                )
            self.acknowledged += flight.count
            future.set_result(ack.base_offset)
        self._release(flight.size)
        self._dispatch()

    def _release(self, size: int) -> None:
        with self._lock:
            self._buffered -= size
            self._space.notify_all()
        waiters, self._space_waiters = self._space_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _out_of_range(self, exc: BaseException | None, flight: _InFlight) -> bool:
        """Whether ``flight`` was refused because this producer routes by a wrong view: a key
        outside its segment's range (KeyOutOfRange), or an idempotent batch sent behind such
        a refused one to the same segment (OutOfOrderSequence: the segment still expects the
        refused batch's sequence). Nothing of either was stored."""
        if isinstance(exc, KeyOutOfRange):
            self._stale.add(flight.segment)
            return True
        return isinstance(exc, OutOfOrderSequence) and (
            flight.segment in self._stale
            or any(f.segment == flight.segment for f in self._refused)  # reopened meanwhile
        )

    def _resendable(self, flight: _InFlight) -> bool:
        return not self.closed and time.monotonic() - flight.first_sent < self.delivery_timeout

    def _retriable(self, exc: BaseException, flight: _InFlight) -> bool:
        return (
            not self.closed
            and self.identity is not None
            and self._reconnect is not None
            and isinstance(exc, BrokerUnavailable | BrokerShuttingDown)
            and time.monotonic() - flight.first_sent < self.delivery_timeout
        )

    def _start_recovery(self) -> None:
        if self._recovery is None:
            self._recovery = self.loop.create_task(self._recover())

    async def _recover(self) -> None:
        """New batches wait while this runs. After a lost connection: once nothing is in
        flight, reconnect and send every unacknowledged batch again in its original order.
        After a refusal by a sealed segment, or by an open one for a key outside its range:
        once nothing is in flight (so every batch of that segment is either stored or refused),
        re-route (:meth:`_reroute`). Repeated until neither is left, then carry on."""
        try:
            while True:
                while self._in_flight:  # the rest of the lost connection's batches fail at once
                    await asyncio.sleep(0.001)
                if self._retry:
                    if self._links is not None:
                        await self._connect_for(self._retry)
                    else:
                        assert self._reconnect is not None
                        self.connection = await self._reconnect()
                    again, self._retry = sorted(self._retry, key=lambda f: f.order), []
                    for flight in again:
                        self._transmit(flight)
                    continue  # a retry may be refused by a segment sealed meanwhile
                if not self._refused:
                    break
                await self._reroute()
                if self._reconnect is not None and self._links is None:
                    self.connection = await self._reconnect()  # describing may have dialled
        except (SlipstreamError, asyncio.CancelledError) as exc:
            self._recovery = None
            self._give_up(
                exc
                if isinstance(exc, SlipstreamError)
                else BrokerUnavailable("the client was closed before the broker came back")
            )
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._dispatch()  # batches sealed during the recovery go out (or fail) now
            return
        self._recovery = None
        self._dispatch()

    async def _connect_for(self, flights: list[_InFlight]) -> None:
        """Connect to the brokers of the flights' segments (the cluster described again and
        waited for while a container moves), within delivery_timeout: past it, raises
        BrokerUnavailable and the flights fail."""
        assert self._links is not None
        for segment in sorted({f.segment for f in flights}):
            if self._links.cached(segment) is not None:
                continue
            if time.monotonic() - min(f.first_sent for f in flights) >= self.delivery_timeout:
                raise BrokerUnavailable(
                    f"no broker took segment {segment} of {self.stream} within "
                    f"delivery_timeout ({self.delivery_timeout:g} s)",
                    stream=self.stream,
                    segment=segment,
                )
            connection = await self._links.connect(segment)
            if self._links.cached(segment) is None and connection.closed is None:
                await asyncio.sleep(0.01)  # the map moved meanwhile: the next round looks again

    async def _reroute(self) -> None:
        """Send what sealed segments refused or still hold to the segments open now.

        Runs with nothing in flight and sending paused, so for each sealed segment the stored
        batches are a prefix of what was sent, and the refused, sealed and open ones (oldest
        first) are exactly the rest. Each is decoded and re-split by key; its parts go first
        in the send queue, and the router changes in the same step, so a key's later events
        follow its re-routed ones. A batch whose parts fail loses only those parts' events.

        After a KeyOutOfRange the router itself was wrong (a stale or inconsistent view):
        every buffered batch is re-split too, whatever its segment, and each refusing open
        segment's sequence goes back to what it expects: its oldest refused batch's (an
        idempotent producer's batches behind a refused one are refused too, as out of
        sequence), or the one after a batch it stored behind the refused ones. That happens
        without idempotence, and when the segment had stored nothing of this producer yet (it
        then takes any sequence): the refused batch's keys that the segment does own then land
        after those later batches."""
        assert self._describe is not None
        stale, self._stale = self._stale, set()
        refused = {flight.segment for flight in self._refused if flight.segment not in stale}
        # The broker refuses from the moment a scale starts sealing (it then waits for the
        # segments' appends to be durable and their transactions to end); the description
        # shows the successors once the scale is recorded. Wait for that, like for a broker
        # that is away, up to delivery_timeout.
        deadline = min(f.first_sent for f in self._refused) + self.delivery_timeout
        reopened_after = time.monotonic() + REOPENED_AFTER_S
        while True:
            try:
                info = await self._describe()
            except (BrokerUnavailable, BrokerShuttingDown):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)
                continue
            ranges = open_ranges(info)
            still_open = refused & {segment for segment, _, _ in ranges}
            if still_open and time.monotonic() >= reopened_after:
                # the scale that closed them failed (a merge across brokers called off, or
                # one waiting long): send to them again, from their oldest refused batch
                stale |= still_open
                refused -= still_open
                still_open = set()
            if not still_open:
                break
            if time.monotonic() >= deadline:
                raise SegmentSealed(
                    f"segments {sorted(refused)} of {self.stream} refuse appends and no scale "
                    f"replaced them within delivery_timeout ({self.delivery_timeout:g} s)",
                    stream=self.stream,
                    segments=sorted(refused),
                )
            await asyncio.sleep(0.02)
        table = KeyRanges(ranges)
        moved: list[tuple[pa.RecordBatch, concurrent.futures.Future[int], int]] = []
        with self._lock:
            self.router = Router(ranges)
            self._routed = open_now = frozenset(table.segments)
            self._ranges = table
            for flight in sorted(self._refused, key=lambda f: f.order):
                record = read_body(b"".join(flight.parts))
                moved.append((record, flight.future, flight.size))
            for flight in sorted(self._refused, key=lambda f: f.order, reverse=True):
                if flight.segment in stale and flight.sequence >= 0:
                    # the segment expects the sequence after its newest stored batch: the
                    # oldest refused one's, or past a batch stored behind it (a segment that
                    # knew nothing of this producer yet takes any sequence)
                    order, after = self._stored.get(flight.segment, (-1, flight.sequence))
                    behind = order > flight.order
                    self._next_sequence[flight.segment] = after if behind else flight.sequence
            self._refused = []
            keep = frozenset() if stale else open_now  # a wrong router: re-split everything
            kept: list[_Batch | tuple[pa.RecordBatch, int, concurrent.futures.Future[int]]] = []
            for item in self._sealed:
                if isinstance(item, _Batch):
                    if item.segment in keep:
                        kept.append(item)
                    else:
                        moved.append((item.record_batch(), item.future, item.bytes))
                elif item[1] in keep:
                    kept.append(item)
                else:
                    moved.append((item[0], item[2], item[0].nbytes))
            for batch in self._open_batches():
                if batch.segment not in keep:
                    if batch.keys is None:
                        self._keyless = None
                    else:
                        del self._open[batch.segment]
                    moved.append((batch.record_batch(), batch.future, batch.bytes))
            parts: list[tuple[pa.RecordBatch, int, concurrent.futures.Future[int]]] = []
            for record, future, size in moved:
                self._buffered -= size
                self.rerouted += record.num_rows
                pieces = resplit(record, table, self._sticky_segment())
                self._sticky += 1
                if not pieces:  # no events: nothing to wait for
                    future.landed = []  # type: ignore[attr-defined]
                    future.set_result(-1)
                    continue
                landing = _Landing(future, record.num_rows, len(pieces), self._unacked.discard)
                self._unacked.add(future)  # flush waits for it until its parts are answered
                for segment, rows, piece in pieces:
                    part = Acknowledgement(self.loop)
                    part.add_done_callback(partial(landing.part_done, segment, rows))
                    self._buffered += piece.nbytes
                    parts.append((piece, segment, part))
            self._sealed = [*parts, *kept]
            for segment in [s for s in self._next_sequence if s not in open_now]:
                del self._next_sequence[segment]  # a sealed segment takes no more batches
                self._stored.pop(segment, None)
        self._release(0)

    def _give_up(self, error: SlipstreamError) -> None:
        failed, self._retry = self._retry + self._refused, []
        self._refused = []
        self.error = error
        for flight in failed:
            self._unacked.discard(flight.future)
            self._record_failure(error, flight.count)
            flight.future.set_exception(error)
            self._release(flight.size)

    def _record_failure(self, exc: BaseException, count: int) -> None:
        """Keep a failed batch's error until flush() or close() raises it: a producer whose
        receipts nobody checks must still not report success for events it lost."""
        with self._lock:
            self.failed += count
            self._unreported_events += count
            if self._unreported is None:
                self._unreported = exc

    def take_failure(self) -> BaseException | None:
        """The error for every event that failed since the last call (None if none did): the
        first batch's error type, its message prefixed with how many events were lost."""
        with self._lock:
            first, self._unreported = self._unreported, None
            count, self._unreported_events = self._unreported_events, 0
        if first is None:
            return None
        if not isinstance(first, SlipstreamError):
            return first
        return type(first)(
            f"{count} event{'s' if count != 1 else ''} sent to {self.stream} "
            f"{'were' if count != 1 else 'was'} not acknowledged "
            f"({self.acknowledged} acknowledged so far): {first.message}",
            **{**first.details, "unacknowledged": count, "acknowledged": self.acknowledged},
        )

    async def stop(self) -> None:
        """Stop resending (the client is closing): unacknowledged batches fail."""
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        recovery = self._recovery
        if recovery is not None:
            recovery.cancel()
            await asyncio.gather(recovery, return_exceptions=True)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
