"""The reader: follows every segment of a stream from a start position, optionally to an end.

The broker pushes whole batches while the reader has granted credit; the reader returns credit
as the application consumes them, so a slow application slows only its own reads. Batches of
different segments interleave; within a segment they arrive in offset order, so per-key order
holds. Every batch's CRC32C is checked here again: end-to-end, not just on the broker's disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa

from .._errors import (
    BrokerUnavailable,
    CorruptBatch,
    CorruptData,
    InvalidArgument,
    SlipstreamError,
    WrongBroker,
    error_from_wire,
)
from ..format import check_event_schema, iter_batches, numpy_array, read_body
from ..protocol import (
    Credit,
    Data,
    DescribeStream,
    Follow,
    FollowEnded,
    FollowFailed,
    GetCut,
    Message,
    Payload,
    SegmentInfo,
    StreamInfo,
    Unfollow,
)
from ..streams import StreamCut, preceding, relative_time_ms
from ._cluster import Cluster, Links
from ._connection import Connection

Start = str | int | dt.datetime | StreamCut
CREDIT_BYTES = 32 * 1024 * 1024
MIN_SEGMENT_CREDIT = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the loop hands to the consuming side: one Data payload, or a segment's end (with
    the segments that became readable), or an error."""

    segment: int
    payload: Payload | None = None
    error: SlipstreamError | None = None
    #: with a segment's end: the segments its end made readable, now followed
    opened: tuple[int, ...] = ()


def parse_start(start: Start) -> tuple[str, int | None, StreamCut | None]:
    """``"earliest"``, ``"latest"``, ISO-8601 text, a relative time (``"-1h"``, ``"-15m"``,
    ``"-2d"``: that long before now), a datetime, ms since the epoch or a StreamCut -> (kind,
    timestamp ms, cut)."""
    if isinstance(start, StreamCut):
        return "cut", None, start
    if isinstance(start, dt.datetime):
        if start.tzinfo is None:
            raise InvalidArgument("a start time needs a timezone, e.g. 2026-11-21T00:00Z")
        return "time", int(start.timestamp() * 1000), None
    if isinstance(start, int) and not isinstance(start, bool):
        return "time", start, None
    if isinstance(start, str):
        if start in ("earliest", "latest"):
            return start, None, None
        if start.lstrip().startswith("{"):
            return "cut", None, StreamCut.from_json(start)
        if (moment := relative_time_ms(start, int(time.time() * 1000))) is not None:
            return "time", moment, None  # "-1h": an hour before now
        try:
            return parse_start(dt.datetime.fromisoformat(start))
        except ValueError:
            pass
    raise InvalidArgument(
        f"start {start!r} must be 'earliest', 'latest', an ISO-8601 time with a timezone "
        "(2026-11-21T08:00Z), a relative time (-1h, -15m, -2d), milliseconds since the epoch, "
        "or a StreamCut"
    )


class ReaderCore:
    """Runs on the loop: resolves positions, opens follows, routes pushes to ``deliver``.

    Read order across scaling: a segment is followed only once it is *readable*, that is not
    finished and every predecessor finished (:meth:`SegmentGraph.readable`). A segment is
    finished when its start is at or past its end (a sealed segment's end, or the end cut's
    position), or when its follow ended. A follow of a sealed segment ends at the seal
    (``FollowEnded``); the core then describes the stream again (successors may have appeared
    after it opened) and follows the successors that became readable, from their start. So a
    key's events arrive in append order across any splits and merges: everything of a
    predecessor is delivered before anything of its successors.

    A segment's end is delivered (``Delivery(segment, opened=...)``) only after the segments
    it made readable are registered and before their follows are requested, so a consumer
    that adds ``opened`` to the segments it waits for never stops early.

    Several brokers: each segment is followed on the connection to the broker serving its
    container. A follow that fails with WrongBroker (the container moved) or loses its
    connection (the broker died) is opened again at the new owner from the offset after the
    last batch received, so nothing is lost or delivered twice; for up to the cluster's
    ``reconnect_timeout``, then the reader raises the error.

    Credit: each follow gets a share of ``CREDIT_BYTES`` (at least ``MIN_SEGMENT_CREDIT``); a
    follow opened later gets what the live follows leave, so the total stays within
    ``max(CREDIT_BYTES, live follows x MIN_SEGMENT_CREDIT)``.
    """

    def __init__(
        self,
        connection: Connection,
        stream: str,
        start: Start,
        end: StreamCut | None,
        deliver: Callable[[Delivery], None],
        cluster: Cluster | None = None,
    ) -> None:
        self.connection = connection
        self.links = None if cluster is None else Links(cluster, self._container)
        #: per segment, the connection its follow is on
        self.connections: dict[int, Connection] = {}
        #: per segment, the offset after the last batch received (where a moved follow resumes)
        self.received: dict[int, int] = {}
        self._moving: set[int] = set()
        #: segments whose follow moved and is not open again yet -> when it first moved
        self._moved_at: dict[int, float] = {}
        self._refollowing: asyncio.Task[None] | None = None
        self.stream = stream
        self.start_spec = parse_start(start)
        self.end = end
        self.deliver = deliver
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int | None] = {}
        self.sub_ids: dict[int, int] = {}
        #: per segment, the offset the next delivered batch must hold
        self.positions: dict[int, int] = {}
        #: every segment of every epoch, as last described
        self.segments: dict[int, SegmentInfo] = {}
        #: segments read to their end (or with nothing to read)
        self.finished: set[int] = set()
        #: live follows -> the credit each was opened with
        self._credit: dict[int, int] = {}
        #: follows that ended, whose successors are still to be looked up
        self._ended: list[int] = []
        self._advancing: asyncio.Task[None] | None = None

    def _container(self, segment: int) -> int:
        info = self.segments.get(segment)
        return 0 if info is None else info.container

    async def _ask(self, message: Message) -> Message:
        """A request for no segment in particular: any live broker (WrongBroker followed)."""
        if self.links is None:
            reply, _ = await self.connection.request(message)
        else:
            reply, _ = await self.links.cluster.request(message)
        return reply

    async def _cut(self, at: str, timestamp_ms: int | None = None) -> dict[int, int]:
        reply = await self._ask(GetCut(self.stream, at, timestamp_ms))
        return dict(reply.positions)  # type: ignore[attr-defined]

    async def _describe(self) -> None:
        reply = await self._ask(DescribeStream(self.stream))
        assert isinstance(reply, StreamInfo)
        self.segments = {s.number: s for s in reply.segments}

    def _ancestors(self, numbers: Collection[int]) -> set[int]:
        return preceding({n: s.predecessors for n, s in self.segments.items()}, numbers)

    async def open(self) -> list[int]:
        """Resolve the start and end, open a follow per readable segment; returns them.

        A StreamCut (or a resolved start) names a position per segment; segments it does not
        name are finished if they precede one it names (a cut taken before or after any
        scale), else read from their start. With an end cut, a segment ends at the cut's
        position, one that precedes a segment of the cut at its own end, and any other has
        nothing to read."""
        kind, timestamp_ms, cut = self.start_spec
        if cut is not None:
            if cut.stream != self.stream:
                raise InvalidArgument(f"StreamCut is for {cut.stream!r}, not {self.stream!r}")
            self.starts = dict(cut.positions)
        else:
            self.starts = await self._cut(kind, timestamp_ms)
        if self.end is not None and self.end.stream != self.stream:
            raise InvalidArgument(f"end StreamCut is for {self.end.stream!r}, not {self.stream!r}")
        await self._describe()
        self.finished = self._ancestors(self.starts.keys()) - self.starts.keys()
        segments = self._follow(self._readable())
        await self._request(segments)
        return segments

    def _end_of(self, segment: int) -> int | None:
        """Where reading ``segment`` stops (None: at its tail, for ever)."""
        if self.end is None:
            return None
        cut = self.end.positions
        if segment in cut:
            return cut[segment]
        if segment in self._ancestors(cut.keys()):
            return self.segments[segment].end_offset  # sealed: read it all
        return self.starts[segment]  # after the end cut: nothing to read

    def _readable(self) -> list[int]:
        """The segments to follow now, their starts and ends resolved; those with nothing to
        read are finished on the way (which may make their successors readable). A
        predecessor the stream no longer lists (its data deleted) holds nothing back."""
        readable: list[int] = []
        for number in sorted(self.segments):  # predecessors have lower numbers
            info = self.segments[number]
            if (
                number in self.finished
                or number in self.sub_ids
                or not all(p in self.finished or p not in self.segments for p in info.predecessors)
            ):
                continue
            self.starts.setdefault(number, info.start_offset)
            if number not in self.ends:
                self.ends[number] = self._end_of(number)
            end = self.ends[number]
            if end is None and info.sealed:
                end = info.end_offset
            if end is not None and self.starts[number] >= end:
                self.finished.add(number)
            else:
                readable.append(number)
        return readable

    def _follow(self, segments: list[int]) -> list[int]:
        """Register follows for ``segments`` (their pushes are routed from now on); returns
        them; :meth:`_request` then asks the broker for them."""
        if segments:
            held = sum(self._credit.values())
            share = min(
                CREDIT_BYTES // (len(self._credit) + len(segments)),
                (CREDIT_BYTES - held) // len(segments),
            )
            for segment in segments:
                self.sub_ids[segment] = 0  # its follow is requested by _request
                self._credit[segment] = max(MIN_SEGMENT_CREDIT, share)
        return segments

    async def _request(self, segments: list[int]) -> None:
        """Open the follows of ``segments``, each at the broker serving it, from the offset
        after what was received of it (its start, the first time). A WrongBroker answer
        (the map was stale) is followed to the owner it names, as long as the cluster's
        ``reconnect_timeout`` allows."""
        for segment in segments:
            deadline = time.monotonic() + self._patience()
            while True:
                connection = self.connection
                if self.links is not None:
                    connection = await self.links.connect(segment)
                sub_id = next(connection.follow_ids)
                self.sub_ids[segment] = sub_id
                self.connections[segment] = connection
                connection.follows[sub_id] = self._handler(segment, connection)
                offset = self.received.get(segment, self.starts[segment])
                try:
                    await connection.request(
                        Follow(
                            sub_id,
                            self.stream,
                            segment,
                            offset,
                            self.ends[segment],
                            self._credit[segment],
                        )
                    )
                    self._moved_at.pop(segment, None)
                    break
                except WrongBroker as exc:
                    connection.follows.pop(sub_id, None)
                    if self.links is None or time.monotonic() > deadline:
                        raise
                    self.links.moved(exc)
                    if not exc.details.get("address"):
                        await asyncio.sleep(0.05)
                except BrokerUnavailable:
                    if self.links is None:
                        raise
                    # lost with its connection: followed again by the task that follows moves
                    connection.follows.pop(sub_id, None)
                    self._move(segment)
                    break

    def _patience(self) -> float:
        return 0.0 if self.links is None else self.links.cluster.reconnect_timeout

    def _handler(
        self, segment: int, connection: Connection
    ) -> Callable[[Message | SlipstreamError, Payload], None]:
        def handle(message: Message | SlipstreamError, payload: Payload) -> None:
            if isinstance(message, Data):
                if self.links is not None:
                    self._note_received(segment, payload)
                self.deliver(Delivery(segment, payload))
            elif isinstance(message, FollowEnded):
                connection.follows.pop(message.sub_id, None)
                self._credit.pop(segment, None)
                self._ended.append(segment)
                if self._advancing is None or self._advancing.done():
                    self._advancing = asyncio.get_running_loop().create_task(self._advance())
            elif isinstance(message, FollowFailed):
                connection.follows.pop(message.sub_id, None)
                error = error_from_wire(message.code, message.message, message.details)
                if isinstance(error, WrongBroker) and self.links is not None:
                    self.links.moved(error)
                    self._move(segment)
                else:
                    self.deliver(Delivery(segment, error=error))
            elif isinstance(message, SlipstreamError):
                if isinstance(message, BrokerUnavailable) and self.links is not None:
                    self._move(segment)  # the broker is gone: its containers move
                else:
                    self.deliver(Delivery(segment, error=message))

        return handle

    def _note_received(self, segment: int, payload: Payload) -> None:
        """Remember the offset after the payload's last batch (headers only, no CRC: the
        consuming side checks every batch)."""
        with contextlib.suppress(CorruptBatch):
            for header, _ in iter_batches(payload, check_crc=False):
                self.received[segment] = header.next_offset

    def _move(self, segment: int) -> None:
        """Open the segment's follow again at its new owner (owned task, cancelled by close)."""
        if segment not in self.sub_ids:
            return
        self._moving.add(segment)
        self._moved_at.setdefault(segment, time.monotonic())
        if self._refollowing is None or self._refollowing.done():
            self._refollowing = asyncio.get_running_loop().create_task(self._refollow())

    async def _refollow(self) -> None:
        while self._moving:
            segment = min(self._moving)
            self._moving.discard(segment)
            if segment not in self.sub_ids or segment in self.finished:
                continue
            if time.monotonic() - self._moved_at.get(segment, time.monotonic()) > self._patience():
                self.deliver(
                    Delivery(
                        segment,
                        error=BrokerUnavailable(
                            f"segment {segment} of {self.stream!r}: no broker served its follow "
                            f"within reconnect_timeout ({self._patience():g} s)",
                            stream=self.stream,
                            segment=segment,
                        ),
                    )
                )
                return
            try:
                await self._request([segment])
            except SlipstreamError as exc:
                self.deliver(Delivery(segment, error=exc))
                return

    async def _advance(self) -> None:
        """Segments whose follows ended are finished: deliver their ends with the segments
        that became readable, then follow those. Owned by the core (``close`` cancels it)."""
        while self._ended:
            ended, self._ended = self._ended, []
            try:
                self.finished.update(ended)
                await self._describe()  # successors may be newer than what the reader knew
                opened = self._follow(self._readable())
                for i, segment in enumerate(ended):
                    self.deliver(Delivery(segment, opened=tuple(opened) if i == 0 else ()))
                await self._request(opened)
            except SlipstreamError as exc:
                self.deliver(Delivery(ended[0], error=exc))
                return
            except Exception as exc:  # a bug: the reader must fail, not wait for ever
                error = SlipstreamError(f"the reader could not follow the successors: {exc!r}")
                self.deliver(Delivery(ended[0], error=error))
                return

    def grant(self, segment: int, credit: int) -> None:
        sub_id = self.sub_ids.get(segment)
        connection = self.connections.get(segment, self.connection)
        if sub_id is not None and sub_id in connection.follows:
            connection.send_oneway(Credit(sub_id, credit))

    async def close(self) -> None:
        for task in (self._advancing, self._refollowing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for segment, sub_id in self.sub_ids.items():
            connection = self.connections.get(segment, self.connection)
            if connection.follows.pop(sub_id, None) is not None:
                with contextlib.suppress(SlipstreamError):  # already gone with the connection
                    await connection.request(Unfollow(sub_id))


class ReadState(Protocol):
    """Where each segment's reading started, ends, and the offset its next batch must hold
    (a ReaderCore; a consumer keeps one per grant of a segment)."""

    stream: str
    starts: dict[int, int]
    ends: dict[int, int | None]
    positions: dict[int, int]


def decode_delivery(
    delivery: Delivery, core: ReadState
) -> Iterator[tuple[int, int, pa.RecordBatch]]:
    """The record batches of one payload as ``(segment, base offset, batch)``, trimmed to the
    reader's start and end.

    Raises CorruptData naming segment and offset if a batch fails its CRC32C or its Arrow body
    does not decode, or if it is not the batch that comes next in the segment: the end-to-end
    check, for what the broker serves from memory and for damage on the way.
    """
    assert delivery.payload is not None
    segment = delivery.segment
    low = core.starts.get(segment, 0)
    high = core.ends.get(segment)
    expected = core.positions.get(segment, low)
    try:
        for header, view in iter_batches(delivery.payload):
            base = header.base_offset
            if not base <= expected < header.next_offset:
                raise CorruptBatch(f"the batch holds offsets {base} to {header.next_offset - 1}")
            record = read_body(view)
            check_event_schema(record)
            expected = core.positions[segment] = header.next_offset
            first = max(0, low - base)
            last = record.num_rows if high is None else min(record.num_rows, high - base)
            if last <= first:
                continue
            if first or last < record.num_rows:
                record = record.slice(first, last - first)
            yield segment, base + first, record
    except CorruptBatch as exc:
        raise CorruptData(
            f"corrupt data in segment {segment} of {core.stream!r} at offset {expected}: "
            f"{exc.message}",
            segment=segment,
            offset=expected,
        ) from exc


def with_position(segment: int, base: int, record: pa.RecordBatch) -> pa.RecordBatch:
    """Add ``segment`` and ``offset`` columns to a batch of events."""
    count = record.num_rows
    return record.append_column(
        "segment", numpy_array(np.full(count, segment, dtype=np.int32))
    ).append_column("offset", numpy_array(np.arange(base, base + count, dtype=np.int64)))


async def cut_at(
    request: Callable[[Message], Awaitable[Message]], stream: str, at: Start
) -> StreamCut:
    """Resolve a start/end position to a StreamCut on the broker (``request`` sends GetCut)."""
    kind, timestamp_ms, cut = parse_start(at)
    if cut is not None:
        if cut.stream != stream:
            raise InvalidArgument(f"StreamCut is for {cut.stream!r}, not {stream!r}")
        return cut
    reply = await request(GetCut(stream, kind, timestamp_ms))
    return StreamCut(stream, dict(reply.positions))  # type: ignore[attr-defined]
