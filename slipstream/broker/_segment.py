"""A segment's in-memory index: where each of its batches lives, and who waits for more.

A segment's batches live first in its container's journal (``journal``: newest last, the
recent ones with their bytes cached) and move to long-term chunks (``chunks``) in offset order.
``next_offset`` is the durable end: readers never see past it. Only the event loop thread
mutates a segment, and worker threads never read its changing fields: the mover works from a
snapshot taken on the loop (``Container._move_file``), a reader thread gets a segment's fixed
names and a ``Chunk``, whose index arrays never change.
"""

from __future__ import annotations

import asyncio
import builtins
from bisect import bisect_right
from dataclasses import dataclass, field

import msgspec
import numpy as np

from ..storage import ChunkRecord, JournalAddress
from ..streams import ProducerTable


@dataclass(slots=True, eq=False)
class JournalBatch:
    """A batch still in the journal. ``data`` is the cached batch (tail cache) or None."""

    base_offset: int
    next_offset: int
    address: JournalAddress
    min_timestamp: int
    max_timestamp: int
    data: bytes | bytearray | memoryview | None

    @property
    def lost(self) -> bool:
        """A hole: offsets whose batch was in damaged journal bytes (see Container.recover)."""
        return self.address.position < 0


@dataclass(slots=True, eq=False)
class Chunk:
    """A chunk in long-term storage with its batch index: base offsets, positions, lengths."""

    record: ChunkRecord
    offsets: np.ndarray
    positions: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, record: ChunkRecord) -> Chunk:
        triples = np.frombuffer(record.index, dtype="<i8").reshape(-1, 3)
        return cls(record, triples[:, 0].copy(), triples[:, 1].copy(), triples[:, 2].copy())

    def batch_containing(self, offset: int) -> int:
        return max(0, int(np.searchsorted(self.offsets, offset, side="right")) - 1)


@dataclass(eq=False)
class Segment:
    stream_id: int
    stream_name: str
    number: int
    epoch: int
    key_lo: int
    key_hi: int
    container: int
    start_offset: int = 0
    next_offset: int = 0
    pending_offset: int = 0  # offsets handed to appends not yet durable
    chunks: list[Chunk] = field(default_factory=list)
    journal: list[JournalBatch] = field(default_factory=list)
    bytes: int = 0
    first_timestamp: int | None = None
    last_timestamp: int | None = None
    sealed: bool = False
    deleted: bool = False
    #: idempotent producers' recent batches (see streams/_idempotence.py)
    producers: ProducerTable = field(default_factory=ProducerTable)
    #: their snapshot as of the newest chunk (the catalog's SegmentRecord.producers), which
    #: the mover's next chunk builds on; retention does not touch it
    moved_producers: builtins.bytes | None = None
    _waiter: asyncio.Future[None] | None = None

    @property
    def global_id(self) -> int:
        return segment_global_id(self.stream_id, self.number)

    def note_batch(self, count_bytes: int, min_ts: int, max_ts: int) -> None:
        self.bytes += count_bytes
        if self.first_timestamp is None or min_ts < self.first_timestamp:
            self.first_timestamp = min_ts
        if self.last_timestamp is None or max_ts > self.last_timestamp:
            self.last_timestamp = max_ts

    async def wait_for_change(self) -> None:
        """Return once the durable end moves, or the segment is deleted or sealed."""
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._waiter)

    def notify(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def add_chunk(self, record: ChunkRecord) -> None:
        """Append a chunk. Only the newest chunk keeps its idempotence snapshot in memory: it is
        the one the next chunk's snapshot builds on."""
        if self.chunks and self.chunks[-1].record.producers:
            last = self.chunks[-1]
            last.record = msgspec.structs.replace(last.record, producers=b"")
        self.chunks.append(Chunk.of(record))

    def journal_index(self, offset: int) -> int:
        """Index in ``journal`` of the batch holding ``offset`` (journal must cover it)."""
        lo, hi = 0, len(self.journal)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.journal[mid].next_offset <= offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def chunk_index(self, offset: int) -> int:
        bases = [c.record.base_offset for c in self.chunks]
        return bisect_right(bases, offset) - 1


def segment_global_id(stream_id: int, number: int) -> int:
    """The id a segment's batches carry in the journal: unique for the life of a data dir."""
    return (stream_id << 24) | number


def split_global_id(global_id: int) -> tuple[int, int]:
    return global_id >> 24, global_id & 0xFFFFFF
