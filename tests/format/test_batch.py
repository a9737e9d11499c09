"""The record batch header and its checks (slipstream/format/_batch.py).

The contract under test: ``encode_header`` lays out the 64 bytes exactly as the comment block at
the top of _batch.py says; ``verify`` accepts a whole, undamaged batch and raises
:class:`CorruptBatch` for anything else, in particular for any single flipped bit in the CRC'd
range [24, end) and in ``batch_length`` and the CRC field [16, 24); ``set_base_offset`` patches
bytes 8..16 without invalidating the CRC; ``iter_batches`` splits back-to-back batches; and every
decoding entry point either decodes or raises :class:`CorruptBatch`, whatever bytes it is given.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import CorruptBatch
from slipstream.format import (
    BODY_FLAGS,
    FLAG_CONTROL,
    FLAG_EVENT_MESSAGE,
    FLAG_NO_HEADERS,
    FLAG_NO_KEYS,
    FLAG_TRANSACTIONAL,
    HEADER_LENGTH,
    MAGIC,
    VERSION,
    BatchHeader,
    Event,
    binary_array,
    decode_header,
    encode_body,
    encode_body_parts,
    encode_header,
    events_of,
    iter_batches,
    make_record_batch,
    read_body,
    restamp,
    set_base_offset,
    timestamp_array,
    verify,
)

I64 = st.integers(-(2**63), 2**63 - 1)
BASE_OFFSETS = st.integers(0, 2**63 - 1)
COMPRESSION = st.sampled_from([None, "lz4", "zstd"])

# Bytes 8..16 hold base_offset: outside the CRC by design, so the broker can patch it in place.
BASE_OFFSET_BYTES = range(8, 16)


def build_batch(
    values: list[bytes],
    compression: str | None = None,
    first_timestamp: int = 1_700_000_000_000,
    form: str = "stream",
    keyed: bool = True,
) -> bytearray:
    """A real batch: header + Arrow IPC body of one event per value, keyed by position (or
    keyless); ``form`` "stream" is a whole IPC stream (``encode_body``), "message" the event
    message the producer writes (``encode_body_parts``)."""
    keys = [b"key-%d" % i if keyed else None for i in range(len(values))]
    timestamps = [first_timestamp + i for i in range(len(values))]
    record = make_record_batch(
        binary_array(keys), binary_array(values), timestamp_array(timestamps)
    )
    parts = (
        encode_body_parts(record, compression)
        if form == "message"
        else [encode_body(record, compression)]
    )
    head = encode_header(
        parts,
        event_count=len(values),
        min_timestamp=timestamps[0],
        max_timestamp=timestamps[-1],
    )
    return bytearray(head + b"".join(memoryview(part) for part in parts))


@st.composite
def batches(draw: st.DrawFn) -> bytearray:
    values = draw(st.lists(st.binary(max_size=40), min_size=1, max_size=6))
    form = draw(st.sampled_from(["stream", "message"]))
    return build_batch(
        values, draw(COMPRESSION), draw(st.integers(0, 2**40)), form, draw(st.booleans())
    )


def flip_bit(buf: bytes | bytearray, bit: int) -> bytearray:
    flipped = bytearray(buf)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return flipped


# --- the golden header ------------------------------------------------------------------------

GOLDEN_BODY = b"arrow-body"  # encode_header does not parse the body; any bytes will do
# Derived by hand from the layout in _batch.py (little-endian):
#   0   magic           b"SLB1"               534c4231
#   4   version         1                     01
#   5   reserved        0                     00
#   6   header_length   64                    4000
#   8   base_offset     0x0102030405060708    0807060504030201
#   16  batch_length    74 = 64 + 10          4a000000
#   20  crc32c          0xd5e5d7b5            b5d7e5d5  (CRC32C of header[24:64] + GOLDEN_BODY)
#   24  flags           transactional         0100
#   26  producer_epoch  7                     0700
#   28  event_count     3                     03000000
#   32  min_timestamp   1_700_000_000_000     0068e5cf8b010000
#   40  max_timestamp   1_700_000_000_500     f469e5cf8b010000
#   48  producer_id     0x1122334455667788    8877665544332211
#   56  sequence        -2                    feffffff
#   60  reserved        0                     00000000
GOLDEN_HEADER = bytes.fromhex(
    "534c4231 01 00 4000 0807060504030201"
    "4a000000 b5d7e5d5 0100 0700 03000000"
    "0068e5cf8b010000 f469e5cf8b010000"
    "8877665544332211 feffffff 00000000"
)
GOLDEN_FIELDS = BatchHeader(
    base_offset=0x0102030405060708,
    batch_length=74,
    crc=0xD5E5D7B5,
    flags=FLAG_TRANSACTIONAL,
    producer_epoch=7,
    event_count=3,
    min_timestamp=1_700_000_000_000,
    max_timestamp=1_700_000_000_500,
    producer_id=0x1122334455667788,
    sequence=-2,
)


def test_encode_header_writes_the_documented_golden_bytes() -> None:
    head = encode_header(
        GOLDEN_BODY,
        event_count=3,
        min_timestamp=1_700_000_000_000,
        max_timestamp=1_700_000_000_500,
        base_offset=0x0102030405060708,
        flags=FLAG_TRANSACTIONAL,
        producer_id=0x1122334455667788,
        producer_epoch=7,
        sequence=-2,
    )
    assert head.hex() == GOLDEN_HEADER.hex()


def test_golden_bytes_decode_and_verify() -> None:
    assert decode_header(GOLDEN_HEADER) == GOLDEN_FIELDS
    assert verify(GOLDEN_HEADER + GOLDEN_BODY) == GOLDEN_FIELDS
    assert GOLDEN_FIELDS.next_offset == 0x0102030405060708 + 3


def test_golden_constants_match_the_layout() -> None:
    assert (MAGIC, VERSION, HEADER_LENGTH) == (b"SLB1", 1, 64)
    assert (FLAG_TRANSACTIONAL, FLAG_CONTROL) == (0x1, 0x2)
    assert (FLAG_EVENT_MESSAGE, FLAG_NO_KEYS, FLAG_NO_HEADERS) == (0x4, 0x8, 0x10)
    assert BODY_FLAGS == 0x1C


GOLDEN = Path(__file__).parent / "golden"


def golden(name: str) -> bytearray:
    return bytearray.fromhex((GOLDEN / name).read_text())


def test_the_documented_event_message_batch_is_what_the_producer_path_writes() -> None:
    """docs/format.md's worked example, byte for byte: one event (key ``user-42``, value
    ``hello``, no headers) as an event message without a headers column. The body bytes come
    from pyarrow's IPC writer: a pyarrow upgrade that changes them fails here, and the docs'
    example must then be regenerated (stored batches stay readable: the next test)."""
    record = make_record_batch(
        binary_array([b"user-42"]), binary_array([b"hello"]), timestamp_array([1763798400000])
    )
    for compression in (None, "lz4"):  # the docs' example asks for lz4: one event goes plain
        parts = encode_body_parts(record, compression)
        head = encode_header(
            parts, event_count=1, min_timestamp=1763798400000, max_timestamp=1763798400000
        )
        assert head + b"".join(memoryview(p) for p in parts) == golden("event_message.hex")


DOCS = Path(__file__).parents[2] / "docs" / "format.md"


def test_docs_format_page_quotes_the_byte_layout_and_the_golden_batch() -> None:
    """docs/format.md and the comment block of _batch.py say the same, and the page's hex dump
    of the worked example is the golden batch."""
    import slipstream.format._batch as batch_module

    docs = DOCS.read_text()
    source = Path(batch_module.__file__).read_text()
    block = source[source.index("Byte layout, version 1") : source.index('"""\n\nfrom')].rstrip()
    assert block in docs
    dump = [line[6:] for line in docs.splitlines() if line[:4].isalnum() and line[4:6] == "  "]
    assert bytes.fromhex(" ".join(dump)) == golden("event_message.hex")


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("event_message.hex", FLAG_EVENT_MESSAGE | FLAG_NO_HEADERS),
        ("stream_form_0.1.0.hex", 0),  # written by slipstream 0.1.0, before event messages
        ("stream_form_lz4_0.1.0.hex", 0),
    ],
)
def test_golden_batches_of_both_body_forms_decode(name: str, flags: int) -> None:
    batch = golden(name)
    header = verify(batch)
    assert header.flags == flags
    [event] = events_of(read_body(batch), 5, header.base_offset)
    if name == "event_message.hex":
        assert event == Event(b"user-42", b"hello", {}, 1763798400000, 5, 0)
    elif name == "stream_form_0.1.0.hex":
        assert event == Event(b"user-42", b"hello", {}, 1763798400000, 5, 42)
    else:
        assert (event.key, event.value, dict(event.headers), event.offset) == (
            None,
            b'{"id":1,"event":"click"}',
            {"trace": b"abc"},
            42,
        )


def test_restamp_keeps_the_body_form_flags() -> None:
    """The broker restamps a committed transaction's batches with the transactional flag; the
    body-form flags describe the body, so they must survive it."""
    batch = build_batch([b"a", b"b"], form="message", keyed=False)
    before = read_body(batch)
    restamp(batch, flags=FLAG_TRANSACTIONAL, producer_id=9, producer_epoch=1, sequence=4)
    header = verify(batch)
    assert header.flags == FLAG_TRANSACTIONAL | FLAG_EVENT_MESSAGE | FLAG_NO_KEYS | FLAG_NO_HEADERS
    assert (header.producer_id, header.producer_epoch, header.sequence) == (9, 1, 4)
    assert read_body(batch).equals(before)


@pytest.mark.parametrize("form", ["stream", "message"])
def test_read_body_refuses_a_body_with_another_event_count_than_its_header(form: str) -> None:
    batch = build_batch([b"a", b"b"], form=form)
    struct.pack_into("<I", batch, 28, 3)
    with pytest.raises(CorruptBatch, match="holds 2 events, its header says 3"):
        read_body(batch)


def test_read_body_refuses_an_event_message_with_bytes_after_it() -> None:
    batch = build_batch([b"a"], form="message") + b"\0" * 8
    struct.pack_into("<I", batch, 16, len(batch))
    with pytest.raises(CorruptBatch, match="8 bytes after the event message"):
        read_body(batch)


def test_read_body_refuses_a_stream_body_flagged_as_an_event_message() -> None:
    batch = build_batch([b"a"], form="stream")
    struct.pack_into("<H", batch, 24, FLAG_EVENT_MESSAGE)
    with pytest.raises(CorruptBatch, match="schema message"):
        read_body(batch)


def test_header_defaults_mark_a_producer_that_is_not_idempotent() -> None:
    header = decode_header(encode_header(b"", event_count=1, min_timestamp=5, max_timestamp=9))
    assert header == BatchHeader(
        base_offset=0,
        batch_length=HEADER_LENGTH,
        crc=header.crc,
        flags=0,
        producer_epoch=-1,
        event_count=1,
        min_timestamp=5,
        max_timestamp=9,
        producer_id=-1,
        sequence=-1,
    )


@settings(max_examples=100)
@given(
    body=st.binary(max_size=200),
    event_count=st.integers(1, 2**32 - 1),
    min_timestamp=I64,
    max_timestamp=I64,
    base_offset=BASE_OFFSETS,
    flags=st.sampled_from([0, FLAG_TRANSACTIONAL, FLAG_CONTROL, FLAG_TRANSACTIONAL | FLAG_CONTROL]),
    producer_id=I64,
    producer_epoch=st.integers(-(2**15), 2**15 - 1),
    sequence=st.integers(-(2**31), 2**31 - 1),
)
def test_every_header_field_round_trips(
    body: bytes,
    event_count: int,
    min_timestamp: int,
    max_timestamp: int,
    base_offset: int,
    flags: int,
    producer_id: int,
    producer_epoch: int,
    sequence: int,
) -> None:
    head = encode_header(
        body,
        event_count=event_count,
        min_timestamp=min_timestamp,
        max_timestamp=max_timestamp,
        base_offset=base_offset,
        flags=flags,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        sequence=sequence,
    )
    header = verify(head + body)
    assert len(head) == HEADER_LENGTH
    assert (header.base_offset, header.batch_length, header.flags) == (
        base_offset,
        HEADER_LENGTH + len(body),
        flags,
    )
    assert (header.event_count, header.min_timestamp, header.max_timestamp) == (
        event_count,
        min_timestamp,
        max_timestamp,
    )
    assert (header.producer_id, header.producer_epoch, header.sequence) == (
        producer_id,
        producer_epoch,
        sequence,
    )


@settings(max_examples=50)
@given(parts=st.lists(st.binary(max_size=50), max_size=5), as_tuple=st.booleans())
def test_encode_header_over_body_parts_equals_over_the_joined_body(
    parts: list[bytes], as_tuple: bool
) -> None:
    fields = {"event_count": 1, "min_timestamp": 3, "max_timestamp": 4}
    head = encode_header(tuple(parts) if as_tuple else parts, **fields)
    assert head == encode_header(b"".join(parts), **fields)
    verify(head + b"".join(parts))


def test_encode_header_refuses_a_batch_over_4_gib() -> None:
    # Zero-stride views claim gigabytes without allocating them.
    huge = np.broadcast_to(np.zeros(1, dtype=np.uint8), (2**32,))
    half = np.broadcast_to(np.zeros(1, dtype=np.uint8), (2**31,))
    with pytest.raises(CorruptBatch, match="4 GiB"):
        encode_header(huge, event_count=1, min_timestamp=0, max_timestamp=0)
    with pytest.raises(CorruptBatch, match="4 GiB"):
        encode_header([half, half], event_count=1, min_timestamp=0, max_timestamp=0)


# --- header sanity checks ---------------------------------------------------------------------


def patched(buf: bytes, fmt: str, at: int, value: int | bytes) -> bytearray:
    out = bytearray(buf)
    struct.pack_into(fmt, out, at, value)
    return out


VALID_HEADER = encode_header(b"body", event_count=2, min_timestamp=1, max_timestamp=2)


@pytest.mark.parametrize(
    ("damaged", "message"),
    [
        (patched(VALID_HEADER, "<4s", 0, b"SLB2"), "magic"),
        (patched(VALID_HEADER, "<B", 4, 2), "version"),
        (patched(VALID_HEADER, "<H", 6, 65), "lengths"),
        (patched(VALID_HEADER, "<H", 6, 0), "lengths"),
        (patched(VALID_HEADER, "<I", 16, HEADER_LENGTH - 1), "lengths"),
        (patched(VALID_HEADER, "<H", 24, 0x20), "flags"),
        (patched(VALID_HEADER, "<H", 24, 0x8), "columns left out"),
        (patched(VALID_HEADER, "<H", 24, 0x10), "columns left out"),
        (patched(VALID_HEADER, "<H", 24, 0x8000), "flags"),
        (patched(VALID_HEADER, "<I", 28, 0), "zero events"),
        (patched(VALID_HEADER, "<q", 8, -1), "negative base offset"),
        (VALID_HEADER[: HEADER_LENGTH - 1], "needs 64 bytes"),
        (b"", "needs 64 bytes"),
    ],
    ids=[
        "magic",
        "version",
        "header-length-65",
        "header-length-0",
        "batch-length-63",
        "unknown-flag-bit-5",
        "no-keys-without-event-message",
        "no-headers-without-event-message",
        "unknown-flag-bit-15",
        "zero-events",
        "negative-base-offset",
        "short-by-one",
        "empty",
    ],
)
def test_decode_header_refuses_insane_headers(damaged: bytes, message: str) -> None:
    with pytest.raises(CorruptBatch, match=message):
        decode_header(damaged)
    with pytest.raises(CorruptBatch, match=message):
        verify(damaged)


def test_decode_header_reads_at_an_offset() -> None:
    buf = b"\x00" * 7 + VALID_HEADER + b"body"
    assert decode_header(buf, 7) == decode_header(VALID_HEADER)
    assert verify(buf, 7) == decode_header(VALID_HEADER)
    with pytest.raises(CorruptBatch, match="needs 64 bytes"):
        decode_header(buf, 8 + 4)


# --- corruption -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(batch=batches(), data=st.data())
def test_verify_detects_any_single_bit_flip_from_byte_16(
    batch: bytearray, data: st.DataObject
) -> None:
    bit = data.draw(st.integers(16 * 8, len(batch) * 8 - 1), label="bit")
    with pytest.raises(CorruptBatch):
        verify(flip_bit(batch, bit))


def test_verify_detects_every_single_bit_flip_of_one_batch() -> None:
    batch = build_batch([b"hello", b"", b"world"], "lz4")
    verify(batch)
    missed = []
    for bit in range(len(batch) * 8):
        if bit // 8 in BASE_OFFSET_BYTES or bit // 8 == 5:
            continue
        try:
            verify(flip_bit(batch, bit))
        except CorruptBatch:
            continue
        missed.append(bit)
    assert missed == []


def test_verify_detects_the_sign_bit_of_base_offset() -> None:
    batch = build_batch([b"v"])
    with pytest.raises(CorruptBatch, match="negative base offset"):
        verify(flip_bit(batch, 15 * 8 + 7))


def test_verify_detects_a_flip_in_reserved_byte_5() -> None:
    batch = build_batch([b"v"])
    undetected = []
    for bit in range(5 * 8, 6 * 8):
        try:
            verify(flip_bit(batch, bit))
        except CorruptBatch:
            continue
        undetected.append(bit)
    assert undetected == []


@settings(max_examples=50, deadline=None)
@given(batch=batches(), data=st.data())
def test_verify_detects_truncation(batch: bytearray, data: st.DataObject) -> None:
    length = data.draw(st.integers(0, len(batch) - 1), label="length")
    with pytest.raises(CorruptBatch):
        verify(batch[:length])
    if length == 0:  # no bytes are no batches, not a truncated one
        return
    with pytest.raises(CorruptBatch):
        list(iter_batches(batch[:length]))
    with pytest.raises(CorruptBatch):
        list(iter_batches(batch[:length], check_crc=False))


def test_verify_checks_only_the_batch_not_what_follows() -> None:
    batch = build_batch([b"v"])
    assert verify(batch + b"trailing bytes") == verify(batch)


# --- base offset ------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(batch=batches(), base_offset=BASE_OFFSETS)
def test_set_base_offset_keeps_the_crc_valid(batch: bytearray, base_offset: int) -> None:
    before = bytes(batch)
    set_base_offset(batch, base_offset)
    header = verify(batch)
    assert header.base_offset == base_offset
    assert header.crc == decode_header(before).crc
    assert batch[:8] == before[:8] and batch[16:] == before[16:]


def test_set_base_offset_patches_the_batch_at_an_offset_in_a_larger_buffer() -> None:
    first, second = build_batch([b"a", b"b"]), build_batch([b"c"])
    buf = bytearray(first + second)
    set_base_offset(buf, 10)
    set_base_offset(buf, 12, at=len(first))
    view = memoryview(buf)
    set_base_offset(view, 11)  # a writable memoryview works the same
    assert [h.base_offset for h, _ in iter_batches(buf)] == [11, 12]


# --- splitting ---------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(parts=st.lists(batches(), min_size=0, max_size=4))
def test_iter_batches_splits_back_to_back_batches(parts: list[bytearray]) -> None:
    buf = b"".join(parts)
    found = list(iter_batches(buf))
    assert [bytes(view) for _, view in found] == [bytes(p) for p in parts]
    headers = [verify(p) for p in parts]
    assert [header for header, _ in found] == headers
    assert [header for header, _ in iter_batches(buf, check_crc=False)] == headers


def test_iter_batches_yields_views_without_copying() -> None:
    buf = bytearray(build_batch([b"a"]) + build_batch([b"b"]))
    views = [view for _, view in iter_batches(buf)]
    buf[HEADER_LENGTH] ^= 0xFF  # a change to the buffer shows through the view
    assert views[0][HEADER_LENGTH] == buf[HEADER_LENGTH]


def test_iter_batches_refuses_trailing_garbage_and_bad_crc() -> None:
    batch = build_batch([b"v"])
    with pytest.raises(CorruptBatch, match="needs 64 bytes"):
        list(iter_batches(batch + b"junk"))
    damaged = flip_bit(batch, len(batch) * 8 - 1)
    with pytest.raises(CorruptBatch, match="CRC32C mismatch"):
        list(iter_batches(damaged))
    assert len(list(iter_batches(damaged, check_crc=False))) == 1


# --- the body -----------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["stream", "message"])
@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_read_body_decodes_the_arrow_body(compression: str | None, form: str) -> None:
    record = read_body(build_batch([b"a", b"bc"], compression, form=form))
    assert record.num_rows == 2
    assert record.column(1).to_pylist() == [b"a", b"bc"]


# --- fuzz: decode or raise CorruptBatch, never anything else ----------------------------------


def decode_everything(buf: bytes | bytearray) -> None:
    """Run every decoding entry point on ``buf``; each must decode or raise CorruptBatch."""
    entry_points = [
        decode_header,
        verify,
        lambda b: list(iter_batches(b)),
        lambda b: list(iter_batches(b, check_crc=False)),
        read_body,
    ]
    for decode in entry_points:
        with contextlib.suppress(CorruptBatch):
            decode(buf)


@st.composite
def damaged_batches(draw: st.DrawFn) -> bytearray:
    """A real batch with a few random bytes overwritten and maybe cut short or extended."""
    batch = draw(batches())
    for _ in range(draw(st.integers(1, 4))):
        batch[draw(st.integers(0, len(batch) - 1))] = draw(st.integers(0, 255))
    return batch[: draw(st.integers(0, len(batch)))] + draw(st.binary(max_size=80))


@settings(max_examples=300, deadline=None)
@given(
    buf=st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda tail: VALID_HEADER + tail),
        st.binary(max_size=300).map(lambda tail: VALID_HEADER[:24] + tail),
        # an Arrow IPC continuation marker and a length, so the reader looks further in
        st.binary(max_size=300).map(lambda tail: VALID_HEADER + b"\xff\xff\xff\xff" + tail),
    )
)
def test_format_decoders_on_arbitrary_bytes_decode_or_raise_corrupt_batch(buf: bytes) -> None:
    decode_everything(buf)


@settings(max_examples=200, deadline=None)
@given(buf=damaged_batches())
def test_header_decoders_on_damaged_batches_decode_or_raise_corrupt_batch(buf: bytearray) -> None:
    for decode in (decode_header, verify, lambda b: list(iter_batches(b))):
        with contextlib.suppress(CorruptBatch):
            decode(buf)


def damaged_bodies(batch: bytearray) -> Iterator[bytearray]:
    """Every single-bit flip of the body, and every body byte set to 0x00, 0x02 and 0xff."""
    for bit in range(HEADER_LENGTH * 8, len(batch) * 8):
        yield flip_bit(batch, bit)
    for at in range(HEADER_LENGTH, len(batch)):
        for value in (0x00, 0x02, 0xFF):
            if batch[at] != value:
                damaged = bytearray(batch)
                damaged[at] = value
                yield damaged


# A client computes the CRC over whatever body it sends, so a damaged body reaches read_body
# with a valid CRC: read_body is the only guard between those bytes and Arrow.
@pytest.mark.parametrize(
    ("form", "keyed"), [("stream", True), ("message", True), ("message", False)]
)
@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_read_body_on_damaged_body_raises_only_corrupt_batch(
    compression: str | None, form: str, keyed: bool
) -> None:
    for damaged in damaged_bodies(build_batch([b"hello"], compression, form=form, keyed=keyed)):
        try:
            read_body(damaged)
        except CorruptBatch:
            pass
        except Exception as exc:
            raise AssertionError(f"read_body let {type(exc).__name__} escape: {exc}") from exc


@pytest.mark.parametrize("form", ["stream", "message"])
def test_read_body_returns_only_structurally_valid_batches(form: str) -> None:
    invalid = 0
    for damaged in damaged_bodies(build_batch([b"hello"], form=form)):
        try:
            record = read_body(damaged)
        except Exception:  # refused, typed or not: what escapes is the test above's concern
            continue
        try:
            record.validate(full=True)
        except pa.ArrowInvalid:
            invalid += 1
    assert invalid == 0
