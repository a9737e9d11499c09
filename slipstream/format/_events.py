"""Events as Arrow columns, and back.

The body of every batch of an untyped stream is one Arrow record batch with ``EVENT_SCHEMA``.
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


def headers_array(headers: Sequence[Mapping[str, bytes] | None]) -> pa.Array:
    """The ``headers`` column; all-empty headers cost one null array, not a list per event."""
    if not any(headers):
        return pa.nulls(len(headers), HEADER_TYPE)
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
        headers = pa.nulls(len(values), HEADER_TYPE)
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


_EVENT_SCHEMA_MESSAGE = EVENT_SCHEMA.serialize()
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
#: From this size on, a batch's Arrow buffers are sent by reference instead of copied into one
#: serialised message (below it, the copy is cheaper than the writer's Python calls).
_BY_REFERENCE_BYTES = 64 * 1024


class _Parts:
    """A write-only file for Arrow's IPC stream writer that keeps what it is handed: the body
    buffers arrive as ``pa.Buffer`` views of the batch's own memory, metadata and padding as
    small ``bytes``. Joined, they are exactly ``batch.serialize()`` (a test checks it)."""

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


_writers = threading.local()  # one event-schema stream writer per thread, schema written once


def _message_parts(batch: pa.RecordBatch) -> list[pa.Buffer | bytes]:
    """One event batch's IPC message as buffers, its body by reference (no copy)."""
    state: tuple[_Parts, pa.ipc.RecordBatchStreamWriter] | None = getattr(_writers, "state", None)
    if state is None:
        sink = _Parts()
        writer = pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), EVENT_SCHEMA)
        empty = make_record_batch(binary_array([]), binary_array([]), timestamp_array([]))
        writer.write_batch(empty)  # the schema message, once (from_pylist would import pandas)
        state = _writers.state = (sink, writer)
    sink, writer = state
    sink.parts = []
    try:
        writer.write_batch(batch)
    except BaseException:
        del _writers.state  # a half-written message: start the next one on a new writer
        raise
    return sink.parts


def encode_body_parts(
    batch: pa.RecordBatch, compression: str | None = None
) -> list[pa.Buffer | bytes]:
    """The same bytes as :func:`encode_body`, as buffers to send back to back. Uncompressed
    event batches reuse one serialised schema message instead of opening a stream writer
    (most of the cost of a small batch), and a large one's Arrow buffers go out by reference,
    not copied into a message first (that copy was 15% of a bulk producer's CPU samples)."""
    if compression is None and batch.schema.equals(EVENT_SCHEMA):
        if batch.nbytes >= _BY_REFERENCE_BYTES:
            return [_EVENT_SCHEMA_MESSAGE, *_message_parts(batch), _END_OF_STREAM]
        return [_EVENT_SCHEMA_MESSAGE, batch.serialize(), _END_OF_STREAM]
    return [encode_body(batch, compression)]


def check_event_schema(batch: pa.RecordBatch) -> None:
    """Raise :class:`CorruptBatch` unless the batch has exactly the event columns."""
    if not batch.schema.equals(EVENT_SCHEMA):
        raise CorruptBatch(f"batch body has schema {batch.schema}, expected {EVENT_SCHEMA}")


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
