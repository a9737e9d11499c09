"""Routing keys to segments (slipstream/streams/_routing.py).

The contract under test: ``split_key_space(n)`` tiles ``0 .. 2**64 - 1`` with ``n`` contiguous,
inclusive, near-equal ranges; a ``Router`` over ranges that tile the key space sends every key
to the segment whose range holds ``key_hash(key)``, the same segment every time; ``key_hash`` is
XXH3-64 with seed 0, pinned by a golden value because stored data depends on it.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.streams import (
    KEY_SPACE,
    MAX_KEY_HASH,
    MAX_SEGMENTS,
    Router,
    key_hash,
    split_key_space,
)

routing_keys = st.binary(max_size=32)


def assert_tiles_the_key_space(ranges: list[tuple[int, int]]) -> None:
    assert ranges[0][0] == 0
    assert ranges[-1][1] == MAX_KEY_HASH
    for (_, hi), (lo, _) in pairwise(ranges):
        assert lo == hi + 1  # no gap, no overlap
    assert all(lo <= hi for lo, hi in ranges)


@settings(max_examples=64)
@given(count=st.integers(1, 64))
def test_split_key_space_tiles_the_key_space(count: int) -> None:
    ranges = split_key_space(count)
    assert len(ranges) == count
    assert_tiles_the_key_space(ranges)
    sizes = [hi - lo + 1 for lo, hi in ranges]
    assert sum(sizes) == KEY_SPACE
    assert max(sizes) - min(sizes) <= 1  # evenly


@pytest.mark.parametrize("count", [1, 2, 3, 7, MAX_SEGMENTS])
def test_split_key_space_tiles_the_key_space_up_to_the_segment_limit(count: int) -> None:
    ranges = split_key_space(count)
    assert len(ranges) == count
    assert_tiles_the_key_space(ranges)


def test_split_key_space_of_one_and_two() -> None:
    assert split_key_space(1) == [(0, 2**64 - 1)]
    assert split_key_space(2) == [(0, 2**63 - 1), (2**63, 2**64 - 1)]


def test_key_hash_is_xxh3_64_with_seed_0() -> None:
    assert key_hash(b"user-42") == 5836184775705692621  # 0x50fe4b21cf7b09cd
    assert key_hash(b"") == 0x2D06800538D394C2  # XXH3-64 of the empty input, seed 0


@settings(max_examples=100)
@given(key=routing_keys)
def test_key_hash_is_an_unsigned_64_bit_integer(key: bytes) -> None:
    assert 0 <= key_hash(key) <= MAX_KEY_HASH
    assert key_hash(key) == key_hash(bytes(key))


@st.composite
def routers(draw: st.DrawFn) -> tuple[Router, dict[int, tuple[int, int]]]:
    """A router over ``n`` ranges, with arbitrary distinct segment numbers given in any order."""
    ranges = split_key_space(draw(st.integers(1, 64)))
    numbers = draw(
        st.lists(st.integers(0, 10_000), min_size=len(ranges), max_size=len(ranges), unique=True)
    )
    segments = dict(zip(numbers, ranges, strict=True))
    listed = draw(st.permutations([(n, lo, hi) for n, (lo, hi) in segments.items()]))
    return Router(listed), segments


@settings(max_examples=100)
@given(router_and_ranges=routers(), keys=st.lists(routing_keys, min_size=1, max_size=20))
def test_router_sends_a_key_to_the_segment_whose_range_holds_its_hash(
    router_and_ranges: tuple[Router, dict[int, tuple[int, int]]], keys: list[bytes]
) -> None:
    router, segments = router_and_ranges
    assert set(router.segments) == set(segments)
    for key in keys:
        segment = router.segment_for(key)
        lo, hi = segments[segment]
        assert lo <= key_hash(key) <= hi
        assert router.segment_for(key) == segment  # same key, same segment


@settings(max_examples=50)
@given(key=routing_keys, count=st.integers(1, 64))
def test_same_key_same_segment_across_router_instances(key: bytes, count: int) -> None:
    ranges = [(i, lo, hi) for i, (lo, hi) in enumerate(split_key_space(count))]
    assert Router(ranges).segment_for(key) == Router(list(reversed(ranges))).segment_for(key)


def test_router_with_one_segment_takes_every_key() -> None:
    router = Router([(5, 0, MAX_KEY_HASH)])
    assert {router.segment_for(b"key-%d" % i) for i in range(100)} == {5}


def test_router_spreads_keys_over_segments() -> None:
    router = Router([(i, lo, hi) for i, (lo, hi) in enumerate(split_key_space(4))])
    hits = [router.segment_for(b"user-%d" % i) for i in range(4000)]
    assert all(800 < hits.count(segment) < 1200 for segment in range(4))
