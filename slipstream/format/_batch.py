"""The record batch: a fixed header plus an Apache Arrow IPC body.

Byte layout, version 1 (all integers little-endian; docs/format.md says the same):

    offset size  field            meaning
    0      4     magic            b"SLB1"
    4      1     version          1
    5      1     reserved         0
    6      2     header_length    64 (lets a later version grow the header; v1 readers refuse it)
    8      8     base_offset      i64, offset of the first event; set by the broker on append
    16     4     batch_length     u32, header + body bytes
    20     4     crc32c           u32, CRC32C (Castagnoli) of bytes [24, batch_length)
    24     2     flags            u16, bit 0 transactional, bit 1 control, bits 2-4 body form
                                  (below); others 0
    26     2     producer_epoch   i16, -1 when the producer is not idempotent
    28     4     event_count      u32, > 0
    32     8     min_timestamp    i64, ms since the Unix epoch
    40     8     max_timestamp    i64, ms since the Unix epoch
    48     8     producer_id      i64, -1 when the producer is not idempotent
    56     4     sequence         i32, per segment and producer; -1 when not idempotent
    60     4     reserved         0
    64     ...   body             Arrow IPC, in the form bits 2-4 of flags say

Body forms (flags bits 2-4; the Arrow buffers may be lz4- or zstd-compressed in either form,
as the record batch message itself records):

    bit 2 clear   an Arrow IPC stream: one schema message, one record batch message, the
                  8-byte end-of-stream marker; any schema (bits 3 and 4 must be clear)
    bit 2 set     EVENT_MESSAGE: one Arrow IPC record batch message and nothing else; its
                  schema is the event schema (key, value, timestamp, headers) less the
                  columns that bits 3 and 4 leave out:
    bit 3         NO_KEYS: no ``key`` column is stored, every event's key is null
    bit 4         NO_HEADERS: no ``headers`` column is stored, every event's headers are null

The second form saves the 424-byte schema message and the end marker of every batch, and the
columns that carry nothing; readers put the null columns back, so both read the same.

The CRC covers bytes 24 to the end, leaving out magic, version, lengths and ``base_offset``:
the broker assigns offsets by patching eight bytes in place without recomputing a checksum
over the body (Kafka's v2 batch does the same). The uncovered fields are checked for sanity
on decode, and the journal and the chunk index guard them on disk.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence

import crc32c
import msgspec
import pyarrow as pa

from .._errors import CorruptBatch

MAGIC = b"SLB1"
VERSION = 1
HEADER_LENGTH = 64
CRC_START = 24
FLAG_TRANSACTIONAL = 0x1
FLAG_CONTROL = 0x2
#: the body is one Arrow record batch message of the event schema (no schema message)
FLAG_EVENT_MESSAGE = 0x4
#: with FLAG_EVENT_MESSAGE: the body stores no ``key`` column (every key is null)
FLAG_NO_KEYS = 0x8
#: with FLAG_EVENT_MESSAGE: the body stores no ``headers`` column (no event has headers)
FLAG_NO_HEADERS = 0x10
#: the flags that describe the body; set by the producer, kept by :func:`restamp`
BODY_FLAGS = FLAG_EVENT_MESSAGE | FLAG_NO_KEYS | FLAG_NO_HEADERS
_KNOWN_FLAGS = FLAG_TRANSACTIONAL | FLAG_CONTROL | BODY_FLAGS

_HEADER = struct.Struct("<4sBBHqII HhIqqqiI")
_BASE_OFFSET = struct.Struct("<q")
_BASE_OFFSET_AT = 8
assert _HEADER.size == HEADER_LENGTH


class BodyParts(list[pa.Buffer | bytes]):
    """A batch body as buffers to send back to back, with the body-form ``flags`` that go in
    its header: :func:`encode_header` adds them, so header and body cannot disagree."""

    def __init__(self, parts: Iterable[pa.Buffer | bytes] = (), flags: int = 0) -> None:
        super().__init__(parts)
        self.flags = flags


class BatchHeader(msgspec.Struct, frozen=True):
    """The decoded fixed header of one record batch."""

    base_offset: int
    batch_length: int
    crc: int
    flags: int
    producer_epoch: int
    event_count: int
    min_timestamp: int
    max_timestamp: int
    producer_id: int
    sequence: int

    @property
    def next_offset(self) -> int:
        """The offset right after this batch's last event."""
        return self.base_offset + self.event_count


def encode_header(
    body: pa.Buffer | bytes | memoryview | Sequence[pa.Buffer | bytes | memoryview],
    *,
    event_count: int,
    min_timestamp: int,
    max_timestamp: int,
    base_offset: int = 0,
    flags: int = 0,
    producer_id: int = -1,
    producer_epoch: int = -1,
    sequence: int = -1,
) -> bytes:
    """Build the 64-byte header for ``body`` (one buffer, or a list of buffers that follow each
    other); header + body is the batch, sent without copying. A :class:`BodyParts` body adds
    its body-form flags to ``flags``."""
    if isinstance(body, BodyParts):
        flags |= body.flags
    parts = list(body) if isinstance(body, list | tuple) else [body]
    views = [memoryview(p) for p in parts]  # type: ignore[arg-type]
    batch_length = HEADER_LENGTH + sum(v.nbytes for v in views)
    if batch_length > 0xFFFFFFFF:
        raise CorruptBatch(f"batch of {batch_length} bytes exceeds the 4 GiB format limit")
    head = bytearray(
        _HEADER.pack(
            MAGIC,
            VERSION,
            0,
            HEADER_LENGTH,
            base_offset,
            batch_length,
            0,
            flags,
            producer_epoch,
            event_count,
            min_timestamp,
            max_timestamp,
            producer_id,
            sequence,
            0,
        )
    )
    crc = crc32c.crc32c(head[CRC_START:])
    for view in views:
        crc = crc32c.crc32c(view, crc)
    struct.pack_into("<I", head, 20, crc)
    return bytes(head)


def decode_header(buf: bytes | bytearray | memoryview, at: int = 0) -> BatchHeader:
    """Decode and sanity-check the header at ``buf[at:]`` (not the CRC: see :func:`verify`).

    Raises :class:`CorruptBatch` for a short buffer, wrong magic, unknown version, unknown flags,
    a zero event count or a length that does not fit.
    """
    if len(buf) - at < HEADER_LENGTH:
        raise CorruptBatch(f"batch header needs {HEADER_LENGTH} bytes, {len(buf) - at} left")
    (
        magic,
        version,
        reserved,
        header_length,
        base_offset,
        batch_length,
        crc,
        flags,
        epoch,
        count,
        min_ts,
        max_ts,
        producer_id,
        sequence,
        reserved_tail,
    ) = _HEADER.unpack_from(buf, at)
    if magic != MAGIC:
        raise CorruptBatch(f"bad batch magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptBatch(f"unknown batch format version {version}, this build reads {VERSION}")
    if header_length != HEADER_LENGTH or batch_length < HEADER_LENGTH:
        raise CorruptBatch(f"bad batch lengths: header {header_length}, batch {batch_length}")
    if reserved or reserved_tail:
        raise CorruptBatch("reserved batch header bytes must be zero")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptBatch(f"unknown batch flags {flags:#x}")
    if flags & (FLAG_NO_KEYS | FLAG_NO_HEADERS) and not flags & FLAG_EVENT_MESSAGE:
        raise CorruptBatch(f"batch flags {flags:#x}: columns left out of a body with a schema")
    if count == 0:
        raise CorruptBatch("batch with zero events")
    if base_offset < 0:
        raise CorruptBatch(f"negative base offset {base_offset}")
    return BatchHeader(
        base_offset,
        batch_length,
        crc,
        flags,
        epoch,
        count,
        min_ts,
        max_ts,
        producer_id,
        sequence,
    )


def verify(buf: bytes | bytearray | memoryview, at: int = 0) -> BatchHeader:
    """Decode the header at ``buf[at:]`` and check that the whole batch is there and its CRC32C
    matches. Raises :class:`CorruptBatch` otherwise."""
    header = decode_header(buf, at)
    end = at + header.batch_length
    if end > len(buf):
        raise CorruptBatch(f"batch says {header.batch_length} bytes, only {len(buf) - at} present")
    actual = crc32c.crc32c(memoryview(buf)[at + CRC_START : end])
    if actual != header.crc:
        raise CorruptBatch(
            f"batch CRC32C mismatch: stored {header.crc:#010x}, computed {actual:#010x}"
        )
    return header


def set_base_offset(buf: bytearray | memoryview, base_offset: int, at: int = 0) -> None:
    """Patch the broker-assigned base offset into a batch in place (outside the CRC)."""
    _BASE_OFFSET.pack_into(buf, at + _BASE_OFFSET_AT, base_offset)


_PRODUCER_FIELDS = struct.Struct("<Hh")  # flags, producer_epoch at byte 24
_PRODUCER_ID = struct.Struct("<qi")  # producer_id, sequence at byte 48


def restamp(
    batch: bytearray | memoryview,
    *,
    flags: int,
    producer_id: int,
    producer_epoch: int,
    sequence: int,
) -> None:
    """Rewrite a whole batch's producer fields and flags in place and recompute its CRC (the
    broker does this when it moves a committed transaction's staged batches into segments).
    The body-form flags (:data:`BODY_FLAGS`) describe the body, not the producer: they are
    kept, whatever ``flags`` says."""
    (old_flags,) = struct.unpack_from("<H", batch, 24)
    flags = flags & ~BODY_FLAGS | old_flags & BODY_FLAGS
    _PRODUCER_FIELDS.pack_into(batch, 24, flags, producer_epoch)
    _PRODUCER_ID.pack_into(batch, 48, producer_id, sequence)
    struct.pack_into("<I", batch, 20, crc32c.crc32c(memoryview(batch)[CRC_START:]))


def iter_batches(
    buf: bytes | bytearray | memoryview, *, check_crc: bool = True
) -> Iterator[tuple[BatchHeader, memoryview]]:
    """Split back-to-back batches, yielding each header with a zero-copy view of the batch."""
    view = memoryview(buf)
    at = 0
    while at < len(view):
        header = verify(view, at) if check_crc else decode_header(view, at)
        end = at + header.batch_length
        if end > len(view):
            raise CorruptBatch(f"batch at byte {at} runs past the end of the buffer")
        yield header, view[at:end]
        at = end
