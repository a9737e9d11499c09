"""The broker's check of an append's keys against its segment's key range (Segment.check_keys):
a batch passes iff every keyed event's XXH3-64 key hash lies in the segment's inclusive range
``[key_lo, key_hi]``; keyless events are never checked; a segment owning the whole key space
does not even decode the batch. A refusal names the range, the first key's hash and how many."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import CorruptBatch, KeyOutOfRange
from slipstream.broker._segment import Segment
from slipstream.format import (
    binary_array,
    encode_body,
    encode_header,
    make_record_batch,
    timestamp_array,
)
from slipstream.streams import MAX_KEY_HASH, first_key_outside, key_hash, key_hashes


def keyed_batch(keys: list[bytes | None]) -> bytes:
    count = len(keys)
    record = make_record_batch(
        binary_array(keys),
        binary_array([b"v%d" % i for i in range(count)]),
        timestamp_array(np.arange(count)),
    )
    body = encode_body(record)
    head = encode_header(body, event_count=count, min_timestamp=0, max_timestamp=count - 1)
    return head + body.to_pybytes()


def segment(key_lo: int, key_hi: int) -> Segment:
    return Segment(1, "kr/s", 3, 1, key_lo, key_hi, 0)


KEYS = st.lists(st.one_of(st.none(), st.binary(max_size=12)), min_size=1, max_size=60)
HASHES = st.integers(0, MAX_KEY_HASH)


@settings(max_examples=300, deadline=None)
@given(keys=KEYS, a=HASHES, b=HASHES)
def test_a_batch_passes_iff_every_key_hashes_inside_the_range(
    keys: list[bytes | None], a: int, b: int
) -> None:
    lo, hi = min(a, b), max(a, b)
    outside = [key_hash(k) for k in keys if k is not None and not lo <= key_hash(k) <= hi]
    if (lo, hi) == (0, MAX_KEY_HASH):
        assert not outside
    try:
        segment(lo, hi).check_keys(keyed_batch(keys))
    except KeyOutOfRange as exc:
        assert outside, "refused a batch whose keys are all inside"
        assert exc.details == {
            "stream": "kr/s",
            "segment": 3,
            "key_lo": lo,
            "key_hi": hi,
            "key_hash": outside[0],
            "outside": len(outside),
        }
        assert f"{outside[0]:#018x}" in exc.message and "describe the stream" in exc.message
    else:
        assert not outside, "took a key outside the segment's range"


@settings(max_examples=200, deadline=None)
@given(inside=st.lists(st.binary(max_size=12), min_size=1, max_size=30), data=st.data())
def test_a_range_made_of_the_keys_own_hashes_takes_them_and_refuses_any_other(
    inside: list[bytes], data: st.DataObject
) -> None:
    """The range's ends are the smallest and largest hash of the keys: both ends are inside
    (inclusive), and a key just one past either end is refused."""
    hashes = [key_hash(k) for k in inside]
    lo, hi = min(hashes), max(hashes)
    segment(lo, hi).check_keys(keyed_batch([*inside, None]))
    stranger = data.draw(st.binary(max_size=12).filter(lambda k: not lo <= key_hash(k) <= hi))
    at = data.draw(st.integers(0, len(inside)))
    mixed: list[bytes | None] = [*inside[:at], stranger, *inside[at:]]
    with pytest.raises(KeyOutOfRange) as refused:
        segment(lo, hi).check_keys(keyed_batch(mixed))
    assert refused.value.details["key_hash"] == key_hash(stranger)
    assert refused.value.details["outside"] == 1


@pytest.mark.parametrize("key", [b"", b"a", b"order-17", bytes(range(200))])
def test_the_boundaries_are_inclusive(key: bytes) -> None:
    h = key_hash(key)
    batch = keyed_batch([key])
    segment(h, h).check_keys(batch)
    segment(0, h).check_keys(batch)
    segment(h, MAX_KEY_HASH).check_keys(batch)
    if h < MAX_KEY_HASH:
        with pytest.raises(KeyOutOfRange):
            segment(h + 1, MAX_KEY_HASH).check_keys(batch)
    if h > 0:
        with pytest.raises(KeyOutOfRange):
            segment(0, h - 1).check_keys(batch)


def test_keyless_events_go_to_any_segment() -> None:
    segment(5, 5).check_keys(keyed_batch([None, None, None]))


def test_a_segment_owning_the_whole_key_space_does_not_decode_the_batch() -> None:
    batch = keyed_batch([b"a", b"b"])[:-16]  # a body that does not decode
    segment(0, MAX_KEY_HASH).check_keys(batch)
    with pytest.raises(CorruptBatch):
        segment(0, MAX_KEY_HASH - 1).check_keys(batch)


def test_string_keys_hash_as_their_utf8_bytes() -> None:
    keys = ["", "ä", "key-1", None]
    column = pa.array(keys, pa.string())
    expected = [key_hash(k.encode()) for k in keys if k is not None]
    assert key_hashes(column).tolist() == expected
    assert key_hashes(column.cast(pa.large_string())).tolist() == expected
    h = expected[2]
    assert first_key_outside(column, h, h) == (expected[0], 2)
