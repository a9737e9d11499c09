"""A segment's in-memory index: where each of its batches lives, and who waits for more.

A segment's batches live first in its container's journal (``journal``: newest last, the
recent ones with their bytes cached) and move to long-term chunks in offset order. Of its
chunks the segment keeps in memory only what the hot paths need (the newest, ``last_chunk``,
where the journal takes over; how many; their bytes and times): memory does not grow with
retained history. Any other chunk is looked up in the catalog when a read needs it, through
the container's bounded ``ChunkCache``. ``next_offset`` is the durable end: readers never see
past it. Only the event loop thread mutates a segment, and worker threads never read its
changing fields: the mover works from a snapshot taken on the loop (``Container._move_file``),
a reader thread gets a segment's fixed names and a ``Chunk``, whose index arrays never change.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import threading
from bisect import bisect_right, insort
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pyarrow as pa

from .._errors import KeyOutOfRange
from ..format import read_keys
from ..storage import ChunkRecord, JournalAddress
from ..streams import MAX_KEY_HASH, ProducerTable, RateTracker, first_key_outside

#: whether appends check their keys against the segment's key range (``Segment.check_keys``);
#: off only to measure what the check costs (bench/key_check.py): SLIPSTREAM_KEY_CHECK=off
KEY_CHECK = os.environ.get("SLIPSTREAM_KEY_CHECK", "on") != "off"


@dataclass(slots=True, eq=False)
class JournalBatch:
    """A batch still in the journal. ``data`` is the cached batch (tail cache) or None.
    ``keys``: its distinct key hashes for finds (sorted ``<u4`` bytes, storage/_index.py),
    set at append and by recovery; None where not known (indexing off, or a body that did not
    decode), and then the first find that reads the batch sets it."""

    base_offset: int
    next_offset: int
    address: JournalAddress
    min_timestamp: int
    max_timestamp: int
    data: bytes | bytearray | memoryview | None
    keys: bytes | None = None

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
        """The chunk of ``record``. Its record keeps neither the index bytes (the arrays hold
        them) nor the idempotence snapshot (``Segment.moved_producers`` holds that), nor the
        find index (finds load it from the catalog)."""
        triples = np.frombuffer(record.index, dtype="<i8").reshape(-1, 3)
        record = msgspec.structs.replace(record, index=b"", producers=b"", finds=b"")
        return cls(record, triples[:, 0].copy(), triples[:, 1].copy(), triples[:, 2].copy())

    @property
    def size(self) -> int:
        """Roughly the memory the chunk takes: its index arrays and a fixed overhead."""
        return int(self.offsets.nbytes * 3) + 512

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
    #: the newest chunk (None: no chunk, or retention removed them all); offsets from its
    #: end on are in the journal
    last_chunk: Chunk | None = None
    chunk_count: int = 0
    journal: list[JournalBatch] = field(default_factory=list)
    bytes: int = 0
    first_timestamp: int | None = None
    last_timestamp: int | None = None
    sealed: bool = False  # by a scale: its end is next_offset, for good
    sealing: bool = False  # a scale is sealing it: appends are refused already
    predecessors: list[int] = field(default_factory=list)
    successors: list[int] = field(default_factory=list)
    deleted: bool = False
    #: idempotent producers' recent batches (see streams/_idempotence.py)
    producers: ProducerTable = field(default_factory=ProducerTable)
    #: their snapshot as of the newest chunk (the catalog's SegmentRecord.producers), which
    #: the mover's next chunk builds on; retention does not touch it
    moved_producers: builtins.bytes | None = None
    _waiter: asyncio.Future[None] | None = None
    #: its append rates since this broker started it (for automatic scaling; monotonic ms)
    _rates: RateTracker | None = None

    def rates(self, now_ms: int) -> RateTracker:
        if self._rates is None:
            self._rates = RateTracker(now_ms)
        return self._rates

    def check_keys(self, batch: builtins.bytes | bytearray | memoryview) -> None:
        """Refuse a batch holding a keyed event whose key hash (``key_hash``, XXH3-64) lies
        outside this segment's key range: raises KeyOutOfRange (nothing of the batch is stored),
        so that no sender with a stale or wrong view of the stream's segments (a buggy or
        foreign client) can put a key where readers do not look for it and break its order
        across a scale. Keyless events go to any segment and are not checked, nor is a batch
        whose key column is not binary or string. Free for a segment owning the whole key
        space (an unscaled one-segment stream); else it decodes the key column (``read_keys``:
        CorruptBatch for a body that does not decode) and hashes every key, about 50 ns an
        event (bench/README.md)."""
        if not KEY_CHECK or (self.key_lo == 0 and self.key_hi == MAX_KEY_HASH):
            return
        keys = read_keys(batch)
        if keys is None or not (
            pa.types.is_binary(keys.type)
            or pa.types.is_string(keys.type)
            or pa.types.is_large_binary(keys.type)
            or pa.types.is_large_string(keys.type)
        ):
            return
        outside = first_key_outside(keys, self.key_lo, self.key_hi)
        if outside is None:
            return
        first, count = outside
        raise KeyOutOfRange(
            f"{count} of the batch's {'keys hash' if count != 1 else 'keys hashes'} "
            f"outside segment {self.number} of {self.stream_name!r}: its key range is "
            f"[{self.key_lo:#018x}, {self.key_hi:#018x}], a key hashes to {first:#018x}. The "
            "sender's view of the stream's segments is stale or wrong: describe the stream "
            "again and send each key to the open segment whose range holds its XXH3-64 hash "
            "(the Python client does this by itself). Nothing of the batch was stored.",
            stream=self.stream_name,
            segment=self.number,
            key_lo=self.key_lo,
            key_hi=self.key_hi,
            key_hash=first,
            outside=count,
        )

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

    @property
    def chunk_end(self) -> int:
        """Where the segment's chunks end and its journal begins."""
        return self.start_offset if self.last_chunk is None else self.last_chunk.record.next_offset

    def add_chunk(self, record: ChunkRecord) -> None:
        """Note a new newest chunk (the mover's)."""
        self.last_chunk = Chunk.of(record)
        self.chunk_count += 1
        self.moved_producers = record.producers or None

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


class ChunkCache:
    """Chunks (their batch indexes) that reads looked up, least recently used dropped first
    beyond ``max_bytes`` (``Chunk.size``): what bounds a container's memory for chunks,
    whatever the retained history. Safe to call from any thread (reader threads look up,
    the loop forgets); ``load`` runs outside the lock, so a slow catalog blocks no hit."""

    def __init__(self, load: Callable[[int, int, int], ChunkRecord | None], max_bytes: int) -> None:
        self._load = load  # (stream id, segment, offset) -> the chunk at or before offset
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._chunks: OrderedDict[tuple[int, int], Chunk] = OrderedDict()
        self._bases: dict[int, list[int]] = {}  # segment global id -> cached bases, sorted
        self._bytes = 0
        self.hits = self.misses = 0

    def lookup(self, segment: Segment, offset: int) -> Chunk | None:
        """The segment's chunk holding ``offset`` (the one with the greatest base offset at or
        before it), from the cache or the catalog; None if the catalog has none."""
        global_id = segment.global_id
        with self._lock:
            bases = self._bases.get(global_id, [])
            i = bisect_right(bases, offset) - 1
            if i >= 0:
                chunk = self._chunks[global_id, bases[i]]
                if offset < chunk.record.next_offset:
                    self._chunks.move_to_end((global_id, bases[i]))
                    self.hits += 1
                    return chunk
            self.misses += 1
        record = self._load(segment.stream_id, segment.number, offset)
        if record is None:
            return None
        chunk = Chunk.of(record)
        with self._lock:
            key = (global_id, record.base_offset)
            if key not in self._chunks:
                self._chunks[key] = chunk
                insort(self._bases.setdefault(global_id, []), record.base_offset)
                self._bytes += chunk.size
                while self._bytes > self.max_bytes and len(self._chunks) > 1:
                    self._drop(next(iter(self._chunks)))
        return chunk

    def forget(self, global_id: int, before: int | None = None) -> None:
        """Drop a segment's chunks that begin before ``before`` (all of them if None)."""
        with self._lock:
            for base in list(self._bases.get(global_id, [])):
                if before is None or base < before:
                    self._drop((global_id, base))

    def __len__(self) -> int:
        return len(self._chunks)

    def _drop(self, key: tuple[int, int]) -> None:
        chunk = self._chunks.pop(key)
        self._bytes -= chunk.size
        bases = self._bases[key[0]]
        bases.remove(key[1])
        if not bases:
            del self._bases[key[0]]


def segment_global_id(stream_id: int, number: int) -> int:
    """The id a segment's batches carry in the journal: unique for the life of a data dir."""
    return (stream_id << 24) | number


def split_global_id(global_id: int) -> tuple[int, int]:
    return global_id >> 24, global_id & 0xFFFFFF
