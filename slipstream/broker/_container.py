"""A segment container: one journal with group commit, the tail cache, and the mover that
turns sealed journal files into per-segment chunks in long-term storage.

Appends from all of the container's segments queue up; the commit loop takes everything queued,
assigns offsets, writes it with one ``writev`` and makes it durable with one ``fdatasync`` (in
``fsync="always"`` mode), then acknowledges the whole group and wakes the segments' followers.
If the write or sync fails, every append of the group fails (none is acknowledged), the journal
is cut back to its last durable byte and the offsets handed out are taken back, so the next
group starts from a clean, gap-free state. The appends already queued behind the group by the
same idempotent producers to the same segments fail with it: an append that failed is never
followed by a later batch of its producer that was queued before the failure was known.

With a grouping window (``journal_group_ms``, 50 ms for an object journal, where one sync is
one uploaded object and one catalog commit; 0 for files), the loop first lets the queue fill
until the window after its oldest append has passed or ``journal_group_bytes`` are queued.

Journal entry payload: ``u64 segment global id`` (little-endian) followed by the batch verbatim.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import struct
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

import numpy as np

from .._errors import (
    CorruptBatch,
    CorruptData,
    LeaseLost,
    OffsetOutOfRange,
    SegmentSealed,
    SlipstreamError,
    StorageError,
    StreamNotFound,
)
from ..format import HEADER_LENGTH, MAGIC, BatchHeader, decode_header, set_base_offset, verify
from ..protocol import Payload
from ..storage import (
    BLOCK,
    ChunkRecord,
    Journal,
    JournalAddress,
    Lease,
    LongTermStore,
    MetaStore,
    batch_key_hashes,
    batches_key_hashes,
    build_find_index,
    chunk_name,
    payload_alignment,
)
from ..storage._chunks import MOVE_COMMIT_WINDOW_S, writer_tag
from ..streams import ProducerState, ProducerTable
from ._faults import scaled_count, scaling_now_ms
from ._metrics import DETACHED, Metrics
from ._segment import Chunk, ChunkCache, JournalBatch, Segment

log = logging.getLogger("slipstream.container")

_SEGMENT_ID = struct.Struct("<Q")
FSYNC_MODES = ("always", "interval", "never")
#: where in its 4 KiB block a received batch must start for the journal to write it in place
BATCH_ALIGNMENT = (BLOCK, payload_alignment(_SEGMENT_ID.size))
#: what every journal payload carries where: lets recovery find entries after damage
JOURNAL_RESYNC = (MAGIC, _SEGMENT_ID.size)
#: how often a journal records how much of its active file is synced, so that recovery can
#: tell damage there (skipped) from a torn write (cut): one extra fdatasync a second at most
JOURNAL_CHECKPOINT_SECONDS = 1.0


def batch_checks_out(payload: memoryview) -> bool:
    """The journal's check of a self-checked entry (segment id, then a batch): the batch's own
    header and CRC32C, and its length against the entry's."""
    try:
        header = verify(payload, _SEGMENT_ID.size)
    except CorruptBatch:
        return False
    return header.batch_length == len(payload) - _SEGMENT_ID.size


@dataclass(frozen=True, slots=True)
class ContainerConfig:
    fsync: str = "always"
    fsync_interval_ms: int = 50
    roll_bytes: int = 64 * 1024 * 1024
    roll_ms: int = 300_000
    #: group commit's window: a group waits up to this long after its first append, or until
    #: ``journal_group_bytes`` are queued, before it is written and synced, so that one sync
    #: (one object of an object journal) carries many appends. 0: a group is whatever queued
    #: while the previous one was written (file journals: an fsync is cheap to repeat). None:
    #: the journal's default (the broker sets it: 50 for object journals, 0 for files)
    journal_group_ms: int | None = None
    journal_group_bytes: int = 4 * 1024 * 1024
    tail_cache_bytes: int = 64 * 1024 * 1024
    #: memory for the batch indexes of chunks that reads looked up (ChunkCache): 16 MiB holds
    #: the indexes of about 8,000 chunks of 64 batches
    chunk_cache_bytes: int = 16 * 1024 * 1024
    #: whether appends and recovery hash the journal's keys and the mover writes each chunk's
    #: find index (storage/_index.py); off only to measure what it costs (bench/find.py):
    #: SLIPSTREAM_FIND_INDEX=off. Finds then scan.
    find_index: bool = field(
        default_factory=lambda: os.environ.get("SLIPSTREAM_FIND_INDEX", "on") != "off"
    )


@dataclass(frozen=True, slots=True)
class _MoveTarget:
    """What the mover needs of a live segment, taken on the loop when a move starts: the
    mover's thread reads only this, never the segment the loop keeps changing."""

    stream_id: int
    number: int
    #: the segment's idempotence snapshot as of its newest chunk (None: none yet)
    producers: bytes | None
    last_timestamp: int | None
    #: offsets ``[lo, hi)`` the segment lost in the file being moved (a hole), if any
    hole: tuple[int, int] | None


@dataclass(slots=True)
class _Append:
    segment: Segment
    batch: Payload
    header: BatchHeader
    future: asyncio.Future[int]
    applying: bool = False  # a committed transaction's batch: taken also while sealing


class Container:
    """Threads: the event loop owns the segments, the queue, the tail cache and every asyncio
    object here. The journal thread (``_io``) runs journal calls and hands back only their
    results (a roll's sealed file id included: the loop then wakes the mover); the mover
    thread (``_mover``) works from ``_MoveTarget`` snapshots; reader threads get a segment's
    immutable fields and a ``Chunk`` (whose index arrays are never changed), or look the chunk
    up themselves in ``chunk_cache`` (its own lock) and the catalog (its read connection)."""

    metrics: Metrics = DETACHED  #: the broker's (``Metrics.attach``)

    def __init__(
        self,
        container_id: int,
        journal: Journal,
        long_term: LongTermStore,
        meta: MetaStore,
        read_pool: ThreadPoolExecutor,
        config: ContainerConfig,
    ) -> None:
        self.id = container_id
        self.journal = journal
        self.long_term = long_term
        self.meta = meta
        self.config = config
        self._read_pool = read_pool
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"journal-{container_id}")
        self._mover = ThreadPoolExecutor(1, thread_name_prefix=f"mover-{container_id}")
        self._queue: list[_Append] = []
        self._queued_bytes = 0
        self._first_queued = 0.0  # when the oldest append in the queue arrived (monotonic)
        self._wakeup = asyncio.Event()
        self._cached: deque[JournalBatch] = deque()
        self._cached_bytes = 0
        self._roll_started = time.monotonic()
        self._sealed = asyncio.Event()
        #: chunks other than segments' newest, looked up from the catalog as reads need them
        self.chunk_cache = ChunkCache(meta.chunk_at, config.chunk_cache_bytes)
        self.appended_batches = 0
        #: live segments of this container by global id; the controller keeps it current
        self.segments: dict[int, Segment] = {}
        #: the container's lease (``hold``; None: not leased, e.g. a container made by a test)
        #: and when it ends on this host's monotonic clock; why it was lost, once it was
        self.lease: Lease | None = None
        self.lease_deadline = math.inf
        self.lease_lost: str | None = None
        #: whether this broker serves it (in a cluster, only the containers it holds; a
        #: container handed over stays False and its replacement object serves when taken)
        self.serving = True

    # --- recovery --------------------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """Rebuild segment indexes from the journal (before serving), after the controller
        registered the live segments with their chunks. Entries of unknown (deleted) segments
        are skipped, as are entries already moved to chunks.

        Batches in damaged ranges of sealed journal files (``Journal.recover``) are lost. Each
        lost range becomes a *hole* in its segment: reads there raise CorruptData naming the
        range, later batches stay readable, and its offsets are never handed out again. A hole
        is found as a gap before the segment's next batch, or, where no batch of the segment
        follows, from the damaged entry's own header if that is plausible (a live segment of
        this container, continuing exactly where the segment ends). A damaged entry whose
        header is unreadable and that ends its segment cannot be told from nothing; it is
        logged, and that segment's next appends take its offsets.
        """
        segments = self.segments
        moved = self.meta.moved_file(self.id)
        kept = skipped = 0
        # the surviving batches' key hashes for finds, hashed a group at a time
        unhashed: list[tuple[JournalBatch, memoryview]] = []
        for address, payload in self.journal.recover(moved):
            (global_id,) = _SEGMENT_ID.unpack_from(payload)
            segment = segments.get(global_id)
            if segment is None:
                skipped += 1
                continue
            try:
                header = decode_header(payload, _SEGMENT_ID.size)
            except CorruptBatch as exc:  # the entry CRC passed, so this is a bug, not a torn write
                log.error("container %d: undecodable batch at %s: %s", self.id, address, exc)
                skipped += 1
                continue
            if header.base_offset < segment.next_offset:
                continue
            if header.base_offset > segment.next_offset:
                self._lose(segment, header.base_offset, address.file_id, header.min_timestamp)
            recovered = JournalBatch(
                header.base_offset,
                header.next_offset,
                address,
                header.min_timestamp,
                header.max_timestamp,
                None,
            )
            segment.journal.append(recovered)
            if self.config.find_index:
                unhashed.append((recovered, payload[_SEGMENT_ID.size :]))
                if len(unhashed) >= _RECOVERY_HASH_GROUP:
                    _set_keys(unhashed)
            _remember(segment.producers, header)
            segment.next_offset = segment.pending_offset = header.next_offset
            segment.note_batch(header.batch_length, header.min_timestamp, header.max_timestamp)
            kept += 1
        _set_keys(unhashed)
        unnamed = 0
        for damage in self.journal.report.damaged:
            for head in damage.heads:
                if not self._lose_damaged(head, damage.file_id):
                    unnamed += 1
                    break  # the outline after an unreadable head is not worth trusting
        if unnamed:
            log.error(
                "container %d: %d damaged journal entries could not be attributed to a "
                "segment; a segment whose last batches they held continues at its last "
                "readable offset",
                self.id,
                unnamed,
            )
        return {"batches": kept, "skipped": skipped}

    def _lose_damaged(self, head: bytes, file_id: int) -> bool:
        """Make a hole for a damaged entry that ends its segment, if its head is plausible;
        whether it could be attributed (also: to a range that is a hole already)."""
        if len(head) < _SEGMENT_ID.size + HEADER_LENGTH:
            return False
        segment = self.segments.get(_SEGMENT_ID.unpack_from(head)[0])
        try:
            header = decode_header(head, _SEGMENT_ID.size)
        except CorruptBatch:
            return False
        if segment is None or header.base_offset > segment.next_offset:
            return False
        if header.base_offset == segment.next_offset:
            self._lose(segment, header.next_offset, file_id, segment.last_timestamp or 0)
        return True

    def _lose(self, segment: Segment, until: int, file_id: int, timestamp: int) -> None:
        """Record offsets ``[segment.next_offset, until)`` as lost (a hole) and move past. The
        hole sits in the segment's index with journal file ``file_id``, and moves to chunks
        with that file's batches."""
        lost = segment.next_offset
        log.error(
            "container %d: segment %s/%d lost offsets %d to %d to damaged journal data (see "
            "above); readers get CorruptData there and can read on from offset %d",
            self.id,
            segment.stream_name,
            segment.number,
            lost,
            until - 1,
            until,
        )
        segment.journal.append(
            JournalBatch(lost, until, JournalAddress(file_id, -1, 0), timestamp, timestamp, None)
        )
        segment.next_offset = segment.pending_offset = until

    # --- the lease (docs/operations.md, "Leases and fencing") ------------------------------

    def hold(self, lease: Lease, deadline: float) -> None:
        """The container is ``lease``'s until ``deadline`` (``time.monotonic()``), which the
        broker sets no later than the catalog's expiry: the time it asked for the lease plus
        the ttl (the catalog's clock starts the ttl after that)."""
        from ..storage._journal_objects import ObjectJournal

        if self.lease_lost is None:
            self.lease, self.lease_deadline = lease, deadline
            if isinstance(self.journal, ObjectJournal):  # its records are catalog writes
                self.journal.lease = lease

    def lose(self, reason: str) -> None:
        """The lease is gone for good (LeaseLost): every queued and later append fails with
        LeaseLost, and the mover's catalog writes are refused by the catalog's fence."""
        if self.lease_lost is None:
            log.error(
                "container %d: lease lost, appends to it are refused from now on "
                "(in a cluster it is handed over and may be taken again; a standalone broker "
                "takes it again at a restart): %s",
                self.id,
                reason,
            )
            self.lease_lost = reason
            self.lease_deadline = -math.inf
            self._wakeup.set()  # the commit loop fails what is queued

    def lease_error(self) -> LeaseLost | None:
        """LeaseLost if an append may not be acknowledged now: the lease was lost, or it was not
        renewed in time and may have passed to another broker; else None."""
        if self.lease is None:
            return None
        if self.lease_lost is not None:
            return LeaseLost(
                f"this broker lost the lease of container {self.id}: {self.lease_lost}",
                container=self.id,
            )
        if time.monotonic() >= self.lease_deadline:
            self.lose(
                f"its lease (epoch {self.lease.epoch}) could not be renewed before it expired; "
                "another broker may hold it now"
            )
            return self.lease_error()
        return None

    # --- appends ---------------------------------------------------------------------------

    def append(
        self, segment: Segment, batch: Payload, header: BatchHeader, *, applying: bool = False
    ) -> asyncio.Future[int]:
        """Queue a verified batch; the future gives its base offset once durable, or fails with
        StorageFull / StorageError / StreamNotFound (then nothing of it is acknowledged).

        If a batch of an idempotent producer fails to be stored, every batch of that producer
        to that segment still queued behind it fails too (same error), so a producer that
        queues batches without waiting finds them stored as a gap-free prefix: everything up to
        its first failure, nothing after it."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        refused = self.lease_error()
        if refused is not None:
            future.set_exception(refused)
            return future
        if not self._queue:
            self._first_queued = time.monotonic()
        self._queue.append(_Append(segment, batch, header, future, applying))
        self._queued_bytes += len(batch)
        self._wakeup.set()
        return future

    async def drain(self) -> None:
        """Return once every append queued so far has its answer (durable, or failed):
        what a hand-over waits for after the container stops taking appends."""
        while self._queue or any(s.pending_offset != s.next_offset for s in self.segments.values()):
            await asyncio.sleep(0.005)

    async def run(self) -> None:
        """The container's background work: group commit, periodic sync, the mover."""
        if self.journal.sealed_files():
            self._sealed.set()  # files sealed before a restart still need moving
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._commit_loop())
            tasks.create_task(self._move_loop())
            if self.config.fsync == "interval":
                tasks.create_task(self._sync_loop())

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sync = self.config.fsync == "always"
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.config.journal_group_ms:
                await self._gather_group()
            group, self._queue = self._queue, []
            self._queued_bytes = 0
            refused = self.lease_error()
            if refused is not None:
                for item in group:
                    _fail(item.future, refused)
                continue
            live = []
            # idempotence state before this group, to roll back to if it fails to be stored
            saved: dict[tuple[Segment, int], ProducerState | None] = {}
            in_group: dict[tuple[Segment, int, int], asyncio.Future[int]] = {}
            for item in group:
                segment, header = item.segment, item.header
                if segment.deleted:
                    _fail(
                        item.future, StreamNotFound(f"stream {segment.stream_name!r} was deleted")
                    )
                    continue
                # a sealed (or sealing) segment takes only a committed transaction's batches;
                # a retry of a batch it stored still gets its offset
                closed = (segment.sealed or segment.sealing) and not item.applying
                if header.producer_id >= 0:
                    pid, seq = header.producer_id, header.sequence
                    try:
                        original = segment.producers.check(
                            pid, header.producer_epoch, seq, header.event_count
                        )
                    except SlipstreamError as exc:
                        _fail(item.future, sealed_error(segment) if closed else exc)
                        continue
                    if original is not None:  # a retry: answer with the first append's offset
                        first = in_group.get((segment, pid, seq))
                        if first is None:
                            item.future.set_result(original.base_offset)
                        else:
                            _chain(first, item.future)
                        continue
                if closed:
                    _fail(item.future, sealed_error(segment))
                    continue
                if header.producer_id >= 0:
                    if (segment, pid) not in saved:
                        state = segment.producers.get(pid)
                        saved[segment, pid] = None if state is None else state.copy()
                    segment.producers.record(
                        pid, header.producer_epoch, seq, header.event_count, segment.pending_offset
                    )
                    in_group[segment, pid, seq] = item.future
                set_base_offset(item.batch, segment.pending_offset)
                segment.pending_offset += header.event_count
                live.append(item)
            if not live:
                continue
            entries = [(_SEGMENT_ID.pack(i.segment.global_id), i.batch) for i in live]
            writing = loop.run_in_executor(self._io, self._write_group, entries, sync)
            # The finds' key hashes of the group, made here while the journal thread writes
            # and syncs it (IO, without the GIL), so an acknowledged batch is already indexed.
            # On the loop, not in a thread of their own: the same CPU either way (bench/find.py),
            # but that thread spent most of its time waiting for the loop's GIL (py-spy), and
            # each acknowledgement waited for it.
            keys = (
                _group_keys([i.batch for i in live])
                if self.config.find_index
                else [None] * len(live)
            )
            try:
                addresses, sealed = await writing
            except Exception as exc:  # the loop must outlive any failure, typed or not
                if not isinstance(exc, SlipstreamError):
                    log.exception("container %d: unexpected journal failure", self.id)
                    exc = StorageError(f"journal write failed: {exc}")
                if isinstance(exc, LeaseLost):  # the object journal's fenced record
                    self.lose(str(exc))
                log.error(
                    "container %d: %d appends failed, none acknowledged: %s",
                    self.id,
                    len(live),
                    exc,
                )
                for item in live:
                    item.segment.pending_offset = item.segment.next_offset
                    _fail(item.future, exc)
                for (segment, pid), state in saved.items():
                    segment.producers.restore(pid, state)
                # Later batches of those producers in those segments, queued meanwhile, fail
                # too: stored, they would sit past the lost ones (a transaction's apply would
                # find its batches with one missing in the middle, and skip it as stored).
                queued, self._queue = self._queue, []
                for item in queued:
                    if (item.segment, item.header.producer_id) in saved:
                        _fail(item.future, exc)
                    else:
                        self._queue.append(item)
                self._queued_bytes = sum(len(item.batch) for item in self._queue)
                self._first_queued = time.monotonic()
                continue
            # stored, but acknowledged only while the lease holds: once it may have passed to
            # another broker, nothing more is (the batches stay in this broker's journal, as
            # any batch whose acknowledgement was lost; lease_error() stops every later write)
            refused = self.lease_error()
            if refused is not None:
                for item in live:
                    _fail(item.future, refused)
            self._publish(live, addresses, keys)
            if sealed is not None:
                self._rolled(sealed)

    async def _gather_group(self) -> None:
        """Let the queue fill until ``journal_group_bytes`` are queued or ``journal_group_ms``
        have passed since its oldest append (a group that waited for the previous one's sync
        that long goes at once)."""
        deadline = self._first_queued + (self.config.journal_group_ms or 0) / 1000
        while self._queued_bytes < self.config.journal_group_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _write_group(
        self, entries: Sequence[tuple[bytes, Payload]], sync: bool
    ) -> tuple[list[JournalAddress], int | None]:
        """Write (and sync) a group on the journal thread; returns the entries' addresses and
        the id of the file sealed if the group filled it (for the loop to pass on)."""
        addresses = self.journal.append(entries)  # a failed append leaves nothing behind
        if sync:
            try:
                self.metrics.timed_fsync(self.id, self.journal.sync)
            except SlipstreamError:
                # fsync=always acknowledged only synced groups, so this cuts only this group
                self.journal.discard_unsynced()
                raise
        sealed = None
        if self.journal.active_bytes >= self.config.roll_bytes:
            sealed = self._roll()
        return addresses, sealed

    def _roll(self) -> int | None:
        """Seal the active journal file (on the journal thread); the sealed file's id, None if
        there was nothing to seal or the roll failed (logged; the next roll retries). Touches
        no loop object: the caller hands the result to ``_rolled`` on the loop."""
        try:
            return self.journal.roll()
        except SlipstreamError as exc:
            log.warning("container %d: journal roll failed, will retry: %s", self.id, exc)
            return None

    def _rolled(self, sealed: int | None) -> None:
        """On the loop, after a roll: restart the roll timer, and wake the mover if a file was
        sealed."""
        self._roll_started = time.monotonic()
        if sealed is not None:
            self._sealed.set()

    def _publish(
        self,
        group: list[_Append],
        addresses: list[JournalAddress],
        keys: Sequence[bytes | None],
    ) -> None:
        touched: set[Segment] = set()
        now_ms = scaling_now_ms()  # monotonic: rates for scaling
        for item, address, hashes in zip(group, addresses, keys, strict=True):
            segment, header = item.segment, item.header
            base = segment.next_offset
            cached = JournalBatch(
                base,
                base + header.event_count,
                address,
                header.min_timestamp,
                header.max_timestamp,
                item.batch,
                hashes,
            )
            segment.journal.append(cached)
            segment.next_offset = cached.next_offset
            segment.note_batch(header.batch_length, header.min_timestamp, header.max_timestamp)
            segment.rates(now_ms).observe(
                now_ms, scaled_count(header.event_count), scaled_count(header.batch_length)
            )
            self.metrics.produced(segment.stream_name, header.event_count, header.batch_length)
            self._cache(cached)
            touched.add(segment)
            if not item.future.done():
                item.future.set_result(base)
        self.appended_batches += len(group)
        for segment in touched:
            segment.notify()

    def _cache(self, batch: JournalBatch) -> None:
        assert batch.data is not None
        self._cached.append(batch)
        self._cached_bytes += len(batch.data)
        while self._cached_bytes > self.config.tail_cache_bytes and self._cached:
            old = self._cached.popleft()
            if old.data is not None:
                self._cached_bytes -= len(old.data)
                old.data = None

    async def _sync_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.fsync_interval_ms / 1000)
            try:
                await loop.run_in_executor(
                    self._io, self.metrics.timed_fsync, self.id, self.journal.sync
                )
            except Exception as exc:  # acknowledged data stays; the next sync tries again
                log.error("container %d: periodic sync failed: %s", self.id, exc)

    # --- reads -----------------------------------------------------------------------------

    async def read(
        self, segment: Segment, offset: int, max_bytes: int
    ) -> list[bytes | bytearray | memoryview]:
        """Whole batches from the one holding ``offset``, about ``max_bytes`` (at least one
        batch), never past the durable end. Empty when ``offset`` is at the end.

        Raises OffsetOutOfRange below the oldest retained offset, StreamNotFound after delete,
        CorruptData (naming segment and offset) if stored bytes fail their CRC32C.
        """
        for _ in range(3):  # a batch may move to a chunk while we read it from the journal
            if segment.deleted:
                raise StreamNotFound(f"stream {segment.stream_name!r} was deleted")
            if offset < segment.start_offset:
                raise OffsetOutOfRange(
                    f"offset {offset} of segment {segment.number} of {segment.stream_name!r} "
                    f"was removed by retention; the oldest retained offset is "
                    f"{segment.start_offset}",
                    segment=segment.number,
                    offset=offset,
                    oldest=segment.start_offset,
                )
            if offset > segment.next_offset:
                raise OffsetOutOfRange(
                    f"offset {offset} of segment {segment.number} of {segment.stream_name!r} is "
                    f"past its end {segment.next_offset}",
                    segment=segment.number,
                    offset=offset,
                    end=segment.next_offset,
                )
            if offset == segment.next_offset:
                return []
            try:
                last = segment.last_chunk
                if last is not None and offset < last.record.next_offset:
                    # the newest chunk is at hand; an older one is looked up in a reader thread
                    chunk = last if offset >= last.record.base_offset else None
                    return await asyncio.get_running_loop().run_in_executor(
                        self._read_pool, self._read_chunk, segment, chunk, offset, max_bytes
                    )
                return await self._read_journal(segment, offset, max_bytes)
            except FileNotFoundError:
                continue
            except CorruptData:
                if offset < segment.start_offset:
                    continue  # retention removed the chunk while we read it
                raise
        raise CorruptData(f"segment {segment.number} offset {offset} could not be located")

    async def _read_journal(
        self, segment: Segment, offset: int, max_bytes: int
    ) -> list[bytes | bytearray | memoryview]:
        journal, total = segment.journal, 0
        planned: list[JournalBatch] = []
        index = segment.journal_index(offset)
        while index < len(journal) and total < max_bytes:
            if journal[index].lost:
                if not planned:
                    raise _lost(segment, offset, journal[index].next_offset)
                break  # serve the batches before the hole; the next read reports it
            planned.append(journal[index])
            total += journal[index].address.length - _SEGMENT_ID.size
            index += 1
        missing = [batch.address for batch in planned if batch.data is None]
        loaded: list[bytes | CorruptData] = []
        if missing:  # one trip to a reader thread for all uncached batches of this read
            loaded = await asyncio.get_running_loop().run_in_executor(
                self._read_pool, self._load_journal, missing
            )
        out: list[bytes | bytearray | memoryview] = []
        results = iter(loaded)
        for batch in planned:
            if batch.data is not None:
                out.append(batch.data)
                continue
            payload = next(results)
            if isinstance(payload, CorruptData):
                if out:
                    break  # serve the good batches first; the next read reports this one
                raise CorruptData(
                    f"corrupt data in segment {segment.number} of {segment.stream_name!r} "
                    f"at offset {batch.base_offset} (journal): {payload.message}",
                    segment=segment.number,
                    offset=batch.base_offset,
                ) from payload
            out.append(memoryview(payload)[_SEGMENT_ID.size :])
        return out

    def _load_journal(self, addresses: list[JournalAddress]) -> list[bytes | CorruptData]:
        loaded: list[bytes | CorruptData] = []
        for address in addresses:
            try:
                loaded.append(self.journal.read(address))
            except CorruptData as exc:
                loaded.append(exc)
                break
        return loaded

    def _read_chunk(
        self, segment: Segment, chunk: Chunk | None, offset: int, max_bytes: int
    ) -> list[bytes | bytearray | memoryview]:
        """Batches from the chunk holding ``offset`` (a reader thread's work); ``chunk`` None:
        look it up (``chunk_cache``, then the catalog)."""
        if chunk is None:
            chunk = self.chunk_cache.lookup(segment, offset)
            if chunk is None or offset >= chunk.record.next_offset:
                # retention removed it meanwhile (the caller checks the start offset again)
                raise CorruptData(
                    f"segment {segment.number} of {segment.stream_name!r}: no chunk holds "
                    f"offset {offset}",
                    segment=segment.number,
                    offset=offset,
                )
        if not len(chunk.offsets) or offset < chunk.offsets[0]:  # a hole begins the chunk
            after = chunk.offsets[0] if len(chunk.offsets) else chunk.record.next_offset
            raise _lost(segment, offset, int(after))
        first = chunk.batch_containing(offset)
        sizes = np.cumsum(chunk.lengths[first:])
        last = first + max(1, int(np.searchsorted(sizes, max_bytes, side="right")))
        start = int(chunk.positions[first])
        end = int(chunk.positions[last - 1] + chunk.lengths[last - 1])
        try:
            data = memoryview(self.long_term.read_chunk(chunk.record.name, start, end - start))
        except CorruptData as exc:  # missing or cut short: name the position the reader knows
            raise CorruptData(
                f"corrupt data in segment {segment.number} of {segment.stream_name!r} at "
                f"offset {int(chunk.offsets[first])}: {exc.message}",
                segment=segment.number,
                offset=int(chunk.offsets[first]),
                chunk=chunk.record.name,
            ) from exc
        out: list[bytes | bytearray | memoryview] = []
        expected = offset
        for i in range(first, last):
            if out and chunk.offsets[i] != expected:
                break  # a hole follows: serve what is before it; the next read reports it
            at = int(chunk.positions[i]) - start
            try:
                header = verify(data, at)
                if header.base_offset != chunk.offsets[i]:
                    raise CorruptBatch(
                        f"base offset {header.base_offset} != index {chunk.offsets[i]}"
                    )
                if header.batch_length != chunk.lengths[i]:
                    raise CorruptBatch(
                        f"batch length {header.batch_length} != index {chunk.lengths[i]}"
                    )
            except CorruptBatch as exc:
                if out:
                    break  # serve the good batches first; the next read reports this one
                raise CorruptData(
                    f"corrupt data in segment {segment.number} of {segment.stream_name!r} at "
                    f"offset {int(chunk.offsets[i])} (chunk {chunk.record.name}): {exc}",
                    segment=segment.number,
                    offset=int(chunk.offsets[i]),
                ) from exc
            if header.next_offset <= offset:  # ``offset`` lies in a hole after this batch
                last_batch = i + 1 == len(chunk.offsets)
                after = chunk.record.next_offset if last_batch else int(chunk.offsets[i + 1])
                raise _lost(segment, offset, after)
            out.append(data[at : at + header.batch_length])
            expected = header.next_offset
        return out

    # --- moving journal files to long-term chunks ------------------------------------------

    async def _move_loop(self) -> None:
        loop = asyncio.get_running_loop()
        await self._delete_orphans()
        while True:
            try:
                await asyncio.wait_for(self._sealed.wait(), self.config.roll_ms / 1000)
            except TimeoutError:
                if time.monotonic() - self._roll_started >= self.config.roll_ms / 1000:
                    self._rolled(await loop.run_in_executor(self._io, self._roll))
            self._sealed.clear()
            for file_id in self.journal.sealed_files():
                try:
                    await self._move_file(file_id)
                except (SlipstreamError, OSError) as exc:
                    if isinstance(exc, LeaseLost):
                        self.lose(str(exc))
                    log.error(
                        "container %d: moving journal file %d failed, will retry: %s",
                        self.id,
                        file_id,
                        exc,
                    )
                    break

    async def _move_file(self, file_id: int) -> None:
        loop = asyncio.get_running_loop()
        source = self.journal.file_path(file_id)
        # Everything the mover's thread needs of the segments, taken now, on the loop: the
        # loop goes on changing them (appends, retention, deletion) while the mover runs.
        targets: dict[int, _MoveTarget] = {}
        # The find indexes need the batches' key hashes: made at append (or by recovery) and
        # handed over by position in the file; a batch without them (indexing was off, or its
        # body did not decode) is decoded from the tail cache's bytes (a published batch's
        # bytes never change) or, evicted, read back from the file.
        known: dict[int, bytes] = {}
        cached: dict[int, Payload | bytes] = {}
        for global_id, segment in self.segments.items():
            # the offsets the segment lost in this file: its chunk covers them, as a gap in
            # the batch index, so the hole outlives the journal file (and a restart)
            in_file = list(takewhile(lambda b: b.address.file_id == file_id, segment.journal))
            lost = [batch for batch in in_file if batch.lost]  # in offset order
            if self.config.find_index:
                for batch in in_file:
                    at = batch.address.position + _SEGMENT_ID.size
                    if batch.keys is not None:
                        known[at] = batch.keys
                    elif batch.data is not None:
                        cached[at] = batch.data
            targets[global_id] = _MoveTarget(
                segment.stream_id,
                segment.number,
                segment.moved_producers,
                segment.last_timestamp,
                (lost[0].base_offset, lost[-1].next_offset) if lost else None,
            )

        def write_chunks() -> list[tuple[int, ChunkRecord]]:
            # (payload position, header) of each live segment's batches, in offset order
            by_segment: dict[int, list[tuple[int, BatchHeader, Payload | bytes]]] = {
                global_id: [] for global_id, target in targets.items() if target.hole
            }
            # a file that becomes chunks as it is needs only its batch headers read back
            found = (
                self.journal.entries(file_id)
                if source is None
                else self.journal.heads(file_id, _SEGMENT_ID.size + HEADER_LENGTH)
            )
            for address, payload in found:
                (global_id,) = _SEGMENT_ID.unpack_from(payload)
                if global_id in targets:
                    batch = payload[_SEGMENT_ID.size :]
                    at = address.position + _SEGMENT_ID.size
                    by_segment.setdefault(global_id, []).append((at, decode_header(batch), batch))
            # One segment at most, owning at least half of the file, gets the file itself (a
            # hard link in a local store); the others get copies of their batches. So no two
            # segments' chunks share space: retention and deletion free each one's bytes, and
            # a linked chunk holds no more bytes of others than of its own.
            owned = {
                global_id: sum(h.batch_length for _, h, _ in batches)
                for global_id, batches in by_segment.items()
            }
            adopter = max(owned, key=owned.__getitem__, default=None)
            if source is None or adopter is None or owned[adopter] * 2 < source.stat().st_size:
                adopter = None
            # names no other upload uses (storage/_chunks.py): a broker paused past its lease,
            # or this move's retry, never overwrites a chunk another upload recorded
            writer = writer_tag(self.lease.epoch if self.lease is not None else 0)
            started = time.monotonic()
            plans = []
            for global_id, batches in by_segment.items():
                target = targets[global_id]
                headers = [h for _, h, _ in batches]
                # the idempotence state as of this chunk's end: the previous chunk's, plus these
                producers = ProducerTable.from_snapshot(target.producers)
                for h in headers:
                    _remember(producers, h)
                spans = [(h.base_offset, h.next_offset) for h in headers[:1] + headers[-1:]]
                if target.hole is not None:
                    spans.append(target.hole)
                base, end = min(s for s, _ in spans), max(e for _, e in spans)
                name = chunk_name(target.stream_id, target.number, base, writer)
                if not batches:  # nothing but a hole: an empty chunk keeps its offsets taken
                    self.long_term.write_chunk(name, [])
                    positions = []
                elif source is not None:
                    ranges = [(at, h.batch_length) for at, h, _ in batches]
                    store = self.long_term
                    keep = store.adopt_ranges if global_id == adopter else store.copy_ranges
                    positions = keep(name, source, ranges)
                else:
                    self.long_term.write_chunk(name, [b for _, _, b in batches])
                    positions = np.cumsum([0] + [h.batch_length for h in headers[:-1]]).tolist()
                index = np.array(
                    [
                        (h.base_offset, p, h.batch_length)
                        for h, p in zip(headers, positions, strict=True)
                    ],
                    dtype="<i8",
                )
                finds = b""
                if self.config.find_index:
                    finds = build_find_index(
                        headers,
                        [
                            known[at]
                            if at in known
                            else _key_hashes(_batch_bytes(source, at, h, b, cached))
                            for at, h, b in batches
                        ],
                    )
                last_timestamp = target.last_timestamp or 0
                record = ChunkRecord(
                    target.stream_id,
                    target.number,
                    base,
                    end,
                    sum(h.batch_length for h in headers),
                    min((h.min_timestamp for h in headers), default=last_timestamp),
                    max((h.max_timestamp for h in headers), default=last_timestamp),
                    name,
                    index.tobytes(),
                    producers.snapshot() if len(producers) else b"",
                    finds,
                )
                plans.append((global_id, record))
            if time.monotonic() - started > MOVE_COMMIT_WINDOW_S:
                # the orphan sweep may take uploads this old for orphans (ChunkSweep): retry
                raise StorageError(
                    f"moving journal file {file_id} took over {MOVE_COMMIT_WINDOW_S:g} s from "
                    "its first upload; not recorded, retried under new names"
                )
            # fenced: refused (LeaseLost) once another broker holds the container
            self.meta.add_chunks(
                self.id, file_id, [record for _, record in plans], lease=self.lease
            )
            return plans

        plans = await loop.run_in_executor(self._mover, write_chunks)
        orphans: list[str] = []
        for global_id, record in plans:
            live = self.segments.get(global_id)
            if live is None:
                # deleted while the mover ran: its catalog entry is gone (or never made), and
                # its stream's deletion may not have known of this chunk
                orphans.append(record.name)
                continue
            segment, moved = live, 0
            while (
                moved < len(segment.journal) and segment.journal[moved].address.file_id == file_id
            ):
                batch = segment.journal[moved]
                if batch.data is not None:
                    self._cached_bytes -= len(batch.data)
                    batch.data = None
                moved += 1
            del segment.journal[:moved]
            segment.add_chunk(record)
        self._cached = deque(b for b in self._cached if b.data is not None)
        if orphans:
            await loop.run_in_executor(
                self._mover, lambda: [self.long_term.delete_chunk(name) for name in orphans]
            )
        await loop.run_in_executor(self._io, self.journal.delete_file, file_id)
        await self._delete_orphans()

    async def _delete_orphans(self) -> None:
        """Delete what the journal stored but never recorded (an object journal's uploads cut
        off by a crash before their record) or no longer needs (moved files' objects): found
        on the journal thread, so never an upload whose record is on its way, deleted on the
        mover's. A failure is logged; the next move tries again."""
        loop = asyncio.get_running_loop()
        try:
            orphans = await loop.run_in_executor(self._io, self.journal.collect_orphans)
            if orphans:
                await loop.run_in_executor(self._mover, self.journal.delete_objects, orphans)
        except (SlipstreamError, OSError) as exc:
            log.warning("container %d: deleting orphaned journal data failed: %s", self.id, exc)
            return
        if orphans:
            log.info("container %d: deleted %d unrecorded journal objects", self.id, len(orphans))

    async def close(self) -> None:
        """Sync what is written and stop the IO threads."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._io, self.journal.sync)
        except SlipstreamError as exc:
            log.error("container %d: final sync failed: %s", self.id, exc)
        await loop.run_in_executor(self._io, self.journal.close)
        self._io.shutdown(wait=True)
        self._mover.shutdown(wait=True)


def _lost(segment: Segment, offset: int, resume: int) -> CorruptData:
    """The error for a read in a hole: offsets lost to damaged storage (Container.recover)."""
    return CorruptData(
        f"corrupt data in segment {segment.number} of {segment.stream_name!r} at offset "
        f"{offset}: lost to damaged storage up to offset {resume - 1} (see the broker log); "
        f"read on from offset {resume}",
        segment=segment.number,
        offset=offset,
        resume=resume,
    )


def sealed_error(segment: Segment) -> SegmentSealed:
    return SegmentSealed(
        f"segment {segment.number} of {segment.stream_name!r} is sealed (the stream was "
        f"scaled); its keys now go to segments {segment.successors}: describe the stream again "
        "and send there (the client does this by itself)",
        stream=segment.stream_name,
        segment=segment.number,
        successors=segment.successors,
    )


def _fail(future: asyncio.Future[int], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _chain(first: asyncio.Future[int], retry: asyncio.Future[int]) -> None:
    """Give ``retry`` the outcome of ``first`` (a retry that arrived while its first copy was
    still being stored)."""

    def copy(done: asyncio.Future[int]) -> None:
        if retry.done():
            return
        if done.exception() is not None:
            retry.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            retry.set_result(done.result())

    first.add_done_callback(copy)


def _batch_bytes(
    source: Path | None,
    at: int,
    header: BatchHeader,
    found: Payload | bytes,
    cached: dict[int, Payload | bytes],
) -> Payload | bytes:
    """A moved batch's whole bytes for its find index (the mover's thread): ``found`` if the
    journal gave whole entries, else the tail cache's copy, else read from the file."""
    if source is None or len(found) >= header.batch_length:
        return found
    data = cached.get(at)
    if data is not None:
        return data
    with open(source, "rb") as f:
        return os.pread(f.fileno(), header.batch_length, at)


#: batches whose key hashes recovery makes with one vectorised call
_RECOVERY_HASH_GROUP = 1024


def _group_keys(batches: list[Payload]) -> list[bytes | None]:
    """The key hashes of a group being appended (on the loop): a batch whose
    body does not decode gets None (finds read it; the mover indexes no keys for it). Never
    raises: the hashes are an optimisation, never a reason to fail an append."""
    try:
        return batches_key_hashes(batches)
    except Exception:
        log.exception("find index: hashing a group's keys failed; finds will read its batches")
        return [None] * len(batches)


def _set_keys(unhashed: list[tuple[JournalBatch, memoryview]]) -> None:
    """Recovery: give recovered journal batches their key hashes, then forget them."""
    if unhashed:
        for (batch, _), hashes in zip(
            unhashed, _group_keys([payload for _, payload in unhashed]), strict=True
        ):
            batch.keys = hashes
        unhashed.clear()


def _key_hashes(batch: Payload | bytes) -> np.ndarray:
    """A batch's key hashes for its chunk's find index. A body that does not decode (its CRC
    passed: a producer's bug) indexes no keys; finds never match its events, reads still fail
    on it as they always did."""
    try:
        return batch_key_hashes(batch)
    except CorruptBatch as exc:
        log.warning("find index: a batch's body does not decode, its keys are not indexed: %s", exc)
        return np.zeros(0, dtype=np.uint32)


def _remember(producers: ProducerTable, header: BatchHeader) -> None:
    """Replay an appended batch into a segment's idempotence state."""
    if header.producer_id >= 0:
        producers.record(
            header.producer_id,
            header.producer_epoch,
            header.sequence,
            header.event_count,
            header.base_offset,
        )
