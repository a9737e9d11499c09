"""Re-splitting a batch that a sealed segment refused over the segments open now (issue 17).

Pure: an Arrow record batch of ``EVENT_SCHEMA`` and the open segments' key ranges in, one
row selection per segment out. The producer calls it for every batch of a segment that a
split or merge sealed (refused, still buffered or still open), oldest first, so each key's
events reach the successor that owns the key in the order they were sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from ..format import numpy_array
from ..protocol import StreamInfo


def open_ranges(info: StreamInfo) -> list[tuple[int, int, int]]:
    """``(segment, key_lo, key_hi)`` of the stream's open segments (they tile the key space)."""
    return [(s.number, s.key_lo, s.key_hi) for s in info.segments if not s.sealed]


class KeyRanges:
    """The open segments by key range, for routing whole columns of keys at once."""

    def __init__(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        ordered = sorted(ranges, key=lambda r: r[1])
        if not ordered:
            raise ValueError("a stream always has at least one open segment")
        self._los = np.array([lo for _, lo, _ in ordered], dtype=np.uint64)
        self._segments = np.array([segment for segment, _, _ in ordered], dtype=np.int64)
        self.segments = tuple(int(s) for s in self._segments)

    def segments_of(self, keys: pa.Array, keyless: int) -> np.ndarray:
        """The segment of each key (its XXH3-64 hash's range, like ``Router.segment_for``);
        a null key (a keyless event) goes to ``keyless``."""
        hash_key = xxhash.xxh3_64_intdigest
        listed: Sequence[bytes | None] = keys.to_pylist()
        hashes = np.fromiter(
            (0 if key is None else hash_key(key) for key in listed),
            dtype=np.uint64,
            count=len(listed),
        )
        out = self._segments[np.searchsorted(self._los, hashes, side="right") - 1]
        if keys.null_count:
            out[np.asarray(keys.is_null())] = keyless
        return out


def resplit(
    record: pa.RecordBatch, ranges: KeyRanges, keyless: int
) -> list[tuple[int, np.ndarray, pa.RecordBatch]]:
    """The rows of ``record`` per open segment: ``(segment, row indexes, those rows)``, by
    segment number. Every row is in exactly one part and each part keeps the rows' order;
    keyless rows (null key) all go to ``keyless``."""
    count = record.num_rows
    if count == 0:
        return []
    segments = ranges.segments_of(record.column(0), keyless)
    parts = []
    for segment in np.unique(segments).tolist():
        rows = np.flatnonzero(segments == segment)
        part = record if len(rows) == count else record.take(numpy_array(rows))
        parts.append((int(segment), rows, part))
    return parts
