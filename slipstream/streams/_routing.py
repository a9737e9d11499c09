"""Routing keys to segments: a 64-bit key hash split into contiguous, inclusive key ranges."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

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
