"""The find index of a chunk: which of its batches hold a routing key, and when they were written.

Each batch's key hashes are made once, at append (``batches_key_hashes``, for a whole group,
decoding only the key column, while the journal writes the group), and again by recovery for
batches still in the journal; the mover writes them into the index of the chunk the batch
lands in. The index is stored in the catalog next to the chunk's batch index
(``ChunkRecord.finds``; ``MetaStore.chunk_finds``), so it is as durable as the chunk, is
deleted with it, and costs no second file. Batch *ordinals* are positions in the chunk's batch
index (``ChunkRecord.index``), in offset order.

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
    24+16n   4m     key_hash         u32: the key's index hash (column_key_hashes), ascending
    24+16n+4m 4m    batch            u32: the ordinal of a batch holding a key of that hash,
                                     ascending within one hash

One pair per distinct key per batch: events without a key (or batches whose schema has no
``key`` column) add none. A lookup is two binary searches; it returns every batch that holds
the key, and also those that hold another key of the same 32-bit index hash (about m / 2**32 of the
lookups, one extra batch read each): the reader compares keys exactly.

Size against the alternative: a sorted array costs 8 bytes per distinct key per batch plus 16
bytes per batch, and answers exactly which batches; a per-batch Bloom filter at 1% false
positives would cost about 1.2 bytes per key but must be tested batch by batch, and every false
positive is a whole batch read (one per hundred batches of a chunk: with 2 MiB batches, 20 KiB
of reads per batch tested). Measured by bench/find.py (bench/README.md): 7.7 MB per GB of
random 1,000-byte events over 100,000 keys (0.77%), small enough that exact answers win.

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

from .._errors import CorruptBatch
from ..format import BatchHeader, read_keys

FIND_MAGIC = b"SLFX"
FIND_VERSION = 1
_HEADER = struct.Struct("<4sB3xIIII")
FIND_HEADER_LENGTH = _HEADER.size
assert FIND_HEADER_LENGTH == 24
_NO_HASHES = np.zeros(0, dtype=np.uint32)


#: the index's key hash (not the routing hash: this one is computed for a whole Arrow column at
#: once with numpy, 30x cheaper than hashing key by key in Python; docs/format.md spells it out)
_PRIME = np.uint64(0x100000001B3)
_LENGTH_MIX = np.uint64(0x9E3779B97F4A7C15)
_POWERS = np.cumprod(np.full(256, _PRIME, dtype=np.uint64))  # P**1 .. P**256, mod 2**64
_POWERS = np.concatenate([np.ones(1, dtype=np.uint64), _POWERS])  # P**0 .. P**256


def _powers(count: int) -> np.ndarray:
    """P**0 .. P**(count - 1), mod 2**64."""
    global _POWERS
    if count > len(_POWERS):
        more = np.cumprod(np.full(count - len(_POWERS), _PRIME, dtype=np.uint64)) * _POWERS[-1]
        _POWERS = np.concatenate([_POWERS, more])
    return _POWERS[:count]


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise (uint64, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def column_key_hashes(keys: pa.Array) -> np.ndarray:
    """The 32-bit index hash of every non-null key of a ``binary`` or ``string`` column, in row
    order (``uint32``): for key bytes b[0..L), s = sum of b[i] * P**(L-1-i) mod 2**64 with P the
    64-bit FNV prime, then splitmix64(s ^ L * 0x9E3779B97F4A7C15), low 32 bits. Vectorised: no
    Python work per key, except for a few short keys, hashed in plain Python (2 us a key
    against numpy's 25 us of fixed cost a call: what a group of one small batch costs)."""
    if keys.null_count:
        keys = keys.drop_null()
    count = len(keys)
    if count == 0:
        return _NO_HASHES
    if count <= _FEW_KEYS and keys.nbytes <= 64 * _FEW_KEYS:
        return np.fromiter((_one_hash(k) for k in keys.to_pylist()), dtype=np.uint32, count=count)
    if pa.types.is_large_binary(keys.type) or pa.types.is_large_string(keys.type):
        offsets = np.frombuffer(keys.buffers()[1], np.int64, count + 1, keys.offset * 8)
    else:
        offsets = np.frombuffer(keys.buffers()[1], np.int32, count + 1, keys.offset * 4)
    offsets = offsets.astype(np.int64)
    data_buffer = keys.buffers()[2]
    data = (
        np.frombuffer(data_buffer, np.uint8)[offsets[0] : offsets[-1]]
        if data_buffer is not None
        else np.zeros(0, np.uint8)
    )
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    with np.errstate(over="ignore"):
        if len(data):
            ends = np.repeat(offsets[1:], lengths)  # each byte's key end
            weights = _powers(int(lengths.max()))[ends - 1 - np.arange(len(data))]
            sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(data * weights)])
            folded = sums[offsets[1:]] - sums[offsets[:-1]]
        else:
            folded = np.zeros(count, np.uint64)
        mixed = _mix(folded ^ (lengths.astype(np.uint64) * _LENGTH_MIX))
    return (mixed & np.uint64(0xFFFFFFFF)).astype(np.uint32)


_FEW_KEYS = 8
_MASK64 = (1 << 64) - 1


def _one_hash(key: bytes | str) -> int:
    """``column_key_hashes`` of one key, in plain Python."""
    data = key.encode() if isinstance(key, str) else key
    s = 0
    for byte in data:
        s = (s * 0x100000001B3 + byte) & _MASK64
    x = s ^ ((len(data) * 0x9E3779B97F4A7C15) & _MASK64)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def key_hash32(key: bytes) -> int:
    """The index hash of one key (``column_key_hashes`` of a one-key column)."""
    return _one_hash(key)


def _is_key_type(column: pa.Array) -> bool:
    return bool(
        pa.types.is_binary(column.type)
        or pa.types.is_string(column.type)
        or pa.types.is_large_binary(column.type)
        or pa.types.is_large_string(column.type)
    )


def _distinct(hashes: np.ndarray) -> np.ndarray:
    """Sorted distinct values (np.unique, at a tenth of its cost on a few thousand uint32)."""
    ordered = np.sort(hashes)
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def batch_key_hashes(batch: bytes | bytearray | memoryview) -> np.ndarray:
    """The distinct 32-bit key hashes of one whole batch's events (sorted ``uint32``): one hash
    per distinct key, none for null keys. Decodes only the key column (``read_keys``); raises
    CorruptBatch for a body that does not decode. A batch without a binary or string ``key``
    column has none."""
    keys = read_keys(batch)
    if keys is None or not _is_key_type(keys):
        return _NO_HASHES
    return _distinct(column_key_hashes(keys))


def batches_key_hashes(
    batches: Sequence[bytes | bytearray | memoryview],
) -> list[bytes | None]:
    """``batch_key_hashes`` of each batch, as bytes (the sorted ``<u4`` array's), for a group
    of batches at once: their key columns are hashed with one vectorised call, so a group of
    small batches costs one numpy pass, not one per batch (about 25 us of fixed numpy cost a
    call, more than hashing a one-event batch). None for a batch whose body does not decode
    (the caller decides: the append path leaves it to finds, which then read it)."""
    out: list[bytes | None] = [b""] * len(batches)
    columns: list[pa.Array] = []
    owners: list[int] = []
    for i, batch in enumerate(batches):
        try:
            keys = read_keys(batch)
        except CorruptBatch:
            out[i] = None
            continue
        if keys is None or not _is_key_type(keys):
            continue
        if keys.null_count:
            keys = keys.drop_null()
        if not len(keys):
            continue
        if not pa.types.is_binary(keys.type):  # a typed stream's string keys: on their own
            out[i] = _distinct(column_key_hashes(keys)).astype("<u4").tobytes()
            continue
        columns.append(keys)
        owners.append(i)
    if not columns:
        return out
    if len(columns) == 1:
        out[owners[0]] = _distinct(column_key_hashes(columns[0])).astype("<u4").tobytes()
        return out
    joined = pa.concat_arrays(columns)
    hashes = column_key_hashes(joined).astype(np.uint64)
    sizes = np.fromiter((len(c) for c in columns), dtype=np.int64, count=len(columns))
    # (owner, hash) as one sortable u64: sorted, deduplicated, then cut at each owner's start
    tagged = _distinct((np.repeat(np.arange(len(columns), dtype=np.uint64), sizes) << 32) | hashes)
    starts = np.searchsorted(tagged >> np.uint64(32), np.arange(len(columns) + 1, dtype=np.uint64))
    low = (tagged & np.uint64(0xFFFFFFFF)).astype("<u4")
    for n, i in enumerate(owners):
        out[i] = low[starts[n] : starts[n + 1]].tobytes()
    return out


def hashes_array(hashes: np.ndarray | bytes) -> np.ndarray:
    """A batch's sorted key hashes as ``uint32``, whether kept as an array or as bytes."""
    if isinstance(hashes, bytes):
        return np.frombuffer(hashes, dtype="<u4")
    return hashes


def batch_holds(hashes: np.ndarray | bytes, key_hash: int) -> bool:
    """Whether a batch's sorted key hashes hold ``key_hash``."""
    array = hashes_array(hashes)
    at = int(np.searchsorted(array, key_hash))
    return at < len(array) and int(array[at]) == key_hash


def build_find_index(headers: Sequence[BatchHeader], hashes: Sequence[np.ndarray | bytes]) -> bytes:
    """The find index of a chunk whose batch index lists batches with ``headers`` (in order);
    ``hashes[i]``: the distinct key hashes of batch i (``batch_key_hashes``, or the bytes of
    ``batches_key_hashes``)."""
    count = len(headers)
    if len(hashes) != count:
        raise ValueError(f"{len(hashes)} hash arrays for {count} batches")
    min_ts = np.fromiter((h.min_timestamp for h in headers), dtype="<i8", count=count)
    max_ts = np.fromiter((h.max_timestamp for h in headers), dtype="<i8", count=count)
    arrays = [hashes_array(h) for h in hashes]
    sizes = np.fromiter((len(h) for h in arrays), dtype=np.int64, count=count)
    keys = np.concatenate(arrays).astype("<u4") if count else np.zeros(0, "<u4")
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
