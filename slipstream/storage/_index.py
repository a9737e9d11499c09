"""The find index of a chunk: which of its batches hold a routing key, and when they were written.

A chunk's batches are indexed once, by the mover, when a sealed journal file becomes chunks:
never on the append path (the broker does not decode events there). The index is stored in the
catalog next to the chunk's batch index (``ChunkRecord.finds``; ``MetaStore.chunk_finds``), so it
is as durable as the chunk, is deleted with it, and costs no second file. Batch *ordinals* are
positions in the chunk's batch index (``ChunkRecord.index``), in offset order.

Byte layout, version 1 (all integers little-endian; docs/format.md says the same):

    offset   size   field            meaning
    0        4      magic            b"SLFX"
    4        1      version          1
    5        3      reserved         0
    8        4      crc32c           u32, CRC32C (Castagnoli) of bytes [16, end)
    12       4      batch_count      u32, n: batches of the chunk's batch index
    16       4      pair_count       u32, m: (key hash, batch) pairs
    20       4      reserved         0
    24       8n     min_timestamp    i64 per batch: its oldest event time (ms)
    24+8n    8n     max_timestamp    i64 per batch: its newest event time (ms)
    24+16n   4m     key_hash         u32: low 32 bits of the key's XXH3-64 hash (the routing hash),
                                     ascending
    24+16n+4m 4m    batch            u32: the ordinal of a batch holding a key of that hash,
                                     ascending within one hash

One pair per distinct key per batch: events without a key (or batches whose schema has no
``key`` column) add none. A lookup is two binary searches; it returns every batch that holds
the key, and also those that hold another key of the same 32-bit hash (about m / 2**32 of the
lookups, one extra batch read each): the reader compares keys exactly.

Size against the alternative, measured in bench/find.py (bench/README.md): a sorted array costs
8 bytes per distinct key per batch plus 16 bytes per batch, and answers exactly which batches;
a per-batch Bloom filter at 1% false positives costs about 1.2 bytes per key but must be tested
batch by batch, and every false positive is a whole batch read (one per hundred batches of a
chunk). With batches of tens to thousands of events, the array is 0.3-2% of the data, small
enough that exact answers win.

Failure modes: an index that is missing (chunks moved before the index existed, or a mover with
indexing switched off), of a newer version, or whose CRC fails decodes to None; the caller then
scans that chunk's batches, so old and damaged indexes cost time, never answers.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from ..format import BatchHeader, read_body

FIND_MAGIC = b"SLFX"
FIND_VERSION = 1
_HEADER = struct.Struct("<4sB3xIIII")
FIND_HEADER_LENGTH = _HEADER.size
assert FIND_HEADER_LENGTH == 24
_NO_HASHES = np.zeros(0, dtype=np.uint32)


def key_hash32(key: bytes) -> int:
    """The 32 bits of a routing key's hash the index keeps: the low half of ``key_hash`` (XXH3-64,
    seed 0; streams/_routing.py). The low half, because a segment's keys share the high bits
    (segments own ranges of the hash space)."""
    return int(xxhash.xxh3_64_intdigest(key)) & 0xFFFFFFFF


def batch_key_hashes(batch: bytes | bytearray | memoryview) -> np.ndarray:
    """The distinct 32-bit key hashes of one whole batch's events (sorted ``uint32``): one hash
    per distinct key, none for null keys. Decodes the batch body (read_body); raises CorruptBatch
    for a body that does not decode. A batch whose schema has no binary ``key`` column has none."""
    record = read_body(batch)  # either body form; a typed stream's own schema too
    if "key" not in record.schema.names:
        return _NO_HASHES
    column = record.column("key")
    if not (pa.types.is_binary(column.type) or pa.types.is_string(column.type)):
        return _NO_HASHES
    if column.null_count == len(column):
        return _NO_HASHES
    distinct = pc.unique(column.drop_null()).to_pylist()
    hashes = np.fromiter(
        (
            key_hash32(k if isinstance(k, bytes) else k.encode())
            for k in distinct  # distinct keys: usually far fewer than events
        ),
        dtype=np.uint32,
        count=len(distinct),
    )
    return np.unique(hashes)


def build_find_index(headers: Sequence[BatchHeader], hashes: Sequence[np.ndarray]) -> bytes:
    """The find index of a chunk whose batch index lists batches with ``headers`` (in order);
    ``hashes[i]``: the distinct key hashes of batch i (``batch_key_hashes``)."""
    count = len(headers)
    if len(hashes) != count:
        raise ValueError(f"{len(hashes)} hash arrays for {count} batches")
    min_ts = np.fromiter((h.min_timestamp for h in headers), dtype="<i8", count=count)
    max_ts = np.fromiter((h.max_timestamp for h in headers), dtype="<i8", count=count)
    sizes = np.fromiter((len(h) for h in hashes), dtype=np.int64, count=count)
    keys = np.concatenate(hashes).astype("<u4") if count else np.zeros(0, "<u4")
    batches = np.repeat(np.arange(count, dtype="<u4"), sizes)
    order = np.lexsort((batches, keys))
    body = b"".join(
        (min_ts.tobytes(), max_ts.tobytes(), keys[order].tobytes(), batches[order].tobytes())
    )
    header = _HEADER.pack(FIND_MAGIC, FIND_VERSION, crc32c.crc32c(body), count, len(keys), 0)
    return header + body


class FindIndex:
    """A decoded find index (read-only numpy views of its bytes)."""

    __slots__ = ("batch_count", "batches", "key_hashes", "max_timestamps", "min_timestamps")

    def __init__(
        self,
        min_timestamps: np.ndarray,
        max_timestamps: np.ndarray,
        key_hashes: np.ndarray,
        batches: np.ndarray,
    ) -> None:
        self.batch_count = len(min_timestamps)
        self.min_timestamps = min_timestamps
        self.max_timestamps = max_timestamps
        self.key_hashes = key_hashes
        self.batches = batches

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> FindIndex | None:
        """The index in ``data``; None if there is none (b""), or it is of another version,
        cut short, or fails its CRC: the caller scans the chunk instead."""
        if len(data) < FIND_HEADER_LENGTH:
            return None
        magic, version, crc, count, pairs, _ = _HEADER.unpack_from(data)
        if magic != FIND_MAGIC or version != FIND_VERSION:
            return None
        if len(data) != FIND_HEADER_LENGTH + 16 * count + 8 * pairs:
            return None
        body = memoryview(data)[FIND_HEADER_LENGTH:]
        if crc32c.crc32c(body) != crc:
            return None
        at = 0

        def take(dtype: str, n: int, size: int) -> np.ndarray:
            nonlocal at
            array = np.frombuffer(body, dtype=dtype, count=n, offset=at)
            at += n * size
            return array

        min_ts = take("<i8", count, 8)
        max_ts = take("<i8", count, 8)
        keys = take("<u4", pairs, 4)
        batches = take("<u4", pairs, 4)
        return cls(min_ts, max_ts, keys, batches)

    def batches_with(
        self, key_hash: int | None = None, start_ms: int | None = None, end_ms: int | None = None
    ) -> np.ndarray:
        """Ordinals (ascending) of the batches that may hold an event of a key with that 32-bit
        hash (any key if None) with a time in ``[start_ms, end_ms)`` (unbounded where None)."""
        if key_hash is None:
            candidates = np.arange(self.batch_count, dtype=np.int64)
        else:
            lo = int(np.searchsorted(self.key_hashes, key_hash, side="left"))
            hi = int(np.searchsorted(self.key_hashes, key_hash, side="right"))
            candidates = self.batches[lo:hi].astype(np.int64)
        if start_ms is not None:
            candidates = candidates[self.max_timestamps[candidates] >= start_ms]
        if end_ms is not None:
            candidates = candidates[self.min_timestamps[candidates] < end_ms]
        return candidates
