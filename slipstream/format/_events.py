"""Events as Arrow columns, and back; the batch body in its two forms (see _batch.py).

The body of every batch of an untyped stream is one Arrow record batch with ``EVENT_SCHEMA``.
Producers write it as an *event message* (one Arrow record batch message, no schema message,
all-null key or headers columns left out, the Arrow buffers lz4-compressed when that saves at
least a fifth); readers take that and the older form, a whole Arrow IPC stream, alike.
Building and splitting it is done column-wise (numpy and Arrow buffers): there is no per-event
Python work on this path beyond what the caller's own lists already cost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from types import MappingProxyType
from typing import Any, cast

import msgspec
import numpy as np
import pyarrow as pa

from .._errors import CorruptBatch
from ._batch import (
    FLAG_EVENT_MESSAGE,
    FLAG_NO_HEADERS,
    FLAG_NO_KEYS,
    HEADER_LENGTH,
    BodyParts,
    decode_header,
)

HEADER_TYPE = pa.list_(
    pa.struct([pa.field("key", pa.string(), nullable=False), pa.field("value", pa.binary())])
)
TIMESTAMP_TYPE = pa.timestamp("ms", tz="UTC")
EVENT_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("timestamp", TIMESTAMP_TYPE, nullable=False),
        pa.field("headers", HEADER_TYPE),
    ]
)
_IPC_OPTIONS = {
    None: pa.ipc.IpcWriteOptions(),
    "lz4": pa.ipc.IpcWriteOptions(compression="lz4"),
    "zstd": pa.ipc.IpcWriteOptions(compression="zstd"),
}
COMPRESSIONS = tuple(name for name in _IPC_OPTIONS if name)
_NO_HEADER_ITEMS = pa.nulls(0, HEADER_TYPE.value_type)  # (pa.array would import pandas)


class Event(msgspec.Struct, frozen=True, gc=False):
    """One event as a reader returns it.

    ``key`` is the routing key as bytes (a ``str`` key was sent UTF-8 encoded) or None;
    ``timestamp`` is the event time in milliseconds since the Unix epoch; ``segment`` and
    ``offset`` are where the event is stored: together they identify it for good.
    """

    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes]
    timestamp: int
    segment: int
    offset: int


def binary_array(values: Sequence[bytes | None]) -> pa.Array:
    """A ``binary`` Arrow array from a list of bytes, built from two buffers (no per-item Arrow
    calls). None items fall back to Arrow's own converter, which handles validity."""
    count = len(values)
    present = cast("Sequence[bytes]", values)
    try:
        data = b"".join(present)
    except TypeError:  # a None among them: Arrow's converter builds the validity bitmap
        return pa.array(values, pa.binary())
    offsets = np.empty(count + 1, dtype=np.int32)
    offsets[0] = 0
    np.cumsum(np.fromiter(map(len, present), dtype=np.int32, count=count), out=offsets[1:])
    return pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def null_headers(count: int) -> pa.Array:
    """An all-null ``headers`` column: a validity bitmap and zero list offsets over empty
    children (``pa.nulls`` gives the children ``count + 1`` offsets each: 8 bytes an event more
    in every body)."""
    zeros = pa.py_buffer(np.zeros(count + 1, dtype=np.int32))
    validity = pa.py_buffer(np.zeros((count + 7) // 8, dtype=np.uint8))
    return pa.Array.from_buffers(
        HEADER_TYPE, count, [validity, zeros], null_count=count, children=[_NO_HEADER_ITEMS]
    )


def headers_array(headers: Sequence[Mapping[str, bytes] | None]) -> pa.Array:
    """The ``headers`` column; all-empty headers cost one null array, not a list per event."""
    if not any(headers):
        return null_headers(len(headers))
    rows: list[list[tuple[str, bytes]] | None] = [list(h.items()) if h else None for h in headers]
    return pa.array(rows, HEADER_TYPE)


def numpy_array(values: np.ndarray) -> pa.Array:
    """An Arrow array over a numpy array of fixed-width numbers, zero-copy. (``pa.array`` of a
    numpy array imports pandas on its first call: 0.2 s in the middle of a first read.)"""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(
        pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)]
    )


def int64_values(array: pa.Array) -> np.ndarray:
    """A zero-copy numpy view of a null-free 64-bit column (int64 or timestamp). Not
    ``to_numpy()``, which imports pandas on its first call."""
    return np.frombuffer(array.buffers()[1], np.int64, len(array), array.offset * 8)


def timestamp_array(timestamps: Sequence[int] | np.ndarray) -> pa.Array:
    """The ``timestamp`` column from milliseconds since the epoch (zero-copy from int64)."""
    values = np.ascontiguousarray(timestamps, dtype=np.int64)
    return pa.Array.from_buffers(TIMESTAMP_TYPE, len(values), [None, pa.py_buffer(values)])


def make_record_batch(
    keys: pa.Array, values: pa.Array, timestamps: pa.Array, headers: pa.Array | None = None
) -> pa.RecordBatch:
    """Assemble the event columns into a record batch of ``EVENT_SCHEMA``."""
    if headers is None:
        headers = null_headers(len(values))
    return pa.RecordBatch.from_arrays([keys, values, timestamps, headers], schema=EVENT_SCHEMA)


def encode_body(batch: pa.RecordBatch, compression: str | None = None) -> pa.Buffer:
    """Serialise a record batch as an Arrow IPC stream (the batch body)."""
    try:
        options = _IPC_OPTIONS[compression]
    except KeyError:
        raise ValueError(f"compression must be one of {COMPRESSIONS} or None") from None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


#: From this size on, a batch's Arrow buffers are sent by reference instead of copied into one
#: serialised message (below it, the copy is cheaper than the writer's Python calls).
_BY_REFERENCE_BYTES = 64 * 1024
#: A compressed body is kept only if it is at most this share of the plain one. Compressed
#: buffers cannot be read in place (a reader decompresses them into new memory), so a body
#: must shrink by a fifth to be worth it: JSON-ish events shrink by 60-80% with lz4, random
#: bytes by 3-10% (only their offsets and timestamps compress; measured in bench/storage.py).
COMPRESSED_AT_MOST = 0.8
#: Whether a large batch compresses is decided on a slice of about this many bytes first,
#: so an incompressible 2 MiB batch costs one 64 KiB trial, not a whole compression.
_COMPRESSION_SAMPLE_BYTES = 64 * 1024

#: the stored schema of an event message, by its NO_KEYS / NO_HEADERS flags
_STORED_SCHEMAS = {
    flags: pa.schema(
        [
            field
            for field in EVENT_SCHEMA
            if not (flags & FLAG_NO_KEYS and field.name == "key")
            and not (flags & FLAG_NO_HEADERS and field.name == "headers")
        ]
    )
    for flags in (0, FLAG_NO_KEYS, FLAG_NO_HEADERS, FLAG_NO_KEYS | FLAG_NO_HEADERS)
}


class _Parts:
    """A write-only file for Arrow's IPC stream writer that keeps what it is handed: the body
    buffers arrive as ``pa.Buffer`` views of the batch's own memory (or, compressed, as new
    buffers), metadata and padding as small ``bytes``. Joined, the parts of one
    ``write_batch`` are exactly the record batch message (a test checks it)."""

    closed = False

    def __init__(self) -> None:
        self.parts: list[pa.Buffer | bytes] = []
        self._position = 0

    def write(self, data: pa.Buffer | bytes) -> int:
        self.parts.append(data)
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


#: per thread, one stream writer per (stored schema, compression) whose schema message went
#: out once, so that each later ``write_batch`` hands over exactly one record batch message
_writers = threading.local()


def _message_parts(batch: pa.RecordBatch, compression: str | None) -> list[pa.Buffer | bytes]:
    """One batch's IPC record batch message as buffers, its body by reference (no copy)."""
    writers: dict[tuple[pa.Schema, str | None], tuple[_Parts, Any]] | None = getattr(
        _writers, "by_schema", None
    )
    if writers is None:
        writers = _writers.by_schema = {}
    key = (batch.schema, compression)
    state = writers.get(key)
    if state is None:
        sink = _Parts()
        options = _IPC_OPTIONS[compression]
        writer = pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), batch.schema, options=options)
        writer.write_batch(batch.slice(0, 0))  # the schema message, once
        state = writers[key] = (sink, writer)
    sink, writer = state
    sink.parts = []
    try:
        writer.write_batch(batch)
    except BaseException:
        del writers[key]  # a half-written message: start the next one on a new writer
        raise
    return sink.parts


def _parts_size(parts: Sequence[pa.Buffer | bytes]) -> int:
    return sum(len(part) for part in parts)


def _compressed(stored: pa.RecordBatch, compression: str) -> list[pa.Buffer | bytes] | None:
    """The compressed message if it is at most COMPRESSED_AT_MOST of the plain one, else None.
    A batch over the sample size is tried on a slice first."""
    if stored.nbytes > _COMPRESSION_SAMPLE_BYTES:
        rows = max(1, stored.num_rows * _COMPRESSION_SAMPLE_BYTES // stored.nbytes)
        sample = stored.slice(0, rows)
        packed = _parts_size(_message_parts(sample, compression))
        if packed > COMPRESSED_AT_MOST * sample.serialize().size:
            return None
    parts = _message_parts(stored, compression)
    plain = stored.serialize().size if stored.nbytes < _BY_REFERENCE_BYTES else None
    if plain is None:  # big: the plain size without serialising it (metadata is < 1 KiB)
        plain = _parts_size(_message_parts(stored, None))
    return parts if _parts_size(parts) <= COMPRESSED_AT_MOST * plain else None


def encode_body_parts(batch: pa.RecordBatch, compression: str | None = None) -> BodyParts:
    """A batch body as buffers to send back to back, with its body-form flags for the header.

    A batch of ``EVENT_SCHEMA`` becomes an *event message* (``FLAG_EVENT_MESSAGE``): one Arrow
    record batch message without the 424-byte schema message, leaving out a key column that
    is all null (``FLAG_NO_KEYS``) and a headers column that is all null (``FLAG_NO_HEADERS``).
    With ``compression`` ("lz4" or "zstd") its buffers are compressed when that makes the
    message at most ``COMPRESSED_AT_MOST`` of the plain one, else sent plain. A large
    uncompressed batch's Arrow buffers go out by reference, not copied into a message first
    (that copy was 15% of a bulk producer's CPU samples). A batch of another schema becomes a
    whole Arrow IPC stream (:func:`encode_body`), flags 0.
    """
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS} or None")
    if not batch.schema.equals(EVENT_SCHEMA):
        return BodyParts([encode_body(batch, compression)])
    flags = FLAG_EVENT_MESSAGE
    columns = list(batch.columns)
    count = batch.num_rows
    if count and columns[3].null_count == count:
        flags |= FLAG_NO_HEADERS
        del columns[3]
    if count and columns[0].null_count == count:
        flags |= FLAG_NO_KEYS
        del columns[0]
    schema = _STORED_SCHEMAS[flags & (FLAG_NO_KEYS | FLAG_NO_HEADERS)]
    stored = pa.RecordBatch.from_arrays(columns, schema=schema)
    if compression is not None:
        packed = _compressed(stored, compression)
        if packed is not None:
            return BodyParts(packed, flags)
    if stored.nbytes >= _BY_REFERENCE_BYTES:
        return BodyParts(_message_parts(stored, None), flags)
    return BodyParts([stored.serialize()], flags)


def check_event_schema(batch: pa.RecordBatch) -> None:
    """Raise :class:`CorruptBatch` unless the batch has exactly the event columns."""
    if not batch.schema.equals(EVENT_SCHEMA):
        raise CorruptBatch(f"batch body has schema {batch.schema}, expected {EVENT_SCHEMA}")


def read_body(batch: bytes | bytearray | memoryview) -> pa.RecordBatch:
    """Decode the Arrow body of one whole batch (header included) as a record batch, in
    either body form (the header's flags say which), without copying uncompressed buffers.

    An event message comes back with ``EVENT_SCHEMA``, its left-out columns put back as nulls.
    The body is fully validated (offsets in bounds, UTF-8 where declared, the row count equal
    to the header's event count): a CRC only proves the bytes are what the producer sent, and
    a buggy or hostile producer must not be able to crash readers. Raises
    :class:`CorruptBatch` for anything else. Costs about 10 ns an event.
    """
    view = memoryview(batch)
    header = decode_header(view)
    if header.batch_length > len(view):
        raise CorruptBatch(f"batch says {header.batch_length} bytes, only {len(view)} present")
    body = pa.py_buffer(view[HEADER_LENGTH : header.batch_length])
    try:
        if header.flags & FLAG_EVENT_MESSAGE:
            record = _read_event_message(body, header.flags)
        else:
            reader = pa.ipc.open_stream(body)
            record = reader.read_next_batch()
        record.validate(full=True)
    except (pa.ArrowException, StopIteration, EOFError, MemoryError, OSError, ValueError) as exc:
        raise CorruptBatch(f"batch body is not valid Arrow IPC: {exc}") from exc
    if record.num_rows != header.event_count:
        raise CorruptBatch(
            f"batch body holds {record.num_rows} events, its header says {header.event_count}"
        )
    return record


def read_keys(batch: bytes | bytearray | memoryview) -> pa.Array | None:
    """The ``key`` column of one whole batch, validated alone (offsets in bounds, the row
    count equal to the header's event count): what the find index needs, at a third of
    ``read_body``'s cost for an uncompressed event message (the value and header columns are
    neither validated nor assembled; a compressed one is still decompressed whole). None if
    the batch has no key column (``FLAG_NO_KEYS``, or another schema without one). Raises
    :class:`CorruptBatch` for a body that does not decode."""
    view = memoryview(batch)
    header = decode_header(view)
    if not header.flags & FLAG_EVENT_MESSAGE:  # the older or a typed stream's form: decode all
        record = read_body(view)
        return record.column("key") if "key" in record.schema.names else None
    if header.flags & FLAG_NO_KEYS:
        return None
    if header.batch_length > len(view):
        raise CorruptBatch(f"batch says {header.batch_length} bytes, only {len(view)} present")
    body = pa.py_buffer(view[HEADER_LENGTH : header.batch_length])
    try:
        source = pa.BufferReader(body)
        message = pa.ipc.read_message(source)
        if message.type != "record batch":
            raise CorruptBatch(f"an event message body holds a {message.type} message")
        stored = pa.ipc.read_record_batch(message, _STORED_SCHEMAS[header.flags & _LEFT_OUT])
        keys = stored.column(0)
        keys.validate(full=True)
    except (pa.ArrowException, EOFError, MemoryError, OSError, ValueError) as exc:
        raise CorruptBatch(f"batch body is not valid Arrow IPC: {exc}") from exc
    if len(keys) != header.event_count:
        raise CorruptBatch(
            f"batch body holds {len(keys)} events, its header says {header.event_count}"
        )
    return keys


def _read_event_message(body: pa.Buffer, flags: int) -> pa.RecordBatch:
    source = pa.BufferReader(body)
    message = pa.ipc.read_message(source)
    if message.type != "record batch":
        raise CorruptBatch(f"an event message body holds a {message.type} message")
    if source.tell() != body.size:
        raise CorruptBatch(f"{body.size - source.tell()} bytes after the event message")
    stored = pa.ipc.read_record_batch(message, _STORED_SCHEMAS[flags & _LEFT_OUT])
    columns = list(stored.columns)
    count = stored.num_rows
    if flags & FLAG_NO_KEYS:
        columns.insert(0, pa.nulls(count, pa.binary()))
    if flags & FLAG_NO_HEADERS:
        columns.append(null_headers(count))
    return pa.RecordBatch.from_arrays(columns, schema=EVENT_SCHEMA)


_LEFT_OUT = FLAG_NO_KEYS | FLAG_NO_HEADERS
NO_HEADERS: Mapping[str, bytes] = MappingProxyType({})


def _headers_rows(column: pa.Array) -> Iterable[Mapping[str, bytes]]:
    if column.null_count == len(column):
        return repeat(NO_HEADERS, len(column))
    return (
        {item["key"]: item["value"] for item in row} if row else NO_HEADERS
        for row in column.to_pylist()
    )


def events_of(batch: pa.RecordBatch, segment: int, base_offset: int) -> Iterator[Event]:
    """The events of one decoded record batch, with their segment and offsets."""
    count = batch.num_rows
    keys = batch.column(0).to_pylist()
    values = batch.column(1).to_pylist()
    timestamps = int64_values(batch.column(2)).tolist()
    headers = _headers_rows(batch.column(3))
    return map(
        Event,
        keys,
        values,
        headers,
        timestamps,
        repeat(segment, count),
        range(base_offset, base_offset + count),
    )


def to_json_value(value: bytes) -> Any:
    """A value for JSON output: decoded JSON if it is JSON, else text, else None."""
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError:
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
