"""Queue consumers: members of a work queue (``mode="queue"`` or ``"key_ordered_queue"``).

The broker hands each event to one member at a time (``FetchEvents``); the member settles it
with ``event.ack()`` or ``event.nack(delay=...)``. An event not acknowledged within the
queue's ack timeout (or whose member leaves, loses its connection or stops fetching for its
session timeout) is delivered again, to any member, after a backoff; after ``max_deliveries``
it goes to the dead-letter stream. In ``key_ordered_queue`` at most one event per routing key
is out at a time, in order.

Acks are batched: ``ack()`` returns at once, and the acks (and nacks) made within a few
milliseconds go to the broker in one ``SettleEvents``, durable on the broker before it
answers. ``flush_acks()`` sends what is pending, waits for every answer so far, and raises
``UnknownDelivery`` naming the deliveries the broker did not hold (settled already, or
redelivered elsewhere after their ack timeout: the work was done twice), or the connection's
error for settles whose outcome is unknown (the broker died while answering: it may have
stored them). ``close()`` flushes too, but only logs such errors.

At most ``max_in_flight`` events are unsettled on the client at a time (and the queue's
``max_unacked`` on the broker); the consumer fetches more as the application settles.

Threads: the ``QueueCore`` lives on the client's loop and owns the membership, the fetches
and the settles. The consuming side (``QueueConsumer`` in the application's thread,
``AsyncQueueConsumer`` in its task) takes lists of events from a queue; ``ack``/``nack`` from
any thread append to a deque that the loop drains (one wake-up of the loop per batch, not per
ack). After a broker restart (or an expired session) the consumer joins again; events it
received before are void (the broker delivers them again), and their acks raise
``UnknownDelivery``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    ProtocolError,
    SlipstreamError,
    UnknownDelivery,
    UnknownMember,
    WrongBroker,
)
from ..format import Event, events_of, iter_batches, read_body
from ..protocol import (
    EventsDelivered,
    FetchEvents,
    GroupJoined,
    JoinGroup,
    LeaveGroup,
    ListSubscriptions,
    Payload,
    Settled,
    SettleEvents,
    SubscriptionList,
)

if TYPE_CHECKING:
    from ._client import AsyncClient, _LoopThread
    from ._connection import Connection

log = logging.getLogger("slipstream.queue")

QUEUE_MODES = ("queue", "key_ordered_queue")
#: acks wait this long for company before they are sent
ACK_FLUSH_S = 0.002
#: ... or until this many are pending
ACK_BATCH = 1024
MAX_FETCH = 1000
MAX_FETCH_WAIT_MS = 1_000
#: settles on the way at once; more wait
MAX_SETTLES = 16
_ACK, _NACK = 0, 1


class QueueEvent:
    """One event of a work queue, as a queue consumer hands it out: the fields of
    ``slipstream.Event`` plus ``deliveries`` (1 the first time; more when it was delivered
    before and not acknowledged in time, nacked, or its member went away).

    ``ack()`` settles it for good; ``nack(delay=seconds)`` gives it back, to be delivered
    again (to any member) after ``delay``. Both return at once; see ``flush_acks()``.
    """

    __slots__ = (
        "_owner",
        "_session",
        "_settled",
        "deliveries",
        "headers",
        "key",
        "offset",
        "segment",
        "timestamp",
        "value",
    )

    def __init__(self, event: Event, deliveries: int, owner: QueueCore, session: int) -> None:
        self.key = event.key
        self.value = event.value
        self.headers = event.headers
        self.timestamp = event.timestamp
        self.segment = event.segment
        self.offset = event.offset
        self.deliveries = deliveries
        self._owner = owner
        self._session = session
        self._settled = False

    def ack(self) -> None:
        """Acknowledge: done for good (durable on the broker within milliseconds)."""
        session = self._session if not self._settled else -self._session  # once only
        self._settled = True
        self._owner.settle(_ACK, session, self.segment, self.offset, 0)

    def nack(self, delay: float = 0.0) -> None:
        """Give it back: delivered again after ``delay`` seconds (this delivery counts
        towards ``max_deliveries``)."""
        if delay < 0:
            raise InvalidArgument(f"delay must not be negative, not {delay}")
        session = self._session if not self._settled else -self._session
        self._settled = True
        self._owner.settle(_NACK, session, self.segment, self.offset, int(delay * 1000))

    def event(self) -> Event:
        """The plain ``slipstream.Event``."""
        return Event(self.key, self.value, self.headers, self.timestamp, self.segment, self.offset)

    def __repr__(self) -> str:
        return (
            f"QueueEvent(segment={self.segment}, offset={self.offset}, key={self.key!r}, "
            f"deliveries={self.deliveries}, value={self.value[:40]!r})"
        )


#: what the loop hands the consuming side: events, an error, or None (closed / wake up)
_Item = list[QueueEvent] | SlipstreamError | None


async def subscription_mode(client: AsyncClient, stream: str, name: str) -> str | None:
    """The mode of ``stream``'s subscription ``name`` (None if there is none)."""
    reply = await client._request(ListSubscriptions(stream))
    assert isinstance(reply, SubscriptionList)
    return next((s.mode for s in reply.subscriptions if s.name == name), None)


class QueueCore:
    """On the loop: membership, fetches and settles of one queue consumer."""

    def __init__(
        self,
        client: AsyncClient,
        stream: str,
        subscription: str,
        mode: str,
        name: str | None,
        session_timeout: float,
        max_in_flight: int,
        deliver: Callable[[_Item], None],
    ) -> None:
        if max_in_flight <= 0:
            raise InvalidArgument(f"max_in_flight must be positive, not {max_in_flight}")
        self.client = client
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start(), on the loop
        self.stream = stream
        self.subscription = subscription
        self.mode = mode
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.session_timeout_ms = int(session_timeout * 1000)
        self.max_in_flight = max_in_flight
        self.deliver = deliver
        self.connection: Connection | None = None
        self.member_id = 0
        self.session = 0  # counts joins: events of an earlier one are void
        self.held = 0  # events handed out in this session and not settled
        self.room = asyncio.Event()
        # (kind, session, segment, offset, delay ms), appended from any thread; the session
        # is negative for the second settle of an event (sent, but it frees no room)
        self.inbox: deque[tuple[int, int, int, int, int]] = deque()
        self._kick = asyncio.Event()
        self._kicked = False
        self._kick_lock = threading.Lock()
        self._settling: set[asyncio.Task[None]] = set()
        self._settle_slots = asyncio.Semaphore(MAX_SETTLES)
        self._sending = asyncio.Lock()  # flush() waits for a send the flusher began
        self.unknown: list[list[int]] = []
        self.failed: list[tuple[SlipstreamError, list[list[int]]]] = []
        self._fetch: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.closed = False

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Join (SubscriptionNotFound, ModeMismatch raise here), then fetch in the
        background."""
        self.loop = loop = asyncio.get_running_loop()
        await self._join()
        self._fetch = loop.create_task(self._run(), name="queue fetch")
        self._flusher = loop.create_task(self._flush_loop(), name="queue acks")

    async def close(self) -> None:
        """Send pending settles (errors are logged), leave the group; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self._fetch is not None:
            self._fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError, SlipstreamError):
                await self._fetch
        try:
            await self.flush()
        except SlipstreamError as exc:
            log.warning("acks of %s:%s on close: %s", self.stream, self.subscription, exc)
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self.member_id and self.connection is not None and self.connection.closed is None:
            with contextlib.suppress(SlipstreamError):
                await self.connection.request(LeaveGroup(self.member_id))
        self.member_id = 0
        self.deliver(None)  # wakes a consuming side waiting for events

    async def _join(self) -> None:
        """Join at the broker coordinating the queue (WrongBroker: where it moved)."""
        reply, self.connection = await self.client._exchange(
            JoinGroup(
                self.stream, self.subscription, self.mode, self.name, self.session_timeout_ms
            ),
            self.client._group_target(self.stream, self.subscription),
        )
        assert isinstance(reply, GroupJoined)
        self.member_id = reply.member_id
        self.session += 1
        self.held = 0
        log.debug("joined queue %s:%s as member %d", self.stream, self.subscription, self.member_id)

    async def _run(self) -> None:
        """Fetch while there is room, until closed; join again after the broker forgot this
        member (a restart, an expired session); fail the consumer on anything else."""
        wait_ms = max(1, min(MAX_FETCH_WAIT_MS, self.session_timeout_ms // 3))
        while not self.closed:
            try:
                if not self.member_id:
                    await self._join()
                assert self.connection is not None
                room = self.max_in_flight - self.held
                if room <= 0:  # full: keep the session alive while the application works
                    self.room.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.room.wait(), wait_ms / 1000)
                    if self.max_in_flight - self.held <= 0:
                        await self.connection.request(SettleEvents(self.member_id))
                    continue
                reply, payload = await self.connection.request(
                    FetchEvents(self.member_id, min(room, MAX_FETCH), wait_ms)
                )
                assert isinstance(reply, EventsDelivered)
                if reply.deliveries:
                    events = self._events(reply.deliveries, payload)
                    self.held += len(events)
                    self.deliver(events)
            except (UnknownMember, BrokerUnavailable, WrongBroker) as exc:
                log.info("queue consumer of %s:%s rejoins: %s", self.stream, self.subscription, exc)
                if isinstance(exc, WrongBroker):  # the queue's coordinator moved
                    self.client.cluster.learn(exc.details)
                self.member_id = 0
                self.session += 1  # what arrived before is void from now on, not from the join
                self.held = 0
                if isinstance(exc, BrokerUnavailable):
                    await asyncio.sleep(0.05)  # live_connection waits for the broker to return
            except SlipstreamError as exc:  # deleted, or a bug: the application must know
                self.deliver(exc)
                return
            except Exception as exc:  # a bug: fail the consumer, never hang it
                log.exception("queue consumer of %s:%s failed", self.stream, self.subscription)
                self.deliver(SlipstreamError(f"internal error in the queue consumer: {exc}"))
                return

    def _events(self, deliveries: list[list[int]], payload: Payload) -> list[QueueEvent]:
        """The delivered events, from the whole batches that hold them (each batch once, in
        the order of the deliveries that first need it; CRC32C checked). Only the span of a
        batch that holds this member's events becomes Event objects: members that share a
        large batch each build their own part of it, not all of it."""
        batches = iter(iter_batches(payload))
        held: dict[int, list[list[Any]]] = {}  # segment -> [base, next, batch, low, high]
        placed = []
        for segment, offset, count in deliveries:
            entry = next((e for e in held.get(segment, ()) if e[0] <= offset < e[1]), None)
            if entry is None:
                try:
                    header, view = next(batches)
                except StopIteration:
                    raise ProtocolError(
                        f"EventsDelivered names {len(deliveries)} events, its payload holds "
                        "fewer batches than they need"
                    ) from None
                entry = [header.base_offset, header.next_offset, view, offset, offset]
                held.setdefault(segment, []).append(entry)
            entry[3], entry[4] = min(entry[3], offset), max(entry[4], offset)
            placed.append((entry, segment, offset, count))
        rows: dict[int, list[Event]] = {}
        out = []
        for entry, segment, offset, count in placed:
            base, _, view, low, high = entry
            events = rows.get(id(entry))
            if events is None:
                record = read_body(view).slice(low - base, high - low + 1)
                events = rows[id(entry)] = list(events_of(record, segment, low))
            out.append(QueueEvent(events[offset - low], count, self, self.session))
        return out

    # --- settling --------------------------------------------------------------------------

    def settle(self, kind: int, session: int, segment: int, offset: int, delay_ms: int) -> None:
        """From any thread: queue an ack or nack; the loop sends it within ACK_FLUSH_S."""
        self.inbox.append((kind, session, segment, offset, delay_ms))
        with self._kick_lock:
            if self._kicked:
                return
            self._kicked = True
        if self._on_loop():
            self._kick.set()
        elif self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: close() is done
                self.loop.call_soon_threadsafe(self._kick.set)

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    async def _flush_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            if len(self.inbox) < ACK_BATCH:
                await asyncio.sleep(ACK_FLUSH_S)
            with self._kick_lock:
                self._kicked = False
            await self._send()

    async def _send(self) -> None:
        """Send what the inbox holds: one SettleEvents per nack delay (acks with the first)."""
        async with self._sending:
            await self._send_inbox()

    async def _send_inbox(self) -> None:
        acks: list[list[int]] = []
        nacks: dict[int, list[list[int]]] = {}
        while self.inbox:
            kind, session, segment, offset, delay_ms = self.inbox.popleft()
            if abs(session) != self.session or not self.member_id:
                self.unknown.append([segment, offset])  # from before a rejoin: void
                continue
            if session > 0:
                self.held -= 1
            if kind == _ACK:
                acks.append([segment, offset])
            else:
                nacks.setdefault(delay_ms, []).append([segment, offset])
        freed = bool(acks or nacks)
        requests = [(acks, nacks.pop(0, []), 0)] if acks or 0 in nacks else []
        requests += [([], n, delay) for delay, n in nacks.items()]
        for acked, nacked, delay in requests:
            await self._settle_slots.acquire()
            task = asyncio.get_running_loop().create_task(
                self._settle(self.member_id, acked, nacked, delay)
            )
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        if freed:  # after the settles: they reach the broker before the next fetch
            self.room.set()

    async def _settle(
        self, member_id: int, acks: list[list[int]], nacks: list[list[int]], delay_ms: int
    ) -> None:
        try:
            assert self.connection is not None
            reply, _ = await self.connection.request(SettleEvents(member_id, acks, nacks, delay_ms))
            assert isinstance(reply, Settled)
            self.unknown.extend(reply.unknown)
        except UnknownMember:  # the broker forgot this member: those deliveries are void
            self.unknown.extend(acks + nacks)
        except SlipstreamError as exc:
            self.failed.append((exc, acks + nacks))
        finally:
            self._settle_slots.release()

    async def flush(self) -> None:
        """Send every pending ack and nack and wait for the answers; raise for those that
        did not take effect (see the module docstring)."""
        await self._send()
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        if self.failed:
            failed, self.failed = self.failed, []
            deliveries = [d for _, some in failed for d in some]
            first = failed[0][0]
            raise type(first)(
                f"{first.message}; {len(deliveries)} acks/nacks may or may not have taken "
                "effect (the broker may have stored them before it went away)",
                deliveries=deliveries,
            )
        if self.unknown:
            unknown, self.unknown = self.unknown, []
            raise UnknownDelivery(
                f"{len(unknown)} acks/nacks were for events this consumer does not hold "
                "(settled already, redelivered after the ack timeout, or received before the "
                "consumer joined again): nothing happened to them",
                deliveries=unknown,
            )


class AsyncQueueConsumer:
    """A member of a work queue for asyncio code: ``async for event in consumer`` and
    ``event.ack()``; see :meth:`Client.consumer`."""

    def __init__(self, make_core: Callable[[Callable[[_Item], None]], QueueCore]) -> None:
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.core = make_core(self._queue.put_nowait)

    async def __aiter__(self) -> AsyncIterator[QueueEvent]:
        while True:
            events = await self._next(None)
            if events is None:
                return
            for event in events:
                yield event

    async def _next(self, timeout: float | None) -> list[QueueEvent] | None:
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return []
        return _live(self.core, item)

    async def poll(self, timeout: float = 1.0) -> list[QueueEvent]:
        """The events that arrive within ``timeout`` seconds ([] if none, or closed)."""
        return await self._next(timeout) or []

    async def flush_acks(self) -> None:
        """Send pending acks and nacks and wait for their answers; raises UnknownDelivery
        (``details["deliveries"]``) for deliveries this consumer did not hold."""
        await self.core.flush()

    async def close(self) -> None:
        await self.core.close()

    async def __aenter__(self) -> AsyncQueueConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class QueueConsumer:
    """The blocking queue consumer; see :meth:`Client.consumer`. Iterate for events (it
    waits for ever; ``close()`` from another thread ends it) or ``poll(timeout)``; settle each
    with ``event.ack()`` / ``event.nack(delay=...)``."""

    def __init__(
        self, loop: _LoopThread, make_core: Callable[[Callable[[_Item], None]], QueueCore]
    ) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.core = make_core(self._queue.put)

    def _next(self, timeout: float | None) -> list[QueueEvent] | None:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        return _live(self.core, item)

    def __iter__(self) -> Iterator[QueueEvent]:
        while (events := self._next(None)) is not None:
            yield from events

    def poll(self, timeout: float = 1.0) -> list[QueueEvent]:
        """The events that arrive within ``timeout`` seconds ([] if none, or closed)."""
        return self._next(timeout) or []

    def flush_acks(self) -> None:
        """Send pending acks and nacks and wait for their answers; raises UnknownDelivery
        (``details["deliveries"]``: ``[segment, offset]`` pairs) for deliveries this consumer
        did not hold, or the connection's error for settles whose outcome is unknown."""
        self._loop.run(self.core.flush())

    def close(self) -> None:
        """Send pending settles, leave the group; safe to call twice and from another
        thread."""
        if self._loop.thread.is_alive():
            self._loop.run(self.core.close())

    def __enter__(self) -> QueueConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _live(core: QueueCore, item: _Item) -> list[QueueEvent] | None:
    """The events of an item that are still valid ([] if none), None once closed; raises
    the consumer's error."""
    if isinstance(item, SlipstreamError):
        raise item
    if item is None:
        return None if core.closed else []
    session = core.session
    live = [e for e in item if e._session == session]  # earlier ones: delivered again
    return live


def queue_core_factory(
    client: AsyncClient,
    stream: str,
    subscription: str,
    mode: str,
    name: str | None,
    session_timeout: float,
    max_in_flight: int,
) -> Callable[[Callable[[_Item], None]], QueueCore]:
    def make(deliver: Callable[[_Item], None]) -> QueueCore:
        return QueueCore(
            client, stream, subscription, mode, name, session_timeout, max_in_flight, deliver
        )

    return make
