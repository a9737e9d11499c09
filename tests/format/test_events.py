"""Events as Arrow columns and back (slipstream/format/_events.py), through a whole batch.

The contract under test: whatever keys (bytes or None), values, headers and timestamps a
producer puts in, a reader gets the same events back, with the segment and consecutive offsets
from the batch's base offset, for every compression; the column builders agree with Arrow's own
converters; ``encode_body_parts`` writes the event-message form (one record batch message,
all-null key and headers columns left out, compressed only where it pays) and both body forms
read back as the same record batch; a body with another schema is refused with
:class:`CorruptBatch`.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import CorruptBatch
from slipstream.format import (
    BODY_FLAGS,
    COMPRESSED_AT_MOST,
    COMPRESSIONS,
    EVENT_SCHEMA,
    FLAG_EVENT_MESSAGE,
    FLAG_NO_HEADERS,
    FLAG_NO_KEYS,
    HEADER_TYPE,
    TIMESTAMP_TYPE,
    Event,
    binary_array,
    check_event_schema,
    decode_header,
    encode_body,
    encode_body_parts,
    encode_header,
    events_of,
    headers_array,
    make_record_batch,
    null_headers,
    read_body,
    set_base_offset,
    timestamp_array,
    to_json_value,
    verify,
)

I64 = st.integers(-(2**63), 2**63 - 1)

keys = st.none() | st.binary(max_size=24)
values = st.binary(max_size=64)
headers = st.dictionaries(st.text(max_size=8), st.binary(max_size=8), max_size=3)


class Sent(msgspec.Struct, frozen=True):
    """One event as a producer hands it over."""

    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes]
    timestamp: int


sent_events = st.builds(Sent, key=keys, value=values, headers=headers, timestamp=I64)


def record_batch_of(events: list[Sent]) -> pa.RecordBatch:
    return make_record_batch(
        binary_array([e.key for e in events]),
        binary_array([e.value for e in events]),
        timestamp_array([e.timestamp for e in events]),
        headers_array([e.headers for e in events]),
    )


@settings(max_examples=25, deadline=None)
@given(
    events=st.lists(sent_events, min_size=1, max_size=12),
    big=st.integers(64 * 1024, 300 * 1024),
    start=st.integers(0, 3),
)
def test_a_large_batch_goes_out_by_reference_as_one_record_batch_message(
    events: list[Sent], big: int, start: int
) -> None:
    """From 64 KiB on, the body's Arrow buffers are handed over as they are, not copied into
    one message first: the joined parts must still be exactly the record batch message of the
    stored columns, for a sliced batch (as ``send_many`` makes) too."""
    large = [*events, Sent(b"k", b"v" * big, {}, 0)]
    whole = record_batch_of(large)
    for record in (whole, whole.slice(min(start, len(events)))):
        parts = encode_body_parts(record)
        assert parts.flags & FLAG_EVENT_MESSAGE
        joined = b"".join(memoryview(p) for p in parts)
        assert joined == stored_message(record, parts.flags)
        assert read_body(whole_batch(parts, len(record))).equals(record)
    data = whole.column(1).buffers()[2]
    parts = encode_body_parts(whole)
    assert any(isinstance(p, pa.Buffer) and p.address == data.address for p in parts)


def stored_message(record: pa.RecordBatch, flags: int) -> bytes:
    """The one Arrow record batch message an event message body must be: the columns the
    flags do not leave out, and nothing else (no schema message, no end marker)."""
    kept = [
        (name, column)
        for name, column in zip(record.schema.names, record.columns, strict=True)
        if not (name == "key" and flags & FLAG_NO_KEYS)
        and not (name == "headers" and flags & FLAG_NO_HEADERS)
    ]
    stored = pa.RecordBatch.from_arrays([c for _, c in kept], names=[n for n, _ in kept])
    return bytes(stored.serialize().to_pybytes())


def whole_batch(parts: list[pa.Buffer | bytes], count: int, first_timestamp: int = 0) -> bytearray:
    head = encode_header(
        parts, event_count=count, min_timestamp=first_timestamp, max_timestamp=first_timestamp
    )
    return bytearray(head + b"".join(memoryview(part) for part in parts))


def encode_batch(events: list[Sent], compression: str | None, in_parts: bool = False) -> bytearray:
    """A whole batch; ``in_parts`` builds the body as buffers sent back to back, as the
    producer does."""
    record = record_batch_of(events)
    parts = (
        encode_body_parts(record, compression) if in_parts else [encode_body(record, compression)]
    )
    timestamps = [e.timestamp for e in events]
    head = encode_header(
        parts, event_count=len(events), min_timestamp=min(timestamps), max_timestamp=max(timestamps)
    )
    return bytearray(head + b"".join(memoryview(part) for part in parts))


@settings(max_examples=75, deadline=None)
@given(
    events=st.lists(sent_events, min_size=1, max_size=20),
    compression=st.sampled_from([None, *COMPRESSIONS]),
    in_parts=st.booleans(),
    segment=st.integers(0, 2**31),
    base_offset=st.integers(0, 2**62),
)
def test_events_round_trip_through_a_whole_batch(
    events: list[Sent], compression: str | None, in_parts: bool, segment: int, base_offset: int
) -> None:
    batch = encode_batch(events, compression, in_parts)
    set_base_offset(batch, base_offset)

    header = verify(batch)
    record = read_body(batch)
    check_event_schema(record)
    received = list(events_of(record, segment, header.base_offset))

    assert header.event_count == len(events)
    assert header.min_timestamp == min(e.timestamp for e in events)
    assert header.max_timestamp == max(e.timestamp for e in events)
    assert received == [
        Event(e.key, e.value, e.headers, e.timestamp, segment, base_offset + i)
        for i, e in enumerate(events)
    ]
    assert all(isinstance(event.value, bytes) for event in received)


@settings(max_examples=50, deadline=None)
@given(
    events=st.lists(sent_events, min_size=1, max_size=10),
    compression=st.sampled_from([None, *COMPRESSIONS]),
)
def test_both_body_forms_read_back_as_the_same_record_batch(
    events: list[Sent], compression: str | None
) -> None:
    record = record_batch_of(events)
    message = encode_batch(events, compression, in_parts=True)
    stream = encode_batch(events, compression, in_parts=False)
    assert decode_header(message).flags & FLAG_EVENT_MESSAGE
    assert not decode_header(stream).flags & BODY_FLAGS
    assert read_body(message).equals(record)
    assert read_body(stream).equals(record)
    assert len(message) < len(stream)


@pytest.mark.parametrize(
    ("keys", "headers", "flags"),
    [
        ([None, None], [None, None], FLAG_EVENT_MESSAGE | FLAG_NO_KEYS | FLAG_NO_HEADERS),
        ([b"k", None], [None, None], FLAG_EVENT_MESSAGE | FLAG_NO_HEADERS),
        ([None, None], [{"h": b"1"}, None], FLAG_EVENT_MESSAGE | FLAG_NO_KEYS),
        ([b"k", b""], [None, {"h": b"1"}], FLAG_EVENT_MESSAGE),
    ],
)
def test_an_event_message_leaves_out_only_all_null_columns(
    keys: list[bytes | None], headers: list[dict[str, bytes] | None], flags: int
) -> None:
    record = make_record_batch(
        binary_array(keys),
        binary_array([b"a", b"b"]),
        timestamp_array([1, 2]),
        headers_array(headers),
    )
    parts = encode_body_parts(record)
    assert parts.flags == flags
    assert b"".join(memoryview(p) for p in parts) == stored_message(record, flags)
    batch = whole_batch(parts, 2)
    assert decode_header(batch).flags == flags  # encode_header took the flags from the parts
    assert read_body(batch).equals(record)


def json_ish(count: int) -> list[bytes]:
    return [
        b'{"id":%d,"user":"u%d","event":"%s","amount":%d.%02d}'
        % (1000 + i, i * 7919 % 5000, [b"click", b"view", b"buy"][i % 3], i % 500, i % 100)
        for i in range(count)
    ]


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("count", [40, 5000])  # under and over the 64 KiB sample
def test_a_compressible_batch_is_compressed_and_reads_back(compression: str, count: int) -> None:
    values = json_ish(count)
    record = make_record_batch(
        binary_array([None] * count), binary_array(values), timestamp_array(range(count))
    )
    parts = encode_body_parts(record, compression)
    plain = encode_body_parts(record)
    size = sum(len(p) for p in parts)
    assert size <= COMPRESSED_AT_MOST * sum(len(p) for p in plain)
    batch = whole_batch(parts, count)
    back = read_body(batch)
    assert back.equals(record)
    assert [e.value for e in events_of(back, 0, 0)] == values


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("count", [1, 5, 40, 5000])
def test_a_batch_that_compression_does_not_shrink_by_a_fifth_goes_plain(
    compression: str, count: int
) -> None:
    """Random bytes (only offsets and timestamps compress), and tiny batches (the codec's
    framing outweighs what it saves) are sent uncompressed: the very bytes of no compression."""
    rng = np.random.default_rng(count)
    values = [rng.bytes(100) for _ in range(count)]
    record = make_record_batch(
        binary_array([None] * count), binary_array(values), timestamp_array(range(count))
    )
    tiny = make_record_batch(binary_array([None]), binary_array([b"x" * 30]), timestamp_array([1]))
    for batch in (record, tiny):
        parts = encode_body_parts(batch, compression)
        plain = encode_body_parts(batch)
        assert b"".join(memoryview(p) for p in parts) == b"".join(memoryview(p) for p in plain)


def test_encode_body_parts_of_another_schema_is_one_whole_body() -> None:
    other = pa.RecordBatch.from_pydict({"value": pa.array([b"v"], pa.binary())})
    parts = encode_body_parts(other)
    [part] = parts
    assert parts.flags == 0
    assert bytes(memoryview(part)) == encode_body(other).to_pybytes()


def test_an_all_null_headers_column_costs_no_offsets_in_its_children() -> None:
    """``pa.nulls`` gave each child of the null list ``count + 1`` offsets: 8 bytes an event
    in every body that carried the column."""
    column = null_headers(1000)
    column.validate(full=True)
    assert column.null_count == 1000
    one_column = pa.RecordBatch.from_arrays([column], names=["headers"])
    assert one_column.serialize().size < 1000 // 8 + 4 * 1001 + 1000
    assert column.to_pylist() == [None] * 1000


def test_events_without_headers_read_back_as_empty_mappings() -> None:
    record = read_body(encode_batch([Sent(b"k", b"v", {}, 7)], None))
    assert record.column(3).null_count == 1  # no headers cost one null, not an empty list
    [event] = events_of(record, 3, 10)
    assert event == Event(b"k", b"v", {}, 7, 3, 10)
    assert dict(event.headers) == {}


def test_make_record_batch_without_headers_has_a_null_headers_column() -> None:
    record = make_record_batch(binary_array([b"k"]), binary_array([b"v"]), timestamp_array([7]))
    assert record.column(3).type == HEADER_TYPE
    assert record.column(3).null_count == 1


def test_events_of_an_empty_record_batch_is_empty() -> None:
    empty = make_record_batch(binary_array([]), binary_array([]), timestamp_array([]))
    assert list(events_of(empty, 0, 0)) == []


@settings(max_examples=100)
@given(items=st.lists(st.none() | st.binary(max_size=16), max_size=20))
def test_binary_array_matches_arrows_own_converter(items: list[bytes | None]) -> None:
    built = binary_array(items)
    built.validate(full=True)
    assert built.type == pa.binary()
    assert built.equals(pa.array(items, pa.binary()))


@settings(max_examples=100)
@given(rows=st.lists(st.none() | headers, max_size=10))
def test_headers_array_keeps_every_header(rows: list[dict[str, bytes] | None]) -> None:
    built = headers_array(rows)
    built.validate(full=True)
    assert built.type == HEADER_TYPE
    assert [
        {item["key"]: item["value"] for item in row} if row else {} for row in built.to_pylist()
    ] == [row or {} for row in rows]


def test_headers_array_of_only_empty_headers_is_all_null() -> None:
    built = headers_array([{}, None, {}])
    assert built.type == HEADER_TYPE
    assert built.null_count == 3
    # and without offsets in its children (null_headers): serialised, one bitmap and the list's
    # offsets (pa.nulls gave each of the three children 4,004 bytes of offsets too)
    many = pa.RecordBatch.from_arrays([headers_array([None] * 1000)], names=["headers"])
    assert many.serialize().size < 1000 // 8 + 4 * 1001 + 1000


@settings(max_examples=50)
@given(timestamps=st.lists(I64, max_size=10))
def test_timestamp_array_holds_milliseconds_since_the_epoch(timestamps: list[int]) -> None:
    built = timestamp_array(timestamps)
    assert built.type == TIMESTAMP_TYPE
    assert built.view(pa.int64()).to_pylist() == timestamps


@pytest.mark.parametrize(
    "timestamps",
    [
        np.arange(10, dtype=np.int64)[::2],  # not contiguous
        np.arange(5, dtype=np.int32),  # not int64
        np.array([], dtype=np.int64),
        [2**63 - 1, -(2**63)],
    ],
    ids=["strided", "int32", "empty", "int64-bounds"],
)
def test_timestamp_array_from_numpy_and_lists(timestamps: np.ndarray | list[int]) -> None:
    built = timestamp_array(timestamps)
    built.validate(full=True)
    assert built.view(pa.int64()).to_pylist() == [int(t) for t in timestamps]


def test_make_record_batch_has_the_event_schema() -> None:
    record = make_record_batch(binary_array([None]), binary_array([b"v"]), timestamp_array([1]))
    assert record.schema.equals(EVENT_SCHEMA)
    check_event_schema(record)


def test_check_event_schema_refuses_another_schema() -> None:
    other = pa.RecordBatch.from_pydict({"value": pa.array([b"v"], pa.binary())})
    with pytest.raises(CorruptBatch, match="schema"):
        check_event_schema(other)


def test_encode_body_refuses_an_unknown_compression() -> None:
    record = make_record_batch(binary_array([b"k"]), binary_array([b"v"]), timestamp_array([1]))
    with pytest.raises(ValueError, match="compression must be one of"):
        encode_body(record, "gzip")


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_compression_shrinks_a_repetitive_body(compression: str) -> None:
    record = make_record_batch(
        binary_array([None] * 100), binary_array([b"x" * 1000] * 100), timestamp_array([1] * 100)
    )
    assert COMPRESSIONS == ("lz4", "zstd")
    assert len(encode_body(record, compression)) < len(encode_body(record)) // 10


def test_event_is_a_frozen_value() -> None:
    event = Event(b"k", b"v", {}, 1, 0, 0)
    with pytest.raises(AttributeError):
        event.offset = 1  # type: ignore[misc]
    assert event == Event(b"k", b"v", {}, 1, 0, 0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'{"a": [1, 2]}', {"a": [1, 2]}),
        (b"42", 42),
        (b"plain text", "plain text"),
        ("caf\u00e9".encode(), "caf\u00e9"),
        (b"\xff\xfe", None),
        (b"", ""),
    ],
)
def test_to_json_value_prefers_json_then_text(value: bytes, expected: object) -> None:
    assert to_json_value(value) == expected
