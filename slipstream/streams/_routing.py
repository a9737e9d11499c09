"""Routing keys to segments: a 64-bit key hash split into contiguous, inclusive key ranges."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import xxhash

KEY_SPACE = 1 << 64
MAX_KEY_HASH = KEY_SPACE - 1
MAX_SEGMENTS = 1024


def key_hash(key: bytes) -> int:
    """The stable 64-bit hash of a routing key (XXH3-64, seed 0): the same on every platform and
    in every release, since stored data depends on it."""
    return int(xxhash.xxh3_64_intdigest(key))


def split_key_space(count: int) -> list[tuple[int, int]]:
    """``count`` contiguous inclusive ranges ``(lo, hi)`` covering ``0 .. 2**64 - 1`` evenly."""
    bounds = [KEY_SPACE * i // count for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(count)]


class Router:
    """Maps a key to the open segment whose key range holds its hash.

    ``ranges`` are ``(segment, key_lo, key_hi)`` of the open segments, which tile the key space.
    """

    def __init__(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        ordered = sorted(ranges, key=lambda r: r[1])
        self._los = [lo for _, lo, _ in ordered]
        self._segments = [segment for segment, _, _ in ordered]
        self.segments = tuple(self._segments)

    def segment_for(self, key: bytes) -> int:
        return self._segments[bisect_right(self._los, key_hash(key)) - 1]


def key_hashes(keys: pa.Array) -> np.ndarray:
    """``key_hash`` of every non-null key of a ``binary`` or ``string`` Arrow column (a string
    is hashed as its UTF-8 bytes), in row order (``uint64``); null keys (keyless events) are
    left out. XXH3 has no vectorised path here: one C call per key through ``map`` (measured
    about 50 ns a key with the ``to_pylist``, bench/README.md "What the key-range check
    costs"), no Python bytecode per key."""
    if keys.null_count:
        keys = keys.drop_null()
    if pa.types.is_string(keys.type):
        keys = keys.cast(pa.binary())
    elif pa.types.is_large_string(keys.type):
        keys = keys.cast(pa.large_binary())
    listed: list[bytes] = keys.to_pylist()
    return np.fromiter(map(xxhash.xxh3_64_intdigest, listed), dtype=np.uint64, count=len(listed))


def first_key_outside(keys: pa.Array, key_lo: int, key_hi: int) -> tuple[int, int] | None:
    """``(hash, how many)`` of the keys of ``keys`` whose hash lies outside the inclusive range
    ``[key_lo, key_hi]``: the first such key's hash and their count; None if every key (null
    keys are not checked) hashes inside. Whole-key-space ranges hash nothing."""
    if key_lo == 0 and key_hi == MAX_KEY_HASH:
        return None
    hashes = key_hashes(keys)
    outside = (hashes < np.uint64(key_lo)) | (hashes > np.uint64(key_hi))
    count = int(np.count_nonzero(outside))
    if not count:
        return None
    return int(hashes[int(np.argmax(outside))]), count
