"""Consumers: members of a subscription's group (``mode="ordered"``).

A consumer joins the group, and the broker assigns it some of the stream's segments (balanced
and sticky). It follows each assigned segment from the subscription's committed position, as a
reader does, and commits how far it got. When the group changes, the broker revokes segments
that must move: the consumer stops following them, commits them (``auto``), and releases them;
segments that stay keep flowing. The consumer polls the broker for its assignment (a heartbeat
answered at once on a change); a consumer that stops polling for ``session_timeout`` seconds,
or whose connection closes, loses its segments to the others.

Commit modes (``commit=``):

* ``auto`` (default): every batch the application has finished with (it asked for the next
  one) is committed in the background about once a second, when a segment is revoked, and on
  ``close()``. At-least-once: a crash delivers again what was not committed.
* ``manual``: ``consumer.commit()`` commits everything handed out so far; ``commit(positions)``
  commits given positions; or commit inside a transaction (``txn.commit_position(consumer)``)
  for exactly-once consume-transform-produce.
* ``at_most_once``: a batch's end is committed (durably) before its events are handed out; a
  crash may lose them, never deliver them twice.

Threads: the ``ConsumerCore`` lives on the client's event loop and owns the membership, the
follows and the positions; the consuming side (``Consumer`` in the application's thread,
``AsyncConsumer`` in its task) takes ``_Item``s from a queue and reports back through calls on
the loop (``loop.call_soon_threadsafe``). Each grant of a segment is a ``_Lease`` object; the
consuming side skips items of a lease that is no longer current (``core.leases`` is written on
the loop only; reading one entry of it is a single dict lookup). An item taken at the instant
its segment is revoked is still handed out: at-least-once allows it, and the new holder starts
from the last commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    NotAssigned,
    SlipstreamError,
    StaleGeneration,
    UnknownMember,
    WrongBroker,
    error_from_wire,
)
from ..format import Event, events_of
from ..protocol import (
    CommitPositions,
    Credit,
    Data,
    Follow,
    FollowEnded,
    FollowFailed,
    GroupAssignment,
    GroupJoined,
    JoinGroup,
    LeaveGroup,
    Message,
    Payload,
    PollGroup,
    TxnPositions,
    Unfollow,
)
from ..streams import StreamCut
from ._reader import Delivery, decode_delivery, with_position

if TYPE_CHECKING:
    from ._client import AsyncClient, _LoopThread
    from ._connection import Connection

log = logging.getLogger("slipstream.consumer")

COMMIT_MODES = ("auto", "manual", "at_most_once")
#: a background commit that fails with one of these is retried with the next (or never, when
#: the segment moved: the new holder starts from the last commit)
_RETRIED = (NotAssigned, StaleGeneration, UnknownMember, BrokerUnavailable)
CoreFactory = Callable[[Callable[["_Item"], None]], "ConsumerCore"]
#: per segment, the grant events were handed out under and the offset after them
Handed = dict[int, tuple["_Lease | None", int]]
AUTO_COMMIT_S = 1.0
CREDIT_BYTES = 32 * 1024 * 1024
MIN_SEGMENT_CREDIT = 1024 * 1024
MAX_POLL_WAIT_MS = 3_000


@dataclass(eq=False)
class _Lease:
    """One grant of a segment to this consumer: where reading started, and the offset its
    next batch must hold (a ``ReadState`` for ``decode_delivery``)."""

    stream: str
    segment: int
    start: int
    sub_id: int
    starts: dict[int, int] = field(default_factory=dict)
    ends: dict[int, int | None] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    #: the connection its follow is on (several brokers: the one serving the segment)
    connection: Connection | None = None

    def __post_init__(self) -> None:
        self.starts[self.segment] = self.start
        self.ends[self.segment] = None


@dataclass(frozen=True, slots=True)
class _Item:
    lease: _Lease | None
    payload: Payload | None = None
    error: SlipstreamError | None = None


class ConsumerCore:
    """On the loop: membership, assignment, follows and commits of one consumer."""

    def __init__(
        self,
        client: AsyncClient,
        stream: str,
        subscription: str,
        commit: str,
        name: str | None,
        session_timeout: float,
        deliver: Callable[[_Item], None],
    ) -> None:
        if commit not in COMMIT_MODES:
            raise InvalidArgument(
                f"commit must be one of {', '.join(COMMIT_MODES)}, not {commit!r}"
            )
        self.client = client
        self.stream = stream
        self.subscription = subscription
        self.commit_mode = commit
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.session_timeout_ms = int(session_timeout * 1000)
        self.deliver = deliver
        self.connection: Connection | None = None
        self.member_id = 0
        self.generation = -1
        self.leases: dict[int, _Lease] = {}  # segment -> its current grant
        self.processed: dict[int, int] = {}  # auto: finished with, to commit
        self.committed: dict[int, int] = {}  # as far as the broker has it
        self._released: list[int] = []
        self._poll: asyncio.Task[None] | None = None
        self._autocommit: asyncio.Task[None] | None = None
        # a follow lost its broker (moved or gone): the poll loop rejoins
        self._follow_lost = False
        self.closed = False

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the group (errors such as SubscriptionNotFound or ModeMismatch raise here),
        then keep the assignment current in the background."""
        await self._join()
        self._poll = asyncio.get_running_loop().create_task(self._run(), name="consumer poll")
        if self.commit_mode == "auto":
            self._autocommit = asyncio.get_running_loop().create_task(self._auto())

    async def close(self) -> None:
        """Commit (``auto``), leave the group and stop; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for task in (self._poll, self._autocommit):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, SlipstreamError):
                    await task
        if self.commit_mode == "auto":
            with contextlib.suppress(SlipstreamError):
                await self._commit_processed()
        for segment in list(self.leases):
            await self._stop(segment)
        await self._leave()
        self.member_id = 0
        self.deliver(_Item(None))  # wakes a consuming side waiting for items

    async def _leave(self) -> None:
        """Leave the group if its broker is still there (so the next join is not held back
        by this member's session); a best effort."""
        if self.member_id and self.connection is not None and self.connection.closed is None:
            with contextlib.suppress(SlipstreamError):
                await self.connection.request(LeaveGroup(self.member_id))

    async def _join(self) -> None:
        """Join at the broker coordinating the group (WrongBroker: where it moved)."""
        reply, self.connection = await self.client._exchange(
            JoinGroup(
                self.stream, self.subscription, "ordered", self.name, self.session_timeout_ms
            ),
            self.client._group_target(self.stream, self.subscription),
        )
        assert isinstance(reply, GroupJoined)
        self.member_id = reply.member_id
        self._released = []
        log.debug("joined %s:%s as member %d", self.stream, self.subscription, self.member_id)

    async def _run(self) -> None:
        """Poll for the assignment until closed; rejoin after the broker forgot this member
        (a restart, an expired session), when the group's coordinator moved (WrongBroker) or
        a follow lost its broker; fail the consumer on anything else."""
        wait_ms = min(MAX_POLL_WAIT_MS, self.session_timeout_ms // 3)
        while not self.closed:
            try:
                if self._follow_lost:
                    self._follow_lost = False
                    raise BrokerUnavailable("a followed segment moved to another broker")
                if not self.member_id:
                    await self._join()
                assert self.connection is not None
                released, self._released = self._released, []
                reply, _ = await self.connection.request(
                    PollGroup(self.member_id, released, wait_ms)
                )
                assert isinstance(reply, GroupAssignment)
                await self._apply(reply)
            except (UnknownMember, BrokerUnavailable, WrongBroker) as exc:
                log.info("consumer of %s:%s rejoins: %s", self.stream, self.subscription, exc)
                if isinstance(exc, WrongBroker):
                    self.client.cluster.learn(exc.details)
                for segment in list(self.leases):
                    await self._stop(segment)
                await self._leave()
                self.member_id = 0
                self.generation = -1
                if isinstance(exc, UnknownMember):
                    continue
                await asyncio.sleep(0.05)  # live_connection waits for the broker to return
            except SlipstreamError as exc:  # deleted, or a bug: the application must know
                self.deliver(_Item(None, error=exc))
                return

    async def _apply(self, reply: GroupAssignment) -> None:
        if reply.generation != self.generation:  # a reset: restart every segment
            for segment in list(self.leases):
                await self._stop(segment)
            self.processed.clear()
            self.generation = reply.generation
        for segment in [s for s in self.leases if s not in reply.assigned]:
            if segment in reply.revoke and self.commit_mode == "auto":
                with contextlib.suppress(SlipstreamError):  # then it is delivered again
                    await self._commit_processed([segment])
            await self._stop(segment)
        self._released.extend(reply.revoke)
        fresh = [s for s in reply.assigned if s not in self.leases]
        credit = max(MIN_SEGMENT_CREDIT, CREDIT_BYTES // max(1, len(reply.assigned)))
        for segment in fresh:  # (revoked ones are released by the next poll, sent at once)
            await self._follow(segment, reply.assigned[segment], credit)

    async def _follow(self, segment: int, start: int, credit: int) -> None:
        """Follow a granted segment at the broker serving it (several brokers: not
        necessarily the group's)."""
        target = await self.client._segment_target(self.stream, segment)
        connection = await self.client.live_connection(target)
        sub_id = next(connection.follow_ids)
        lease = _Lease(self.stream, segment, start, sub_id, connection=connection)
        self.leases[segment] = lease
        self.committed[segment] = start
        self.processed.pop(segment, None)

        def handle(message: Message | SlipstreamError, payload: Payload) -> None:
            if isinstance(message, Data):
                self.deliver(_Item(lease, payload))
            elif isinstance(message, FollowFailed | FollowEnded | SlipstreamError):
                connection.follows.pop(sub_id, None)
                if isinstance(message, FollowFailed):
                    error = error_from_wire(message.code, message.message, message.details)
                    if isinstance(error, WrongBroker):
                        self.client.cluster.learn(error.details)
                        self._follow_lost = True  # rejoin: followed again at the new owner
                    elif self.leases.get(segment) is lease:
                        self.deliver(_Item(lease, error=error))
                elif isinstance(message, SlipstreamError) and connection is not self.connection:
                    self._follow_lost = True  # that broker is gone; the group's is not
                # the group's connection lost: the poll loop rejoins and follows again

        connection.follows[sub_id] = handle
        await connection.request(Follow(sub_id, self.stream, segment, start, None, credit))

    async def _stop(self, segment: int) -> None:
        lease = self.leases.pop(segment, None)
        if lease is None or lease.connection is None:
            return
        if lease.connection.follows.pop(lease.sub_id, None) is not None:
            with contextlib.suppress(SlipstreamError):
                await lease.connection.request(Unfollow(lease.sub_id))

    # --- positions -------------------------------------------------------------------------

    def grant(self, lease: _Lease, nbytes: int) -> None:
        """The consuming side is done with ``nbytes`` of ``lease``: more may come."""
        connection = lease.connection
        current = self.leases.get(lease.segment) is lease
        if current and connection is not None and lease.sub_id in connection.follows:
            connection.send_oneway(Credit(lease.sub_id, nbytes))

    def finished(self, lease: _Lease, offset: int) -> None:
        """The application finished with everything before ``offset`` of ``lease``."""
        if self.leases.get(lease.segment) is lease:
            self.processed[lease.segment] = offset

    async def _auto(self) -> None:
        while True:
            await asyncio.sleep(AUTO_COMMIT_S)
            with contextlib.suppress(
                NotAssigned, StaleGeneration, UnknownMember, BrokerUnavailable, WrongBroker
            ):
                await self._commit_processed()

    async def _commit_processed(self, segments: list[int] | None = None) -> None:
        chosen = segments if segments is not None else list(self.processed)
        positions = {
            s: self.processed[s]
            for s in chosen
            if s in self.processed and self.processed[s] != self.committed.get(s)
        }
        if positions:
            await self.commit(positions)

    async def commit(self, positions: Mapping[int, int]) -> None:
        """Commit positions of segments this consumer holds (others raise NotAssigned)."""
        if not self.member_id or self.connection is None:
            raise UnknownMember("this consumer is not in its group right now (it is rejoining)")
        await self.connection.request(
            CommitPositions(
                self.stream, self.subscription, self.member_id, self.generation, dict(positions)
            )
        )
        self.committed.update(positions)

    def txn_positions(self, handed: Handed) -> TxnPositions:
        """The positions for a transaction's commit (``EndTxn.positions``). Raises
        NotAssigned if a segment's grant changed since its events were handed out (a
        rebalance, a rejoin after a reconnect, a reset): those events are delivered again,
        so the transaction that processed them must abort, not commit its output without
        their position."""
        stale = sorted(s for s, (lease, _) in handed.items() if self.leases.get(s) is not lease)
        if stale or not self.member_id:
            raise NotAssigned(
                f"segment(s) {stale} of {self.stream!r} moved or were granted again since "
                "their events were handed out (a rebalance, a reconnect, a reset); the "
                "transaction aborts and those events are delivered again",
                segments=stale,
            )
        positions = {s: end for s, (_, end) in handed.items()}
        return TxnPositions(
            self.stream, self.subscription, self.member_id, self.generation, positions
        )

    def assignment(self) -> set[int]:
        return set(self.leases)


class _Side:
    """The consuming side's bookkeeping (the application's thread or task only): decoding,
    which positions were handed out, and what to report to the core."""

    def __init__(self, core: ConsumerCore) -> None:
        self.core = core
        self.handed: dict[int, tuple[_Lease, int]] = {}  # segment -> (lease, next offset)
        self.current: list[tuple[_Lease, int]] = []  # batches of the last item handed out

    def decode(self, item: _Item) -> list[tuple[_Lease, int, pa.RecordBatch]]:
        """The records of an item, or [] if its grant was revoked meanwhile."""
        if item.error is not None:
            raise item.error
        lease = item.lease
        if lease is None or self.core.leases.get(lease.segment) is not lease:
            return []
        assert item.payload is not None
        delivery = Delivery(lease.segment, item.payload)
        return [(lease, base, record) for _, base, record in decode_delivery(delivery, lease)]

    def finished_current(self) -> list[tuple[_Lease, int]]:
        """The application asked for more: the batches handed out before are finished."""
        done, self.current = self.current, []
        return done

    def hand_out(self, lease: _Lease, base: int, record: pa.RecordBatch) -> None:
        end = base + record.num_rows
        self.handed[lease.segment] = (lease, end)
        self.current.append((lease, end))

    def positions(self) -> dict[int, int]:
        """Everything handed out so far, for the segments still held."""
        return {
            s: end for s, (lease, end) in self.handed.items() if self.core.leases.get(s) is lease
        }

    def snapshot(self, positions: StreamCut | Mapping[int, int] | None) -> Handed:
        """For ``txn.commit_position``: what was handed out (or ``positions``), each with the
        grant it was handed out under, to check at the commit."""
        if positions is None:
            return dict(self.handed)
        chosen = cut_positions(self.core.stream, positions)
        return {s: (self.core.leases.get(s), offset) for s, offset in chosen.items()}


def cut_positions(stream: str, positions: StreamCut | Mapping[int, int]) -> dict[int, int]:
    """``{segment: offset}`` from a StreamCut of ``stream`` or a mapping."""
    if isinstance(positions, StreamCut):
        if positions.stream != stream:
            raise InvalidArgument(f"StreamCut is for {positions.stream!r}, not {stream!r}")
        return dict(positions.positions)
    return dict(positions)


class AsyncConsumer:
    """A member of a subscription's group for asyncio code: ``async for event in consumer``,
    or ``async for batch in consumer.batches()``; see :meth:`Client.consumer`."""

    def __init__(self, make_core: CoreFactory) -> None:
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.core = make_core(self._queue.put_nowait)
        self._side = _Side(self.core)

    async def _records(self) -> AsyncIterator[tuple[_Lease, int, pa.RecordBatch]]:
        core, side = self.core, self._side
        while True:
            for lease, end in side.finished_current():
                core.finished(lease, end)
            item = await self._queue.get()
            if item.lease is None and item.error is None:
                if core.closed:
                    return
                continue
            records = side.decode(item)
            if records and core.commit_mode == "at_most_once":
                lease, base, record = records[-1]
                try:
                    await core.commit({lease.segment: base + record.num_rows})
                except _RETRIED:  # the segment moved on meanwhile: they are not ours
                    records = []
            for lease, base, record in records:
                side.hand_out(lease, base, record)
                yield lease, base, record
            if item.lease is not None and item.payload is not None:
                core.grant(item.lease, len(item.payload))

    async def batches(self) -> AsyncIterator[pa.RecordBatch]:
        """Arrow record batches (key, value, timestamp, headers, segment, offset)."""
        async for lease, base, record in self._records():
            yield with_position(lease.segment, base, record)

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for lease, base, record in self._records():
            for event in events_of(record, lease.segment, base):
                yield event

    @property
    def assignment(self) -> set[int]:
        """The segments this consumer reads now."""
        return self.core.assignment()

    async def commit(self, positions: StreamCut | Mapping[int, int] | None = None) -> None:
        """Commit everything handed out so far (or ``positions``), durably."""
        chosen = self._side.positions() if positions is None else positions
        await self.core.commit(cut_positions(self.core.stream, chosen))

    def positions(self) -> dict[int, int]:
        """Per held segment, the offset after the last event handed out."""
        return self._side.positions()

    async def close(self) -> None:
        await self.core.close()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Consumer:
    """The blocking consumer; see :meth:`Client.consumer`. Iterate for events (it waits for
    new ones for ever; ``close()`` from another thread ends the iteration), ``batches()``
    for Arrow record batches, or ``poll(timeout)`` for the next batch's events."""

    def __init__(self, loop: _LoopThread, make_core: CoreFactory) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.core = make_core(self._queue.put)
        self._side = _Side(self.core)
        self._pending: Iterator[tuple[_Lease, int, pa.RecordBatch]] = iter(())

    def _next_records(
        self, timeout: float | None
    ) -> list[tuple[_Lease, int, pa.RecordBatch]] | None:
        """The records of the next item ([] on timeout, None once closed); raises the
        consumer's error."""
        core, side = self.core, self._side
        for lease, end in side.finished_current():
            self._loop.call(core.finished, lease, end)
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if item.lease is None and item.error is None:
            return None if core.closed else []
        records = side.decode(item)
        if item.lease is not None and item.payload is not None:
            self._loop.call(core.grant, item.lease, len(item.payload))
        if records and core.commit_mode == "at_most_once":
            lease, base, record = records[-1]  # an item holds batches of one segment
            try:
                self._loop.run(core.commit({lease.segment: base + record.num_rows}))
            except _RETRIED:  # the segment moved on meanwhile: they are not ours
                records = []
        for lease, base, record in records:
            side.hand_out(lease, base, record)
        return records

    def _records(self) -> Iterator[tuple[_Lease, int, pa.RecordBatch]]:
        while (records := self._next_records(None)) is not None:
            yield from records

    def batches(self) -> Iterator[pa.RecordBatch]:
        """Arrow record batches (key, value, timestamp, headers, segment, offset)."""
        for lease, base, record in self._records():
            yield with_position(lease.segment, base, record)

    def __iter__(self) -> Iterator[Event]:
        for lease, base, record in self._records():
            yield from events_of(record, lease.segment, base)

    def poll(self, timeout: float = 1.0) -> list[Event]:
        """The events of the next batch(es) that arrive within ``timeout`` seconds ([] if
        none); an empty list also after ``close()``."""
        records = self._next_records(timeout) or []
        return [e for lease, base, r in records for e in events_of(r, lease.segment, base)]

    @property
    def assignment(self) -> set[int]:
        """The segments this consumer reads now."""
        return self.core.assignment()

    @property
    def granted(self) -> dict[int, int]:
        """Per segment held, the position reading it started at under its current grant
        (the subscription's committed position when it was granted)."""
        return {segment: lease.start for segment, lease in list(self.core.leases.items())}

    @property
    def committed(self) -> dict[int, int]:
        """Per segment, the last position this consumer committed or was granted at."""
        return dict(self.core.committed)

    def commit(self, positions: StreamCut | Mapping[int, int] | None = None) -> None:
        """Commit everything handed out so far (or ``positions``: a StreamCut or ``{segment:
        offset of the next event to consume}``), durably. Raises NotAssigned for segments
        this consumer no longer holds, StaleGeneration after a reset."""
        chosen = self._side.positions() if positions is None else positions
        self._loop.run(self.core.commit(cut_positions(self.core.stream, chosen)))

    def positions(self) -> dict[int, int]:
        """Per held segment, the offset after the last event handed out."""
        return self._side.positions()

    def close(self) -> None:
        """Commit (``auto``), leave the group; safe to call twice and from another thread."""
        if self._loop.thread.is_alive():
            self._loop.run(self.core.close())

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
