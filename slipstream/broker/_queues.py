"""Work queues on the broker (modes ``queue`` and ``key_ordered_queue``): a dispatcher per
subscription hands events out to its members one by one and takes them back.

State per segment (``_SegmentQueue``): the *floor* (``SubscriptionRecord.positions``), below
which every event is settled; offsets settled above it (``done``: acknowledged or
dead-lettered); delivery counts of events still open; and, in memory only, the events in
flight (member, ack deadline, delivery count), the events waiting for a redelivery (until
their backoff passes), those waiting to be dead-lettered, and the events ready to hand out.
The dispatcher reads the log through the container read path as whole batches, at most
``MAX_AHEAD`` events past the floor, and hands the batches holding the delivered events to
the member unchanged: it decodes nothing except, in ``key_ordered_queue``, the key column.

Guarantees and failure modes:

* An event is in flight with at most one member at a time. Acks and nacks of events the
  member does not hold (never delivered to it, already settled, redelivered elsewhere after
  its ack timeout, or from before a reset or a broker restart) are answered as ``unknown``.
* An ack or nack is durable before its answer: concurrent settles share one MetaStore write
  (group commit on the catalog thread). Delivery counts are written with the next settle or
  within ``COUNTS_FLUSH_S``; a broker crash may forget a delivery made since (the event is
  delivered again without that count).
* Not acknowledged within ``ack_timeout_ms``: delivered again after a backoff (``backoff_ms``
  doubling per delivery up to ``max_backoff_ms``); a nack: after its delay. A member that
  leaves, disconnects or expires gives its events back at once (that delivery counts).
  After ``max_deliveries`` the event is appended to the dead-letter stream (created on
  demand with the source's segment count) with headers saying why, then settled. The append
  is durable before the settle, so a crash between the two dead-letters it twice, never
  loses it.
* ``key_ordered_queue``: at most one event per routing key is in flight, in offset order per
  key (per segment: a key lives in one segment between scalings). An event that fails holds
  back only its own key until it is acknowledged or dead-lettered. Events without a key are
  not ordered. A hot key can fill the ``MAX_AHEAD`` window of its segment with its own
  events; then that segment waits for the key.
* Members are not durable (see ``_groups``): after a broker restart nothing is in flight;
  every open event is delivered again with its stored count.

In a cluster (docs/cluster.md, "Queue subscriptions") the dispatcher runs at the broker
coordinating the subscription's group and reads the segments other brokers serve from them
(``ReadSegment``; ``Queues.read``), asking again every ``REMOTE_POLL_S`` while members wait,
since nothing here hears of their new events; a dead letter for another broker's segment is a
plain ``Append`` to it (``Queues.append``: at-least-once, like the local one). A dispatcher
starts from the catalog's queue state (the coordinator may have moved here), and one whose
group is coordinated elsewhere now is dropped; its members get WrongBroker and join there.
Every write of a group's state (queue state, positions, resets: ``Queues.store``) is fenced
by the lease of the container coordinating the group: a coordinator paused or cut off past its
lease that goes on afterwards writes nothing over its successor's state (LeaseLost in the
catalog's transaction), and its members are answered WrongBroker, never success; nor does it
hand out events from its old state (a fetch checks the lease first, ``check_lease``): no event
whose ack was answered is delivered again, no position goes back.

Threads: everything here runs on the event loop; MetaStore writes go through
``Controller.in_catalog``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    LeaseLost,
    ModeMismatch,
    OffsetOutOfRange,
    SlipstreamError,
    StaleGeneration,
    StreamExists,
    WrongBroker,
)
from ..cluster import coordinator
from ..format import (
    FLAG_NO_KEYS,
    Event,
    binary_array,
    decode_header,
    encode_body_parts,
    encode_header,
    events_of,
    headers_array,
    iter_batches,
    make_record_batch,
    read_body,
    timestamp_array,
    verify,
)
from ..protocol import Append, AppendAck, Message, Payload, ReadSegment, SegmentData
from ..storage import Lease, QueueOptions, QueueSegment
from ..streams import Router

if TYPE_CHECKING:
    from ._controller import Stream
    from ._groups import Group, Member, Subscriptions
    from ._segment import Segment
    from ._service import Caller, Service

log = logging.getLogger("slipstream.queues")

QUEUE_MODES = ("queue", "key_ordered_queue")
#: how often ack deadlines, backoffs and new data are checked
TICK_S = 0.01
#: events a segment's dispatcher reads past its floor (bounds memory and the stored state)
MAX_AHEAD = 20_000
READ_BYTES = 1 << 20
#: delivery counts not written by a settle are written this often
COUNTS_FLUSH_S = 1.0
MAX_FETCH_EVENTS = 10_000
MAX_FETCH_WAIT_MS = 30_000
#: a failed dead-letter append is tried again after this long
DEAD_LETTER_RETRY_S = 1.0
#: in a cluster: a segment served by another broker is asked for new events this often while
#: members wait (nothing tells this broker of them), and after a failed ask at most this often
REMOTE_POLL_S = 0.1
REMOTE_RETRY_MAX_S = 2.0

Batch = bytes | bytearray | memoryview
T = TypeVar("T")
#: a batch with the offsets it holds: (base offset, next offset, batch)
Located = tuple[int, int, Batch]


@dataclass(frozen=True, slots=True)
class SegmentRead:
    """What a read of a segment found: whole batches, and the segment's durable end and
    whether it is sealed, as the broker serving it knows them."""

    batches: list[Batch]
    end: int
    sealed: bool


@dataclass(slots=True)
class _Flight:
    member: int
    deadline: float
    count: int


class _SegmentQueue:
    """One segment's queue state (see the module docstring)."""

    def __init__(self, number: int, floor: int, stored: QueueSegment | None) -> None:
        self.number = number
        self.floor = floor
        self.scanned = floor  # the next offset to read from the log
        self.done: set[int] = {o for o in stored.done if o >= floor} if stored else set()
        self.counts: dict[int, int] = (
            {o: c for o, c in stored.deliveries.items() if o >= floor} if stored else {}
        )
        self.ready: list[int] = []  # a heap of offsets to hand out
        self.in_flight: dict[int, _Flight] = {}
        self.waiting: dict[int, float] = {}  # offset -> when it may go out again
        self.exhausted: dict[int, str] = {}  # offset -> why: to be dead-lettered
        self.failure: dict[int, str] = {}  # offset -> why its last delivery failed
        self.keys: dict[int, bytes] = {}  # key_ordered_queue: the key of each open keyed event
        self.by_key: dict[bytes, deque[int]] = {}  # key -> its open offsets, in order
        # batches read and not yet handed out whole (redeliveries read again)
        self.bases: list[int] = []
        self.batches: dict[int, Located] = {}
        self.unsent: dict[int, int] = {}  # base -> its events not handed out yet
        self.fresh: set[int] = set()  # offsets read and not handed out since
        self.dead_lettered = 0
        self.reading = asyncio.Lock()
        # a segment served by another broker: its end and seal as last heard, when to ask next
        self.end = 0
        self.sealed = False
        self.poll_at = 0.0
        self.failures = 0
        self.advance()

    def advance(self) -> None:
        """Move the floor over the settled events right above it."""
        while self.floor in self.done:
            self.done.remove(self.floor)
            self.floor += 1
        self.scanned = max(self.scanned, self.floor)

    def skip_to(self, start: int) -> None:
        """Retention removed everything below ``start``: those events are gone."""
        if start <= self.floor:
            return
        self.floor = start
        self.scanned = max(self.scanned, start)
        self.done = {o for o in self.done if o >= start}
        self.counts = {o: c for o, c in self.counts.items() if o >= start}
        self.advance()

    def pop_ready(self) -> int | None:
        while self.ready:
            offset = heapq.heappop(self.ready)
            if offset in self.done or offset in self.in_flight or offset in self.waiting:
                continue  # a stale entry
            if offset in self.exhausted:
                continue
            return offset
        return None

    def hand_out(self, offset: int) -> Located | None:
        """``offset`` goes out: the cached batch holding it (None: read it again). The
        cache drops a batch once every event read with it went out once."""
        at = bisect.bisect_right(self.bases, offset) - 1
        if at < 0:
            return None
        base = self.bases[at]
        located = self.batches[base]
        if offset >= located[1]:
            return None
        if offset in self.fresh:
            self.fresh.discard(offset)
            self.unsent[base] -= 1
            if self.unsent[base] <= 0:
                del self.bases[at], self.batches[base], self.unsent[base]
        return located

    def counts_for_describe(self) -> tuple[int, int]:
        return len(self.in_flight), len(self.waiting) + len(self.exhausted)


class Dispatcher:
    """The live side of one queue subscription (on the event loop)."""

    def __init__(self, queues: Queues, group: Group) -> None:
        record = group.record
        self.queues = queues
        self.group = group
        self.generation = record.generation
        self.options = record.options or QueueOptions()
        self.key_ordered = record.mode == "key_ordered_queue"
        self.segments: dict[int, _SegmentQueue] = {}
        self.held: dict[int, dict[tuple[int, int], None]] = {}  # member -> its deliveries
        # (deadline, id, segment, [(offset, delivery count), ...]): one entry per hand-out
        self.deadlines: list[tuple[float, int, int, list[tuple[int, int]]]] = []
        self._timer_ids = itertools.count()
        self.timers: list[tuple[float, int, int]] = []  # (ready at, segment, offset)
        self.changed = asyncio.Event()
        self.fetchers = 0
        self.rotation = 0
        self.closed = False
        self.version = 0
        self.durable_version = 0
        self.dirty: set[int] = set()
        self.commit_lock = asyncio.Lock()
        self.last_flush = asyncio.get_running_loop().time()
        self.dead_letter_after = 0.0
        self.sync_segments()

    def sync_segments(self) -> None:
        """Pick up segments the stream gained (a scaled stream) since."""
        record = self.group.record
        for number, segment in self.group.stream.segments.items():
            if number not in self.segments:
                floor = max(
                    record.positions.get(number, segment.start_offset), segment.start_offset
                )
                self.segments[number] = _SegmentQueue(number, floor, record.queue.get(number))

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _may_read(self, segment: Segment) -> bool:
        """key_ordered_queue: a successor of a scale is read only once every predecessor is
        settled to its end, so two events of one key (one on each side of the scale) are
        never out at once or out of order. A plain queue reads every segment at once."""
        if self.group.record.mode != "key_ordered_queue":
            return True
        stream = self.group.stream
        for number in segment.predecessors:
            predecessor, queue = stream.segments.get(number), self.segments.get(number)
            if predecessor is None or queue is None:
                continue  # gone with retention or its stream: nothing left to settle
            end, sealed = self._bounds(queue, predecessor)
            if not sealed or queue.floor < end:
                return False
        return True

    def _bounds(self, queue: _SegmentQueue, segment: Segment) -> tuple[int, bool]:
        """The segment's durable end and whether it is sealed: live when this broker serves
        it; else the later of the catalog's view and the last answer of its broker (both only
        grow)."""
        if self.queues.serves(segment):
            return segment.next_offset, segment.sealed
        return max(segment.next_offset, queue.end), segment.sealed or queue.sealed

    def _due(self, queue: _SegmentQueue, segment: Segment, now: float) -> bool:
        """Whether ``fill`` would read the segment now: events known past what was read, or
        (another broker's segment) time to ask it again."""
        if queue.scanned - queue.floor >= MAX_AHEAD:
            return False
        end, sealed = self._bounds(queue, segment)
        if queue.scanned < end:
            return True
        return not sealed and not self.queues.serves(segment) and now >= queue.poll_at

    def close(self) -> None:
        self.closed = True
        self.wake()

    def held_by(self, member_id: int) -> int:
        return len(self.held.get(member_id, ()))

    def ready_count(self) -> int:
        return sum(len(s.ready) for s in self.segments.values())

    # --- reading -------------------------------------------------------------------------

    async def fill(self, want: int) -> None:
        """Read more of the log while fewer than ``want`` events are ready. Segments served
        here are read in turn; those another broker serves are asked all at once (a broker
        that does not answer delays this fill by at most PEER_TIMEOUT_S, then is asked again
        after a backoff)."""
        self.sync_segments()
        queues = list(self.segments.values())
        now = asyncio.get_running_loop().time()
        remote: list[tuple[_SegmentQueue, Segment]] = []
        for queue in queues:
            if self.closed or self.ready_count() >= want:
                break
            segment = self.group.stream.segments.get(queue.number)
            if segment is None or queue.reading.locked() or not self._may_read(segment):
                continue
            if segment.start_offset > queue.floor:
                queue.skip_to(segment.start_offset)
                self._changed(queue)
            if not self._due(queue, segment, now):
                continue
            if not self.queues.serves(segment):
                remote.append((queue, segment))
                continue
            async with queue.reading:
                container = self.queues.controller.containers[segment.container]
                try:
                    batches = await container.read(segment, queue.scanned, READ_BYTES)
                except OffsetOutOfRange:
                    continue  # retention moved the start: skipped above next time
                if self.closed:
                    return
                for batch in batches:
                    self._scan(queue, batch)
        if remote and not self.closed:
            await asyncio.gather(*(self._fill_remote(q, s) for q, s in remote))

    async def _fill_remote(self, queue: _SegmentQueue, segment: Segment) -> None:
        """Read on from another broker's segment (``Queues.read``). Its broker gone, the
        container moving (WrongBroker, BrokerUnavailable) or any other failure: asked again
        after a backoff; below its retained start: skipped to it."""
        async with queue.reading:
            loop = asyncio.get_running_loop()
            try:
                read = await self.queues.read(segment, queue.scanned, READ_BYTES)
            except OffsetOutOfRange as exc:
                oldest = exc.details.get("oldest")
                if isinstance(oldest, int) and oldest > queue.floor:
                    queue.skip_to(oldest)
                    self._changed(queue)
                queue.poll_at = loop.time() + REMOTE_POLL_S
                return
            except SlipstreamError as exc:
                queue.failures += 1
                queue.poll_at = loop.time() + min(
                    REMOTE_POLL_S * 2**queue.failures, REMOTE_RETRY_MAX_S
                )
                if queue.failures == 1 or not isinstance(exc, WrongBroker | BrokerUnavailable):
                    log.info(
                        "segment %d of %s not read (asked again): %s",
                        queue.number,
                        self.queues.label(self.group),
                        exc,
                    )
                return
            queue.failures = 0
            queue.end = max(queue.end, read.end)
            queue.sealed = queue.sealed or read.sealed
            if self.closed:
                return
            for batch in read.batches:
                self._scan(queue, batch)
            # read on at once while its broker has more; else ask again in a moment
            queue.poll_at = loop.time() + (REMOTE_POLL_S if queue.scanned >= queue.end else 0)

    def _scan(self, queue: _SegmentQueue, batch: Batch) -> None:
        header = decode_header(batch)
        base = header.base_offset
        first = max(base, queue.scanned)
        if first >= header.next_offset:
            return
        offsets = [o for o in range(first, header.next_offset) if o not in queue.done]
        queue.scanned = header.next_offset
        if not offsets:
            return
        keys: list[bytes | None] | None = None
        if self.key_ordered and not header.flags & FLAG_NO_KEYS:
            keys = read_body(batch).column(0).to_pylist()
        limit = self.options.max_deliveries
        for offset in offsets:
            key = keys[offset - base] if keys is not None else None
            head = True
            if key is not None:
                queue.keys[offset] = key
                waiting = queue.by_key.get(key)
                if waiting is None:
                    waiting = queue.by_key[key] = deque()
                head = not waiting
                waiting.append(offset)
            if not head:
                continue
            if queue.counts.get(offset, 0) >= limit:  # delivered often enough before a restart
                queue.exhausted[offset] = queue.failure.get(offset, "delivered before a restart")
            else:
                heapq.heappush(queue.ready, offset)
        queue.fresh.update(offsets)
        queue.bases.append(base)
        queue.batches[base] = (base, header.next_offset, batch)
        queue.unsent[base] = len(offsets)

    # --- handing out ---------------------------------------------------------------------

    def take(
        self, member_id: int, room: int, now: float
    ) -> list[tuple[int, int, int, Located | None]]:
        """Up to ``room`` ready events for the member, round-robin over the segments:
        ``(segment, offset, delivery count, cached batch or None)``."""
        order = sorted(self.segments)
        if not order:
            return []
        shift = self.rotation % len(order)
        self.rotation += 1
        active = [self.segments[n] for n in order[shift:] + order[:shift] if self.segments[n].ready]
        picked: list[tuple[int, int, int, Located | None]] = []
        deadline = now + self.options.ack_timeout_ms / 1000
        held = self.held.setdefault(member_id, {})
        while len(picked) < room and active:
            share = max(1, (room - len(picked)) // len(active))  # per segment, this round
            for queue in list(active):
                number, counts, in_flight = queue.number, queue.counts, queue.in_flight
                taken: list[tuple[int, int]] = []
                while len(taken) < share and len(picked) < room:
                    offset = queue.pop_ready()
                    if offset is None:
                        active.remove(queue)
                        break
                    count = counts.get(offset, 0) + 1
                    counts[offset] = count
                    in_flight[offset] = _Flight(member_id, deadline, count)
                    held[(number, offset)] = None
                    taken.append((offset, count))
                    picked.append((number, offset, count, queue.hand_out(offset)))
                if taken:  # one timer entry for the lot
                    heapq.heappush(self.deadlines, (deadline, next(self._timer_ids), number, taken))
                    self._changed(queue)
                if len(picked) >= room:
                    break
        return picked

    async def payload(
        self, picked: list[tuple[int, int, int, Located | None]]
    ) -> tuple[list[list[int]], list[Batch]]:
        """The deliveries and the whole batches that hold them (each batch once)."""
        deliveries: list[list[int]] = []
        batches: dict[tuple[int, int], Located] = {}
        for number, offset, count, located in picked:
            if located is None:
                try:
                    located = self._from(batches, number, offset) or await self._read(
                        number, offset
                    )
                except SlipstreamError as exc:  # another broker's segment, unreadable now
                    self._take_back(number, offset, count, exc)
                    continue
            if located is None:
                continue  # removed by retention meanwhile: settled as gone
            batches.setdefault((number, located[0]), located)
            deliveries.append([number, offset, count])
        return deliveries, [batch for _, _, batch in batches.values()]

    @staticmethod
    def _from(batches: dict[tuple[int, int], Located], number: int, offset: int) -> Located | None:
        for (segment, base), located in batches.items():
            if segment == number and base <= offset < located[1]:
                return located
        return None

    def _take_back(self, number: int, offset: int, count: int, exc: SlipstreamError) -> None:
        """A delivery that could not be made after all (its batch unreadable now): undone,
        not counted, ready again."""
        queue = self.segments[number]
        flight = queue.in_flight.get(offset)
        if flight is None or flight.count != count:
            return
        del queue.in_flight[offset]
        self.held.get(flight.member, {}).pop((number, offset), None)
        if count > 1:
            queue.counts[offset] = count - 1
        else:
            queue.counts.pop(offset, None)
        heapq.heappush(queue.ready, offset)
        log.info(
            "event %d of segment %d of %s not delivered now (read again later): %s",
            offset,
            number,
            self.queues.label(self.group),
            exc,
        )

    async def _read(self, number: int, offset: int) -> Located | None:
        """The batch holding ``offset``, read again; None (and the event settled) if
        retention removed it. Raises what reading another broker's segment raised
        (WrongBroker, BrokerUnavailable: nothing settled)."""
        segment = self.group.stream.segments[number]
        try:
            batches = (await self.queues.read(segment, offset, 1)).batches
        except OffsetOutOfRange as exc:
            if "end" in exc.details:  # past the end its broker knows: not retention
                raise
            batches = []
        for batch in batches:
            header = decode_header(batch)
            if header.base_offset <= offset < header.next_offset:
                return header.base_offset, header.next_offset, batch
        log.warning(
            "event %d of segment %d of %s was removed by retention before it was settled",
            offset,
            number,
            self.queues.label(self.group),
        )
        queue = self.segments[number]
        flight = queue.in_flight.pop(offset, None)
        if flight is not None:
            self.held.get(flight.member, {}).pop((number, offset), None)
        queue.waiting.pop(offset, None)
        queue.exhausted.pop(offset, None)
        self._settle(queue, offset)
        return None

    # --- settling ------------------------------------------------------------------------

    def _holding(self, member_id: int, number: int, offset: int) -> _Flight | None:
        queue = self.segments.get(number)
        flight = queue.in_flight.get(offset) if queue is not None else None
        if flight is None or flight.member != member_id:
            return None
        del self.segments[number].in_flight[offset]
        self.held.get(member_id, {}).pop((number, offset), None)
        return flight

    def ack(self, member_id: int, number: int, offset: int) -> bool:
        if self._holding(member_id, number, offset) is None:
            return False
        self._settle(self.segments[number], offset)
        return True

    def nack(self, member_id: int, number: int, offset: int, delay: float, now: float) -> bool:
        flight = self._holding(member_id, number, offset)
        if flight is None:
            return False
        self._retry(self.segments[number], offset, flight.count, now + delay, now, "nacked")
        return True

    def _settle(self, queue: _SegmentQueue, offset: int) -> None:
        if offset >= queue.floor:  # (below it: removed by retention meanwhile)
            queue.done.add(offset)
        queue.counts.pop(offset, None)
        queue.failure.pop(offset, None)
        queue.fresh.discard(offset)
        key = queue.keys.pop(offset, None)
        if key is not None:  # the next event of its key may go out now
            waiting = queue.by_key[key]
            was_head = waiting[0] == offset
            waiting.remove(offset)
            if not waiting:
                del queue.by_key[key]
            elif was_head:
                heapq.heappush(queue.ready, waiting[0])
                self.wake()
        queue.advance()
        self._changed(queue)

    def _retry(
        self, queue: _SegmentQueue, offset: int, count: int, at: float, now: float, why: str
    ) -> None:
        """A delivery failed: out again at ``at``, or dead-lettered after the last one."""
        queue.failure[offset] = why
        if count >= self.options.max_deliveries:
            queue.exhausted[offset] = why
        elif at <= now:
            heapq.heappush(queue.ready, offset)
            self.wake()
        else:
            queue.waiting[offset] = at
            heapq.heappush(self.timers, (at, queue.number, offset))

    def member_left(self, member_id: int) -> None:
        """Its events are available again at once (the delivery counts)."""
        now = asyncio.get_running_loop().time()
        for number, offset in self.held.pop(member_id, {}):
            queue = self.segments[number]
            flight = queue.in_flight.pop(offset, None)
            if flight is not None:
                self._retry(queue, offset, flight.count, now, now, "member left")
        self.wake()

    def tick(self, now: float) -> None:
        """Ack timeouts, ended backoffs, and new data for waiting fetches."""
        options = self.options
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, number, taken = heapq.heappop(self.deadlines)
            queue = self.segments[number]
            for offset, count in taken:
                flight = queue.in_flight.get(offset)
                if flight is None or flight.count != count:
                    continue  # settled, or a later delivery
                del queue.in_flight[offset]
                self.held.get(flight.member, {}).pop((number, offset), None)
                backoff = min(options.backoff_ms * 2 ** (count - 1), options.max_backoff_ms)
                self._retry(queue, offset, count, now + backoff / 1000, now, "ack timeout")
        woken = False
        while self.timers and self.timers[0][0] <= now:
            _, number, offset = heapq.heappop(self.timers)
            queue = self.segments[number]
            at = queue.waiting.get(offset)
            if at is None or at > now:
                continue
            del queue.waiting[offset]
            heapq.heappush(queue.ready, offset)
            woken = True
        if not woken and self.fetchers:
            woken = len(self.segments) != len(self.group.stream.segments) or any(
                self._due(q, s, now)
                for q in self.segments.values()
                if (s := self.group.stream.segments.get(q.number)) is not None
            )
        if woken:
            self.wake()

    # --- dead letters --------------------------------------------------------------------

    def exhausted(self) -> bool:
        return any(q.exhausted for q in self.segments.values())

    async def dead_letter(self) -> None:
        """Append the events that ran out of deliveries to the dead-letter stream, then
        settle them. Raises what the append raised (they are tried again later)."""
        todo = [(q, o, why) for q in self.segments.values() for o, why in q.exhausted.items()]
        events: list[tuple[_SegmentQueue, Event, str]] = []
        for queue, offset, why in todo:
            located = await self._read(queue.number, offset)
            if located is None:
                continue
            base, _, batch = located
            record = read_body(batch).slice(offset - base, 1)
            events.extend((queue, e, why) for e in events_of(record, queue.number, offset))
        if not events or self.closed:
            return
        name = self.options.dead_letter or f"{self.group.stream.name}.dlq"
        target = await self.queues.dead_letter_stream(name, len(self.group.stream.segments))
        open_segments = sorted(
            (s for s in target.segments.values() if not s.sealed), key=lambda s: s.number
        )
        router = Router([(s.number, s.key_lo, s.key_hi) for s in open_segments])
        grouped: dict[int, list[tuple[_SegmentQueue, Event, str]]] = {}
        for item in events:
            queue, event = item[0], item[1]
            number = (
                router.segment_for(event.key)
                if event.key is not None
                else open_segments[queue.number % len(open_segments)].number
            )
            grouped.setdefault(number, []).append(item)
        source = self.group.stream.name.encode()
        subscription = self.group.record.name.encode()
        for number, items in grouped.items():
            headers = []
            for queue, event, why in items:
                count = queue.counts.get(event.offset, self.options.max_deliveries)
                headers.append(
                    {
                        **event.headers,
                        "x-dead-letter-reason": (
                            f"max_deliveries ({self.options.max_deliveries}) reached; last "
                            f"delivery: {why}"
                        ).encode(),
                        "x-deliveries": str(count).encode(),
                        "x-source-stream": source,
                        "x-source-subscription": subscription,
                        "x-source-segment": str(event.segment).encode(),
                        "x-source-offset": str(event.offset).encode(),
                    }
                )
            evs = [item[1] for item in items]
            record = make_record_batch(
                binary_array([e.key for e in evs]),
                binary_array([e.value for e in evs]),
                timestamp_array([e.timestamp for e in evs]),
                headers_array(headers),
            )
            body = encode_body_parts(record)
            stamps = [e.timestamp for e in evs]
            head = encode_header(
                body, event_count=len(evs), min_timestamp=min(stamps), max_timestamp=max(stamps)
            )
            batch = bytearray(b"".join([head, *(bytes(p) for p in body)]))
            await self.queues.append(target.segments[number], batch)
            if self.closed:
                return
            for queue, event, _ in items:
                if queue.exhausted.pop(event.offset, None) is not None:
                    queue.dead_lettered += 1
                    self._settle(queue, event.offset)
        await self.durable()

    # --- durability ----------------------------------------------------------------------

    def _changed(self, queue: _SegmentQueue) -> None:
        self.dirty.add(queue.number)
        self.version += 1

    async def durable(self) -> None:
        """Return once every change made before the call is stored (group commit: callers
        that arrive while a write runs share the next one). Raises StaleGeneration after a
        reset, StorageError when the catalog cannot be written, WrongBroker when this broker
        no longer coordinates the group (its state is the new coordinator's now)."""
        wanted = self.version
        async with self.commit_lock:
            if self.durable_version >= wanted:
                return
            version = self.version
            dirty, self.dirty = self.dirty, set()
            positions = {n: self.segments[n].floor for n in dirty}
            state = {
                n: QueueSegment(sorted(self.segments[n].done), dict(self.segments[n].counts))
                for n in dirty
            }
            record = self.group.record
            controller = self.queues.controller
            try:
                await self.queues.store(
                    self.group,
                    controller.meta.commit_positions,
                    record.stream_id,
                    record.name,
                    self.generation,
                    positions,
                    state,
                )
            except BaseException:
                self.dirty |= dirty
                raise
            self.durable_version = version
            self.last_flush = asyncio.get_running_loop().time()
            record = self.group.record
            if record.generation == self.generation:
                self.group.record = msgspec.structs.replace(
                    record,
                    positions={**record.positions, **positions},
                    queue={**record.queue, **state},
                )


class Queues:
    """The dispatchers of the queue subscriptions, for ``Subscriptions`` and the service
    layer (on the event loop). A dispatcher starts with the first fetch or settle of its
    subscription, from the stored state; a reset or delete drops it."""

    def __init__(self, subscriptions: Subscriptions) -> None:
        self.subscriptions = subscriptions
        self.controller = subscriptions.controller
        self.dispatchers: dict[Group, Dispatcher] = {}
        #: the service (set by it): in a cluster, who coordinates a group and the other
        #: brokers' segments (None: every segment is served here, as in a standalone broker)
        self.service: Service | None = None
        self._starting = asyncio.Lock()

    @property
    def clustered(self) -> bool:
        return self.service is not None and self.service.cluster.enabled

    async def dispatcher(self, group: Group) -> Dispatcher:
        """The group's dispatcher, started from its stored state if it has none (in a
        cluster the catalog's state is read first: the coordinator may have moved here from
        a broker that acknowledged events since this one last looked)."""
        dispatcher = self.dispatchers.get(group)
        if dispatcher is not None and dispatcher.generation == group.record.generation:
            return dispatcher
        async with self._starting:  # one start at a time: a second would void the first's
            dispatcher = self.dispatchers.get(group)
            if dispatcher is not None and dispatcher.generation == group.record.generation:
                return dispatcher
            if self.clustered:
                await self._stored(group)
            if dispatcher is not None:
                dispatcher.close()
            dispatcher = self.dispatchers[group] = Dispatcher(self, group)
            return dispatcher

    async def _stored(self, group: Group) -> None:
        """Take the catalog's record of ``group`` (positions and queue state written by the
        broker that coordinated it before). A newer generation there (a reset made through
        another broker): the reset is applied here (members join again)."""
        controller, seen = self.controller, group.record
        stored = await asyncio.get_running_loop().run_in_executor(
            controller.read_pool, controller.meta.subscriptions, seen.stream_id
        )
        for record in stored:
            if record.name != seen.name or group.record is not seen:
                continue
            if record.generation == seen.generation:
                group.record = record
            elif record.generation > seen.generation:
                group.record = record
                self.reset(group)

    def check_here(self, group: Group) -> None:
        """In a cluster: WrongBroker unless this broker coordinates ``group`` (its members
        join again at the broker that does)."""
        if self.clustered:
            assert self.service is not None
            self.service._group_here(group.stream.name, group.record.name)

    def check_lease(self, group: Group) -> None:
        """In a cluster: WrongBroker unless this broker surely still holds the lease of the
        container coordinating ``group`` (``Container.lease_error``: not lost, its deadline on
        this broker's monotonic clock not passed). The guard of what the dispatcher hands out:
        a coordinator paused past its lease hands out nothing from its old state when it wakes
        (events its successor may have seen acknowledged since). Its writes need no such
        guard: the catalog refuses them (``store``)."""
        if not self.clustered:
            return
        assert self.service is not None
        cid = self._coordinator(group)
        lost = self.controller.containers[cid].lease_error()
        if lost is not None:
            self.reset(group)
            raise self.service.cluster.wrong_broker(
                cid, f"the group of subscription {self.label(group)} ({lost})"
            )

    def _coordinator(self, group: Group) -> int:
        assert self.service is not None
        return coordinator(f"{group.stream.name}/{group.record.name}", self.service.cluster.count)

    def fence(self, group: Group) -> Lease | None:
        """The lease that fences the catalog writes of ``group``'s state: in a cluster, that
        of the container coordinating the group while this broker serves it (the container's
        own, as last renewed: the one its journal and chunk writes carry); None standalone
        (one broker per catalog) or when another broker serves it (a reset made through any
        broker is ordered by the generation it starts, not by a lease)."""
        if not self.clustered:
            return None
        container = self.controller.containers[self._coordinator(group)]
        return container.lease if container.serving else None

    async def store(
        self, group: Group, write: Callable[..., T], *args: Any, here: bool = True
    ) -> T:
        """Run ``write(*args, lease=...)``, a MetaStore write of ``group``'s state
        (``commit_positions``, ``reset_subscription``), on the catalog thread, fenced by
        ``fence(group)``. ``here``: the coordinator's own write (positions, queue state):
        WrongBroker first unless this broker coordinates the group, so that nothing is
        written unfenced after a hand-over. Refused with LeaseLost (another broker took the
        coordinating container: this one was paused or cut off past its lease), nothing was
        stored: answered WrongBroker, never success, and a queue's state here is dropped
        (its members join again at the new coordinator, which has the stored state)."""
        if here:
            self.check_here(group)
        lease = self.fence(group)
        try:
            return await self.controller.in_catalog(functools.partial(write, *args, lease=lease))
        except LeaseLost as exc:
            assert self.service is not None
            log.warning(
                "%s: its state was not stored, this broker no longer coordinates it: %s",
                self.label(group),
                exc,
            )
            self.reset(group)
            raise self.service.cluster.wrong_broker(
                self._coordinator(group), f"the group of subscription {self.label(group)}"
            ) from exc

    def serves(self, segment: Segment) -> bool:
        """Whether this broker serves ``segment`` (always, standalone)."""
        if not self.clustered:
            return True
        container = self.controller.containers[segment.container]
        return container.serving and container.segments.get(segment.global_id) is segment

    async def read(self, segment: Segment, offset: int, max_bytes: int) -> SegmentRead:
        """Whole batches of ``segment`` from ``offset`` (at least one if any, then up to
        ``max_bytes``): from its container when this broker serves it, else from the broker
        that does (ReadSegment). Raises OffsetOutOfRange (details ``oldest``: below the
        retained start), WrongBroker (nobody serves it now, or the owner handed it over),
        BrokerUnavailable (the owner does not answer), or what the read raised."""
        if self.serves(segment):
            batches = await self.controller.containers[segment.container].read(
                segment, offset, max_bytes
            )
            return SegmentRead(batches, segment.next_offset, segment.sealed)
        reply, payload = await self._ask(
            segment, ReadSegment(segment.stream_name, segment.number, offset, max_bytes)
        )
        if not isinstance(reply, SegmentData):
            raise SlipstreamError(f"a broker answered ReadSegment with {type(reply).__name__}")
        batches = [batch for _, batch in iter_batches(payload)]
        return SegmentRead(batches, reply.end_offset, reply.sealed)

    async def append(self, segment: Segment, batch: bytearray) -> None:
        """Append ``batch`` to ``segment`` and return once it is durable: through its
        container here, else as a plain Append to the broker serving it. Not idempotent: an
        append whose answer is lost (a timeout, the owner dying after it made the batch
        durable) fails and is appended again by the caller's retry (at-least-once)."""
        if self.serves(segment):
            await self.controller.containers[segment.container].append(
                segment, batch, verify(batch)
            )
            return
        reply, _ = await self._ask(segment, Append(segment.stream_name, segment.number), [batch])
        if not isinstance(reply, AppendAck):
            raise SlipstreamError(f"a broker answered Append with {type(reply).__name__}")

    async def _ask(
        self,
        segment: Segment,
        message: Append | ReadSegment,
        payload: list[bytearray] | None = None,
    ) -> tuple[Message, Payload]:
        """``message`` for ``segment`` to the broker serving it (Peers.exchange)."""
        assert self.service is not None
        cluster = self.service.cluster
        owner = cluster.owners[segment.container]
        if not owner or owner == cluster.broker_id:  # nobody serves it, or it is leaving here
            raise cluster.wrong_broker(
                segment.container, f"segment {segment.number} of {segment.stream_name!r}"
            )
        try:
            return await self.service.peers.exchange(owner, message, payload or ())
        except TimeoutError:
            raise BrokerUnavailable(f"broker {owner!r} did not answer in time") from None

    def _member(self, caller: Caller, member_id: int) -> Member:
        member = self.subscriptions.member(caller, member_id)
        mode = member.group.record.mode
        if mode not in QUEUE_MODES:
            raise ModeMismatch(
                f"subscription {member.group.record.name!r} is {mode!r}: its members poll "
                "for segments (PollGroup), they do not fetch events",
                mode=mode,
            )
        return member

    async def fetch(
        self, caller: Caller, member_id: int, max_events: int, wait_ms: int
    ) -> tuple[list[list[int]], list[Batch]]:
        """Up to ``max_events`` events for the member (fewer when it holds ``max_unacked``
        already), waiting up to ``wait_ms`` for some: ``([segment, offset, delivery count],
        ...)`` and the whole batches holding them. A fetch is also the member's heartbeat.
        Raises UnknownMember, SubscriptionNotFound, ModeMismatch (an ordered one)."""
        if max_events <= 0:
            raise InvalidArgument(f"max_events must be positive, not {max_events}")
        loop = asyncio.get_running_loop()
        member = self._member(caller, member_id)
        wait = min(max(wait_ms, 0), MAX_FETCH_WAIT_MS, int(member.session_timeout * 500)) / 1000
        deadline = loop.time() + wait
        while True:
            member = self._member(caller, member_id)
            self.check_here(member.group)
            member.last_seen = loop.time()
            dispatcher = await self.dispatcher(member.group)
            room = min(
                max_events,
                MAX_FETCH_EVENTS,
                dispatcher.options.max_unacked - dispatcher.held_by(member_id),
            )
            if room > 0:
                await dispatcher.fill(room)
                if dispatcher.closed:
                    continue
                self._member(caller, member_id)  # not gone while reading
                self.check_lease(member.group)
                share = -(-dispatcher.ready_count() // (dispatcher.fetchers + 1))
                picked = dispatcher.take(member_id, min(room, max(1, share)), loop.time())
                if picked:
                    return await dispatcher.payload(picked)
            now = loop.time()
            if now >= deadline:
                return [], []
            changed = dispatcher.changed
            dispatcher.fetchers += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), deadline - now)
            finally:
                dispatcher.fetchers -= 1

    async def settle(
        self,
        caller: Caller,
        member_id: int,
        acks: list[list[int]],
        nacks: list[list[int]],
        delay_ms: int,
    ) -> list[list[int]]:
        """Acknowledge ``acks``, give back ``nacks`` (out again after ``delay_ms``); durable
        before it returns. Returns the ``[segment, offset]`` pairs the member does not hold
        (nothing happened to those). Raises UnknownMember, SubscriptionNotFound."""
        if delay_ms < 0:
            raise InvalidArgument(f"delay_ms must not be negative, not {delay_ms}")
        for pair in (*acks, *nacks):
            if len(pair) != 2:
                raise InvalidArgument(f"a delivery is [segment, offset], not {pair}")
        loop = asyncio.get_running_loop()
        member = self._member(caller, member_id)
        self.check_here(member.group)
        dispatcher = await self.dispatcher(member.group)
        member.last_seen = now = loop.time()
        was_full = dispatcher.held_by(member_id) >= dispatcher.options.max_unacked
        unknown: list[list[int]] = []
        settled = False
        for number, offset in acks:
            if dispatcher.ack(member_id, number, offset):
                settled = True
            else:
                unknown.append([number, offset])
        for number, offset in nacks:
            if dispatcher.nack(member_id, number, offset, delay_ms / 1000, now):
                settled = True
            else:
                unknown.append([number, offset])
        if settled:
            if was_full:
                dispatcher.wake()
            try:
                await dispatcher.durable()
            except StaleGeneration:  # reset meanwhile: those deliveries are void
                return [[n, o] for n, o in (*acks, *nacks)]
        return unknown

    def member_left(self, member: Member) -> None:
        dispatcher = self.dispatchers.get(member.group)
        if dispatcher is not None:
            dispatcher.member_left(member.id)

    def reset(self, group: Group) -> None:
        """The subscription was reset: the queue restarts from the new floors, and its
        members leave (they join again at once), so that no ack of a delivery made before
        the reset can settle an event delivered after it."""
        if group.record.mode not in QUEUE_MODES:
            return
        self.drop(group)
        for member in list(group.members.values()):
            self.subscriptions._remove(member)

    def drop(self, group: Group) -> None:
        """Reset or deleted: forget the live state (a reset restarts from the new floors)."""
        dispatcher = self.dispatchers.pop(group, None)
        if dispatcher is not None:
            dispatcher.close()

    def counts(self, group: Group, segment: int) -> dict[str, int]:
        """For describe: events in flight, waiting (for a redelivery or the dead-letter
        stream), and dead-lettered since the dispatcher started (since the broker started
        or the subscription was last reset: that count is not stored). In a cluster, for a
        segment another broker serves: its end (and the backlog to it) as that broker last
        answered, when newer than the catalog's."""
        dispatcher = self.dispatchers.get(group)
        queue = dispatcher.segments.get(segment) if dispatcher is not None else None
        if queue is None:
            return {}
        in_flight, waiting = queue.counts_for_describe()
        counts = {"in_flight": in_flight, "waiting": waiting, "dead_lettered": queue.dead_lettered}
        live = group.stream.segments.get(segment)
        if live is not None and not self.serves(live) and queue.end > live.next_offset:
            counts["end_offset"] = queue.end
            counts["backlog_events"] = max(0, queue.end - group.position(segment))
        return counts

    async def dead_letter_stream(self, name: str, segments: int) -> Stream:
        controller = self.controller
        if name not in controller.streams:
            with contextlib.suppress(StreamExists):
                await controller.create_stream(name, max(1, segments), None, None)
                log.info("created dead-letter stream %s", name)
        return controller.stream(name)

    async def run(self) -> None:
        """Ack timeouts, backoffs, dead letters and the periodic write of delivery counts,
        forever."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            for dispatcher in list(self.dispatchers.values()):
                if dispatcher.closed:
                    continue
                try:
                    self.check_here(dispatcher.group)
                except WrongBroker:  # its coordinator moved: that broker dispatches now
                    log.info(
                        "%s is coordinated by another broker now: its dispatcher stops here",
                        self.label(dispatcher.group),
                    )
                    self.drop(dispatcher.group)
                    continue
                dispatcher.tick(now)
                if dispatcher.exhausted() and now >= dispatcher.dead_letter_after:
                    try:
                        await dispatcher.dead_letter()
                    except (StaleGeneration, SlipstreamError) as exc:
                        dispatcher.dead_letter_after = now + DEAD_LETTER_RETRY_S
                        log.warning(
                            "dead-lettering events of %s failed (retried): %s",
                            self.label(dispatcher.group),
                            exc,
                        )
                if dispatcher.dirty and now - dispatcher.last_flush >= COUNTS_FLUSH_S:
                    try:
                        await dispatcher.durable()
                    except SlipstreamError as exc:
                        dispatcher.last_flush = now
                        log.warning(
                            "storing queue state of %s failed: %s",
                            self.label(dispatcher.group),
                            exc,
                        )

    def label(self, group: Group) -> str:
        return f"{group.stream.name}:{group.record.name}"
