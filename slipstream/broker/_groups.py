"""Subscriptions and consumer groups on the broker: durable cursors, members, assignments.

A subscription is a named, durable cursor on one stream (``SubscriptionRecord`` in the
MetaStore: a position per segment and a reset ``generation``). Its members form a group. In
``ordered`` mode the broker only coordinates: it assigns each segment to one member
(``streams.assign``: balanced and sticky), and members read their segments themselves with
follows from the committed positions, committing as they go.

Rebalancing is incremental and cooperative. A member learns its assignment by polling
(``poll``: a heartbeat that is answered at once when something changed for it, else after
``wait_ms``). When a segment must move, its current holder is told to revoke it; the holder
stops reading, commits, and releases it in its next poll; only then is it granted to its new
member, with the position committed by then. Segments that do not move never pause. A member
that leaves, loses its connection, or does not poll within its session timeout is removed and
its segments are granted at once (from their committed positions: what it had not committed is
delivered again, at-least-once).

Every commit (a member's, a transaction's positions, an operator's or a Spark query's) and
every grant runs under the group's lock, so a segment is never granted from a position older
than a commit in progress, and a commit by a member that no longer holds the segment (or from
before a reset) is refused with ``NotAssigned`` / ``StaleGeneration``: zombies cannot commit.

State and threads: everything here lives on the event loop. The durable part goes through the
controller's catalog thread (``Controller.in_catalog``); the in-memory records are updated only
after the MetaStore accepted a change, so they never run ahead of what a restart would find.
Members are not durable: after a broker restart, consumers join again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from .._errors import (
    GroupActive,
    InvalidArgument,
    ModeMismatch,
    NotAssigned,
    OffsetOutOfRange,
    StaleGeneration,
    SubscriptionNotFound,
    UnknownMember,
)
from ..format import decode_header
from ..protocol import (
    GroupAssignment,
    MemberInfo,
    SegmentInfo,
    SubscriptionInfo,
    SubscriptionSegment,
    TxnPositions,
)
from ..storage import Lease, PositionCommit, QueueOptions, SubscriptionRecord
from ..streams import SegmentProgress, assign, assignable, validate_subscription_name
from ._queues import Queues

if TYPE_CHECKING:
    from ._controller import Controller, Stream
    from ._service import Caller

log = logging.getLogger("slipstream.groups")

MODES = ("ordered", "queue", "key_ordered_queue")
MIN_SESSION_TIMEOUT_MS = 1_000
MAX_SESSION_TIMEOUT_MS = 300_000
MAX_POLL_WAIT_MS = 30_000
#: how often sessions are checked for expiry
EXPIRY_CHECK_S = 0.25
#: the longest a transaction coordinator on another broker may hold a group (HoldPositions)
MAX_HOLD_MS = 30_000
#: how long a hold waits for the group's lock (a commit or another hold in progress)
HOLD_WAIT_S = 2.0


@dataclass(eq=False)
class Member:
    id: int
    name: str
    caller: Caller
    group: Group
    session_timeout: float
    last_seen: float
    #: what the member was last told: (generation, assigned segments, revoked segments)
    seen: tuple[int, frozenset[int], frozenset[int]] | None = None


@dataclass(eq=False)
class Group:
    """The live side of one subscription: its record as stored, its members, and which
    member holds which segment."""

    record: SubscriptionRecord
    stream: Stream
    members: dict[int, Member] = field(default_factory=dict)
    holder: dict[int, int] = field(default_factory=dict)  # segment -> member id
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: str | None = None  # why it is gone (deleted, its stream deleted)
    epoch: int = 0  # the stream's epoch when the group last looked (a scale changes targets)

    def wake(self) -> None:
        """Answer every waiting poll: something changed for someone."""
        self.changed.set()
        self.changed = asyncio.Event()

    def position(self, segment: int) -> int:
        """Where a member granted ``segment`` starts: the committed position, never below
        the segment's first retained event."""
        start = self.stream.segments[segment].start_offset
        return max(self.record.positions.get(segment, start), start)

    def target(self) -> dict[int, int]:
        """Which member should hold each segment (balanced, sticky to the holders), among
        those the read order allows (``streams.assignable``): a successor only once every
        predecessor is committed to its end; a sealed segment committed to its end is no
        longer held by anyone."""
        members = {str(m): m for m in self.members}
        current = {s: str(m) for s, m in self.holder.items()}
        ready = assignable(
            {
                number: SegmentProgress(
                    tuple(s.predecessors), s.sealed, self.position(number), s.next_offset
                )
                for number, s in self.stream.segments.items()
            }
        )
        return {s: members[m] for s, m in assign(ready, members, current).items()}

    def view(self, member: Member) -> tuple[int, frozenset[int], frozenset[int]]:
        """What ``member`` should do now; grants it the free segments it is the target of."""
        target = self.target()
        for segment, owner in target.items():
            if owner == member.id and segment not in self.holder:
                self.holder[segment] = member.id
        held = {s for s, m in self.holder.items() if m == member.id}
        revoke = {s for s in held if target.get(s) != member.id}
        return self.record.generation, frozenset(held - revoke), frozenset(revoke)

    def remove(self, member: Member) -> None:
        if self.members.pop(member.id, None) is None:
            return
        for segment in [s for s, m in self.holder.items() if m == member.id]:
            del self.holder[segment]
        self.wake()


@dataclass(eq=False)
class Hold:
    """A group held for a transaction coordinated by another broker (``Subscriptions.hold``):
    its lock is taken until the hold is released or ``deadline`` (loop time) passes."""

    id: int
    txn_id: int
    group: Group
    positions: dict[int, int]
    deadline: float


class Subscriptions:
    """Subscriptions and their groups, for the service layer (on the event loop)."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.groups: dict[tuple[int, str], Group] = {}
        self.members: dict[int, Member] = {}
        # member ids start at random: another broker names a member by its id alone
        # (``hold``), and an id must not name a newer member after a restart or a move
        self._member_ids = itertools.count(secrets.randbelow(1 << 50) + 1)
        self.holds: dict[int, Hold] = {}  # hold id -> a group held for another broker
        self.queues = Queues(self)  # the dispatchers of queue-mode subscriptions

    def recover(self) -> int:
        """Load every subscription of a live stream (at start, before serving)."""
        by_id = {s.id: s for s in self.controller.streams.values()}
        for record in self.controller.meta.subscriptions():
            stream = by_id.get(record.stream_id)
            if stream is not None:
                self.groups[(stream.id, record.name)] = Group(record, stream)
        return len(self.groups)

    async def reload(self) -> int:
        """Take in what other brokers changed in the catalog (``Controller.refresh`` saw it
        change): subscriptions created there, those deleted there or with their stream (their
        members here get SubscriptionNotFound), resets (a new generation: members here start
        again from the new positions) and positions committed there. A group changed here
        while the catalog was read keeps its state (the catalog read is older); the next
        reload looks again. Returns how many groups changed."""
        before = {key: group.record for key, group in self.groups.items()}
        records = await self.controller.in_catalog(self.controller.meta.subscriptions)
        streams = {s.id: s for s in self.controller.streams.values()}
        listed: set[tuple[int, str]] = set()
        changed = 0
        for record in records:
            stream = streams.get(record.stream_id)
            if stream is None:
                continue
            key = (record.stream_id, record.name)
            listed.add(key)
            group = self.groups.get(key)
            if group is None:
                if key not in before:  # (else deleted here meanwhile)
                    self.groups[key] = Group(record, stream)
                    changed += 1
            elif self._absorb(group, before.get(key), record):
                changed += 1
        for key, group in list(self.groups.items()):
            gone = key not in listed or group.stream is not streams.get(key[0])
            if gone and key in before and group.record is before[key]:
                self._drop(group, f"subscription {key[1]!r} was deleted (on another broker)")
                changed += 1
        return changed

    async def adopt(self, coordinated: Callable[[str], bool]) -> int:
        """In a cluster, this broker now coordinates the groups ``coordinated`` accepts (by
        "stream/name"; Membership.take): their state is the catalog's as of now (positions
        committed through the broker that coordinated them before, which do not move the
        catalog's version), replacing what this broker kept from an earlier read. Returns
        how many groups it took."""
        records = await self.controller.in_catalog(self.controller.meta.subscriptions)
        streams = {s.id: s for s in self.controller.streams.values()}
        taken = 0
        for record in records:
            stream = streams.get(record.stream_id)
            if stream is None or not coordinated(f"{stream.name}/{record.name}"):
                continue
            group = self.groups.get((record.stream_id, record.name))
            if group is None or group.stream is not stream:
                self.groups[(record.stream_id, record.name)] = Group(record, stream)
            else:
                self._release_members(group, "its coordinator moved here")
                group.record = record
                self.queues.reset(group)
                group.wake()
            taken += 1
        return taken

    def release(self, coordinated: Callable[[str], bool]) -> None:
        """In a cluster, another broker coordinates these groups from now on (a hand-over):
        their members here are gone (their next poll answers UnknownMember; clients join
        again where the group is now) and their queues stop."""
        for group in list(self.groups.values()):
            if coordinated(f"{group.stream.name}/{group.record.name}"):
                self._release_members(group, "its coordinator moved to another broker")
                self.queues.reset(group)

    def _release_members(self, group: Group, why: str) -> None:
        for member in list(group.members.values()):
            log.info(
                "member %d (%s) of %s removed: %s", member.id, member.name, self._label(group), why
            )
            self._remove(member)
        group.wake()

    def _absorb(
        self, group: Group, seen: SubscriptionRecord | None, record: SubscriptionRecord
    ) -> bool:
        """Take the catalog's ``record`` of ``group`` where it is newer than memory: a reset
        made elsewhere (a higher generation: a queue restarts, members here start again from
        the new positions), or positions committed elsewhere to a group nobody uses here (no
        member, no queue dispatcher: an active group's state here is the newer). Never when
        something changed the group here since ``seen`` (read before the catalog was) or a
        change is under way (its lock)."""
        current = group.record
        if current is not seen or group.lock.locked() or record == current:
            return False
        if record.generation > current.generation:
            group.record = record
            self.queues.reset(group)
            group.wake()
            return True
        if record.generation < current.generation or group.members:
            return False
        if group in self.queues.dispatchers:
            return False
        group.record = record
        return True

    async def run(self) -> None:
        """Remove members whose session expired (they stopped polling), and wake the groups
        of a stream that scaled (a sealed segment may be complete already, successors may be
        assignable), forever."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            for hold in [h for h in self.holds.values() if loop.time() >= h.deadline]:
                await self._expire(hold)
            for group in self.groups.values():
                if group.epoch != group.stream.epoch:
                    group.epoch = group.stream.epoch
                    group.wake()
            now = loop.time()
            for member in [
                m for m in self.members.values() if now - m.last_seen > m.session_timeout
            ]:
                log.info(
                    "member %d (%s) of %s left: no poll for %.1f s (session timeout)",
                    member.id,
                    member.name,
                    self._label(member.group),
                    now - member.last_seen,
                )
                self._remove(member)

    # --- subscriptions -----------------------------------------------------------------------

    async def create(
        self,
        stream_name: str,
        name: str,
        mode: str,
        positions: Mapping[int, int],
        options: QueueOptions | None,
    ) -> SubscriptionInfo:
        """Raises StreamNotFound, SubscriptionExists, InvalidArgument (name, mode)."""
        stream = self.controller.stream(stream_name)
        validate_subscription_name(name)
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self._check_positions(stream, positions)
        record = SubscriptionRecord(
            stream.id,
            name,
            mode,
            int(time.time() * 1000),
            dict(positions),
            options=options if mode != "ordered" else None,
        )
        await self.controller.in_catalog(self.controller.meta.create_subscription, record)
        group = self.groups[(stream.id, name)] = Group(record, stream)
        log.info("created subscription %s (%s)", self._label(group), mode)
        return self.info(group, detail=False)

    def of_stream(self, stream_name: str) -> list[SubscriptionInfo]:
        stream = self.controller.stream(stream_name)
        return [
            self.info(g, detail=False)
            for (sid, _), g in sorted(self.groups.items())
            if sid == stream.id
        ]

    async def describe(
        self, stream_name: str, name: str, live: Mapping[int, SegmentInfo] | None = None
    ) -> SubscriptionInfo:
        """A group nobody uses here is described with its positions as the catalog has them:
        commits made through another broker are not announced (``catalog_version`` leaves
        positions out). ``live``: in a cluster, the segments as the brokers serving them know
        them now (``Service.stream_info``): the backlog counts from their end and size, not
        from this broker's copy of a segment it does not serve (an open one's end is 0 here),
        and the lag reads the oldest unconsumed batch from its broker (ReadSegment): 0 when
        that read fails (the broker does not answer, the segment is moving), never an error.
        The members and queue counts are this broker's: right only on the broker
        coordinating the group (``Service.describe_subscription`` asks it)."""
        group = self.group(stream_name, name)
        if not group.members and group not in self.queues.dispatchers:
            seen = group.record
            stored = await asyncio.get_running_loop().run_in_executor(
                self.controller.read_pool, self.controller.meta.subscriptions, seen.stream_id
            )
            for record in stored:
                if record.name == name:
                    self._absorb(group, seen, record)
        info = self.info(group, detail=True, live=live)
        now_ms = int(time.time() * 1000)
        lags = await asyncio.gather(*(self._lag(group, one, now_ms) for one in info.segments))
        segments = [
            msgspec.structs.replace(one, lag_ms=lag_ms, **self.queues.counts(group, one.segment))
            for one, lag_ms in zip(info.segments, lags, strict=True)
        ]
        return msgspec.structs.replace(info, segments=segments)

    async def _lag(self, group: Group, one: SubscriptionSegment, now_ms: int) -> int:
        """The age of the oldest unconsumed event of a segment: its first batch at the
        position, read here or from the broker serving it (``Queues.read``); 0 without a
        backlog or when the read fails (a damaged batch, an unreachable broker: no lag,
        not no answer)."""
        segment = group.stream.segments.get(one.segment)
        if not one.backlog_events or segment is None:
            return 0
        with contextlib.suppress(Exception):
            read = await self.queues.read(segment, one.position, 1)
            if read.batches:
                return max(0, now_ms - decode_header(read.batches[0]).min_timestamp)
        return 0

    async def delete(self, stream_name: str, name: str) -> None:
        group = self.group(stream_name, name)
        async with group.lock:
            await self.controller.in_catalog(
                self.controller.meta.delete_subscription, group.record.stream_id, name
            )
            self._drop(group, f"subscription {name!r} was deleted")
        log.info("deleted subscription %s", self._label(group))

    async def reset(
        self, stream_name: str, name: str, positions: Mapping[int, int]
    ) -> SubscriptionInfo:
        """Replace every position; live members restart from there (a new generation)."""
        group = self.group(stream_name, name)
        self._check_positions(group.stream, positions)
        async with group.lock:
            group.record = await self.queues.store(
                group,
                self.controller.meta.reset_subscription,
                group.record.stream_id,
                name,
                positions,
                here=False,
            )
            group.wake()
            self.queues.reset(group)
        log.info("reset subscription %s to %s", self._label(group), dict(positions))
        return self.info(group, detail=False)

    def forget_stream(self, stream: Stream) -> None:
        """The stream was deleted (its subscriptions with it, in the catalog)."""
        for key in [k for k in self.groups if k[0] == stream.id]:
            self._drop(self.groups[key], f"stream {stream.name!r} was deleted")

    def _drop(self, group: Group, why: str) -> None:
        group.deleted = why
        self.queues.drop(group)
        self.groups.pop((group.record.stream_id, group.record.name), None)
        for member in list(group.members.values()):
            self.members.pop(member.id, None)
        group.members.clear()
        group.holder.clear()
        group.wake()

    # --- members -----------------------------------------------------------------------------

    def join(
        self,
        caller: Caller,
        stream_name: str,
        name: str,
        mode: str,
        member_name: str,
        session_timeout_ms: int,
    ) -> tuple[int, int]:
        """A new member of the group -> (member id, generation)."""
        group = self.group(stream_name, name)
        if mode != group.record.mode:
            raise ModeMismatch(
                f"subscription {name!r} is a {group.record.mode!r} subscription; join it with "
                f"mode={group.record.mode!r}, or create another subscription for {mode!r}",
                mode=group.record.mode,
            )
        if not MIN_SESSION_TIMEOUT_MS <= session_timeout_ms <= MAX_SESSION_TIMEOUT_MS:
            raise InvalidArgument(
                f"session timeout must be between {MIN_SESSION_TIMEOUT_MS} and "
                f"{MAX_SESSION_TIMEOUT_MS} ms, not {session_timeout_ms}"
            )
        member = Member(
            next(self._member_ids),
            member_name[:200],
            caller,
            group,
            session_timeout_ms / 1000,
            asyncio.get_running_loop().time(),
        )
        group.members[member.id] = member
        self.members[member.id] = member
        group.wake()
        log.info("member %d (%s, %s) joined %s", member.id, member.name, caller, self._label(group))
        return member.id, group.record.generation

    async def poll(
        self, caller: Caller, member_id: int, released: Sequence[int], wait_ms: int
    ) -> GroupAssignment:
        """The member's assignment, answered at once if it changed since the member's last
        poll, else when it changes or after ``wait_ms``. Raises UnknownMember (then join
        again), SubscriptionNotFound / StreamNotFound when deleted."""
        member = self.member(caller, member_id)
        loop = asyncio.get_running_loop()
        member.last_seen = loop.time()
        group = member.group
        wait = min(max(wait_ms, 0), MAX_POLL_WAIT_MS, int(member.session_timeout * 500)) / 1000
        if released:
            for segment in released:
                if group.holder.get(segment) == member.id:
                    del group.holder[segment]
            group.wake()
        deadline = loop.time() + wait
        while True:
            changed = group.changed
            async with group.lock:
                self.member(caller, member_id)  # still there (not expired or deleted)?
                state = group.view(member)
                if state != member.seen or loop.time() >= deadline:
                    member.seen = state
                    generation, held, revoke = state
                    return GroupAssignment(
                        generation, {s: group.position(s) for s in sorted(held)}, sorted(revoke)
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), deadline - loop.time())

    def leave(self, caller: Caller, member_id: int) -> None:
        member = self.member(caller, member_id)
        log.info("member %d (%s) left %s", member.id, member.name, self._label(member.group))
        self._remove(member)

    def disconnect(self, caller: Caller) -> None:
        """The caller's connection is gone: so are its members (their segments move now)."""
        for member in [m for m in self.members.values() if m.caller is caller]:
            log.info(
                "member %d (%s) left %s: connection closed",
                member.id,
                member.name,
                self._label(member.group),
            )
            self._remove(member)

    def _remove(self, member: Member) -> None:
        self.members.pop(member.id, None)
        self.queues.member_left(member)
        member.group.remove(member)

    def member(self, caller: Caller, member_id: int) -> Member:
        member = self.members.get(member_id)
        if member is None or member.caller is not caller:
            group = member.group if member is not None else None
            if group is not None and group.deleted:
                raise SubscriptionNotFound(group.deleted)
            raise UnknownMember(
                f"member {member_id} is not in the group (it left, its session expired, or the "
                "broker restarted); join again",
                member_id=member_id,
            )
        if member.group.deleted:
            raise SubscriptionNotFound(member.group.deleted)
        return member

    # --- commits -----------------------------------------------------------------------------

    async def commit(
        self,
        caller: Caller,
        stream_name: str,
        name: str,
        member_id: int,
        generation: int,
        positions: Mapping[int, int],
    ) -> None:
        """Store positions, durable before it returns. A member commits only segments it
        holds (a sealed one it released may be named again unchanged at its end);
        ``member_id`` 0 commits from outside the group (only while nobody is joined)."""
        group = self.group(stream_name, name)
        async with group.lock:
            self._check_commit(caller, group, member_id, generation, positions)
            await self.queues.store(
                group,
                self.controller.meta.commit_positions,
                group.record.stream_id,
                name,
                generation,
                positions,
            )
            self._committed(group, positions)

    @contextlib.asynccontextmanager
    async def committing(
        self, caller: Caller, consumed: Sequence[TxnPositions]
    ) -> AsyncIterator[list[PositionCommit]]:
        """For a transaction's commit: check the positions it consumed and hold their groups
        still (no grant, commit or reset) while the body stores them with the transaction;
        record them once it did."""
        groups = [self.group(p.stream, p.subscription) for p in consumed]
        async with contextlib.AsyncExitStack() as stack:
            for group in sorted(set(groups), key=id):  # one order: no deadlock between two
                await stack.enter_async_context(group.lock)
            for group, p in zip(groups, consumed, strict=True):
                self._check_commit(caller, group, p.member_id, p.generation, p.positions)
            yield [
                PositionCommit(g.record.stream_id, g.record.name, p.generation, dict(p.positions))
                for g, p in zip(groups, consumed, strict=True)
            ]
            for group, p in zip(groups, consumed, strict=True):
                self._committed(group, p.positions)

    # --- holds: a transaction's commit coordinated by another broker ------------------------

    async def hold(
        self,
        hold_id: int,
        txn_id: int,
        subject: str,
        ttl_ms: int,
        consumed: TxnPositions,
        lease: Lease | None = None,
    ) -> Group:
        """For transaction ``txn_id`` coordinated by another broker (docs/cluster.md,
        "Consume-transform-produce"): check ``consumed`` as ``committing`` does, the member
        named by its id alone (ids are never reused, see ``__init__``) and owned by a
        connection authenticated as ``subject`` ("" without authentication), and hold the
        group (its lock: no grant, commit or reset) until ``release_hold`` or ``ttl_ms``
        (capped at MAX_HOLD_MS). Raises NotAssigned / StaleGeneration / UnknownMember /
        SubscriptionNotFound / OffsetOutOfRange like a commit, TimeoutError if the group
        stays busy for HOLD_WAIT_S, InvalidArgument for a hold id in use. With ``lease`` (the
        container coordinating the group) the hold is recorded in the catalog under it
        (``MetaStore.add_hold``; LeaseLost, nothing held, if it is no longer current): the
        commit record is stored only by consuming that row, and the group removes it before
        it lets go (release, expiry, or a broker adopting the group)."""
        group = self.group(consumed.stream, consumed.subscription)
        if hold_id in self.holds:
            raise InvalidArgument(f"hold {hold_id} is in place already")
        async with asyncio.timeout(HOLD_WAIT_S):
            await group.lock.acquire()
        try:
            self._check_commit(
                None, group, consumed.member_id, consumed.generation, consumed.positions, subject
            )
            if lease is not None:
                await self.controller.in_catalog(
                    functools.partial(
                        self.controller.meta.add_hold,
                        hold_id,
                        group.record.stream_id,
                        group.record.name,
                        lease=lease,
                    )
                )
        except BaseException:
            group.lock.release()
            raise
        deadline = asyncio.get_running_loop().time() + min(max(ttl_ms, 0), MAX_HOLD_MS) / 1000
        self.holds[hold_id] = Hold(hold_id, txn_id, group, dict(consumed.positions), deadline)
        return group

    async def release_hold(self, hold_id: int, stored: int) -> Group | None:
        """End a hold: ``stored`` 1, the transaction's commit record with the positions is
        in the catalog (it consumed the hold's row: the group takes them); 0 or -1 (not
        stored, or unknown): the hold's row is removed from the catalog first, so a record not
        stored by then never is (``MetaStore.commit_txn(holds=)``), and if the row was gone
        the record consumed it: the group reads its positions from the catalog. None if no
        such hold (it expired, or never was)."""
        hold = self.holds.pop(hold_id, None)
        if hold is None:
            return None
        try:
            if stored > 0:
                self._committed(hold.group, hold.positions)
            elif not await self.controller.in_catalog(self.controller.meta.remove_holds, [hold_id]):
                await self._reread(hold.group)
        except BaseException:
            self.holds[hold_id] = hold  # the catalog did not answer: expiry reads it again
            raise
        hold.group.lock.release()
        return hold.group

    async def _expire(self, hold: Hold) -> None:
        """A hold whose transaction coordinator did not release it in time (it died, is
        paused, or cannot reach this broker): its row is removed from the catalog, so its
        commit record, if not stored by then, never is (however late it tries); then the group
        takes its positions from the catalog (with the record's, if it was stored) before it
        grants again. While the catalog does not answer, the hold stays and is tried again."""
        log.warning(
            "hold %d of %s for transaction %d expired: reading its positions from the catalog",
            hold.id,
            self._label(hold.group),
            hold.txn_id,
        )
        try:
            await self.controller.in_catalog(self.controller.meta.remove_holds, [hold.id])
            await self._reread(hold.group)
        except Exception as exc:
            log.error("hold %d: the catalog did not answer (%s); trying again", hold.id, exc)
            hold.deadline = asyncio.get_running_loop().time() + 1
            return
        if self.holds.pop(hold.id, None) is hold:
            hold.group.lock.release()

    async def _reread(self, group: Group) -> None:
        """The group's record as the catalog has it now (its lock held)."""
        records = await self.controller.in_catalog(
            self.controller.meta.subscriptions, group.record.stream_id
        )
        record = next((r for r in records if r.name == group.record.name), None)
        if record is not None and record != group.record:
            group.record = record
            self.queues.drop(group)
            group.wake()

    def _check_commit(
        self,
        caller: Caller | None,
        group: Group,
        member_id: int,
        generation: int,
        positions: Mapping[int, int],
        subject: str = "",
    ) -> None:
        """``caller`` None: the member is named for another broker (``hold``), owned by a
        connection authenticated as ``subject``."""
        name = group.record.name
        if generation != group.record.generation:
            raise StaleGeneration(
                f"subscription {name!r} was reset (generation {group.record.generation}) after "
                f"these positions were read (generation {generation}); they are dropped",
                generation=group.record.generation,
            )
        self._check_positions(group.stream, positions)
        if member_id == 0:
            if group.members:
                raise GroupActive(
                    f"subscription {name!r} has {len(group.members)} members joined; positions "
                    "are committed by them, not from outside the group",
                    members=len(group.members),
                )
            return
        member = (
            self.member(caller, member_id)
            if caller is not None
            else self._member_of(subject, member_id)
        )
        if member.group is not group:
            raise NotAssigned(f"member {member_id} is not a member of {name!r}")
        foreign = sorted(
            s
            for s, position in positions.items()
            if group.holder.get(s) != member_id and not _finished(group, s, position)
        )
        if foreign:
            raise NotAssigned(
                f"member {member_id} does not hold segment(s) {foreign} of {name!r} (moved to "
                "another member, or its session expired); nothing was committed",
                segments=foreign,
            )

    def _committed(self, group: Group, positions: Mapping[int, int]) -> None:
        group.record = msgspec.structs.replace(
            group.record, positions={**group.record.positions, **positions}
        )
        segments = group.stream.segments
        if any(segments[s].sealed and p >= segments[s].next_offset for s, p in positions.items()):
            group.wake()  # a sealed segment read to its end: its successors may be assigned
        self.queues.drop(group)  # a queue's dispatcher starts again from the new floors

    def _check_positions(self, stream: Stream, positions: Mapping[int, int]) -> None:
        for segment, offset in positions.items():
            record = stream.segment(segment)
            end = record.next_offset
            served = self.controller.containers[record.container].serving
            if offset < 0 or (served and offset > end):
                raise OffsetOutOfRange(
                    f"position {offset} of segment {segment} is outside 0..{end} (the end of "
                    "what the segment holds)",
                    segment=segment,
                    offset=offset,
                    end=end,
                )

    def _member_of(self, subject: str, member_id: int) -> Member:
        """``member`` for a caller on another broker, known by its subject only."""
        member = self.members.get(member_id)
        if member is not None:
            principal = member.caller.principal
            if (principal.subject if principal is not None else "") != subject:
                member = None
        if member is None:
            raise UnknownMember(
                f"member {member_id} is not in the group (it left, its session expired, or its "
                "coordinator restarted or moved); join again",
                member_id=member_id,
            )
        if member.group.deleted:
            raise SubscriptionNotFound(member.group.deleted)
        return member

    # --- lookups -----------------------------------------------------------------------------

    def group(self, stream_name: str, name: str) -> Group:
        stream = self.controller.stream(stream_name)
        group = self.groups.get((stream.id, name))
        if group is None:
            raise SubscriptionNotFound(
                f"stream {stream_name!r} has no subscription {name!r}; create it with "
                f"'slipstream subscription create {stream_name} {name}'",
                stream=stream_name,
                subscription=name,
            )
        return group

    def info(
        self, group: Group, *, detail: bool, live: Mapping[int, SegmentInfo] | None = None
    ) -> SubscriptionInfo:
        """The subscription; with ``detail``, each segment's position and backlog (from
        ``live``'s end and size for the segments it names, else this broker's segment
        objects) and the members here. ``lag_ms`` is left 0 (``describe`` reads it)."""
        record = group.record
        options = msgspec.structs.asdict(record.options) if record.options else {}
        summary = SubscriptionInfo(
            group.stream.name,
            record.name,
            record.mode,
            record.generation,
            record.created_ms,
            options=options,
        )
        if not detail:
            return summary
        segments = []
        for number, segment in sorted(group.stream.segments.items()):
            position = group.position(number)
            seen = (live or {}).get(number)
            start, end, size = (
                (segment.start_offset, segment.next_offset, segment.bytes)
                if seen is None
                else (seen.start_offset, seen.end_offset, seen.bytes)
            )
            backlog = max(0, end - position)
            held = end - start
            segments.append(
                SubscriptionSegment(
                    number,
                    position,
                    end,
                    backlog,
                    size * backlog // held if held > 0 else 0,
                    0,
                    group.holder.get(number, 0),
                )
            )
        now = asyncio.get_running_loop().time()
        members = [
            MemberInfo(
                m.id,
                m.name,
                m.caller.peer,
                sorted(s for s, h in group.holder.items() if h == m.id),
                int((now - m.last_seen) * 1000),
            )
            for m in group.members.values()
        ]
        return msgspec.structs.replace(summary, segments=segments, members=members)

    def _label(self, group: Group) -> str:
        return f"{group.stream.name}:{group.record.name}"


def _finished(group: Group, segment: int, position: int) -> bool:
    """``position`` commits ``segment`` again where it is already committed, at the end of a
    sealed segment: a no-op, accepted from a member that no longer holds it, since an
    application's commit can race the release of a segment it just committed to its end
    (the member releases it in its next poll)."""
    one = group.stream.segments.get(segment)
    return (
        one is not None
        and one.sealed
        and position >= one.next_offset
        and group.record.positions.get(segment) == position
    )
