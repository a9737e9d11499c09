"""Arrow conversions between slipstream's event batches and Spark's rows. Pure: no Spark.

Source side: a batch as the reader returns it (key, value, timestamp[ms], headers, segment,
offset) becomes a batch of exactly the Arrow schema Spark derived from the source's schema
(timestamps in microseconds, a ``stream`` column, JSON values parsed into columns when asked).
Every step is column-wise; the only per-row work is the fallback for malformed JSON.

Sink side: a batch of a DataFrame's columns (``key``, ``value``, optional ``headers`` and
``timestamp``) becomes the columns ``send_many`` takes.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from .._errors import InvalidArgument, MalformedValue
from ..format import HEADER_TYPE

#: the source's own columns, in order; a ``schema`` option adds the parsed value's fields
SOURCE_COLUMNS = ("key", "value", "headers", "timestamp", "stream", "segment", "offset")
SOURCE_DDL = (
    "key BINARY, value BINARY, headers ARRAY<STRUCT<key: STRING, value: BINARY>>, "
    "timestamp TIMESTAMP, stream STRING, segment INT, offset BIGINT"
)


def constant_strings(text: str, count: int) -> pa.Array:
    """``count`` copies of ``text`` as a ``string`` array, built from two buffers."""
    data = text.encode()
    offsets = np.arange(count + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(
        pa.string(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data * count)]
    )


def _parse_json_rows(values: pa.Array, schema: pa.Schema, mode: str) -> pa.Table:
    """Row by row: each value parses or becomes a row of nulls (PERMISSIVE) or raises."""
    options = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    empty = pa.table({f.name: pa.nulls(1, f.type) for f in schema})
    tables = []
    for index, value in enumerate(values.to_pylist()):
        try:
            if value is None or not value.strip():
                raise pa.ArrowInvalid("empty value")
            table = pajson.read_json(pa.BufferReader(value), parse_options=options)
            if table.num_rows != 1:
                raise pa.ArrowInvalid("not exactly one JSON object")
            tables.append(table.select(schema.names).cast(schema))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            if mode == "FAILFAST":
                raise MalformedValue(
                    f"value at row {index} of a batch is not JSON of the schema: {exc}. "
                    'Use .option("mode", "PERMISSIVE") to read such values as nulls',
                ) from exc
            tables.append(empty)
    return pa.concat_tables(tables) if tables else empty.slice(0, 0)


def parse_json_values(values: pa.Array, schema: pa.Schema, mode: str) -> pa.Table:
    """Parse a binary array of JSON objects into columns of ``schema``.

    Fast path: all values at once as newline-delimited JSON. If that fails (a malformed value,
    a value spanning lines, a type mismatch), fall back to one value at a time so that only the
    bad rows become nulls (``mode="PERMISSIVE"``) or the first one raises MalformedValue
    (``"FAILFAST"``). Fields the schema does not name are ignored; missing ones are null.
    """
    count = len(values)
    if count == 0:
        return pa.table({f.name: pa.array([], f.type) for f in schema})
    body = values.buffers()[2]
    if values.null_count == 0 and body is not None:
        offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[
            values.offset : values.offset + count + 1
        ]
        raw = np.frombuffer(body, dtype=np.uint8)[offsets[0] : offsets[-1]]
        if not (raw == ord("\n")).any():
            options = pajson.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"
            )
            try:
                lines = pa.BufferReader(_with_newlines(raw, offsets))
                table = pajson.read_json(lines, parse_options=options)
                if table.num_rows == count:
                    return table.select(schema.names).cast(schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                pass
    return _parse_json_rows(values, schema, mode)


def _with_newlines(raw: np.ndarray, offsets: np.ndarray) -> bytes:
    """The values' bytes with a newline after each: newlines inserted at the value ends."""
    ends = (offsets[1:] - offsets[0]).astype(np.int64)
    return np.insert(raw, ends, ord("\n")).tobytes()


def to_spark_batch(
    record: pa.RecordBatch, stream: str, schema: pa.Schema, mode: str = "PERMISSIVE"
) -> pa.RecordBatch:
    """A reader batch (with segment and offset columns) as a batch of ``schema``."""
    count = record.num_rows
    columns: dict[str, pa.Array] = {
        "key": record.column("key"),
        "value": record.column("value"),
        "headers": record.column("headers"),
        "timestamp": record.column("timestamp").cast(pa.timestamp("us", tz="UTC")),
        "stream": constant_strings(stream, count),
        "segment": record.column("segment"),
        "offset": record.column("offset"),
    }
    extra = [f for f in schema if f.name not in SOURCE_COLUMNS]
    if extra:
        parsed = parse_json_values(record.column("value"), pa.schema(extra), mode)
        for field in extra:
            columns[field.name] = parsed.column(field.name).combine_chunks()
    arrays = []
    for field in schema:
        array = columns[field.name]
        arrays.append(array if array.type == field.type else array.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# --- the sink ---------------------------------------------------------------------------------

SINK_COLUMNS = ("key", "value", "headers", "timestamp")


def check_sink_schema(names: list[str]) -> None:
    """A DataFrame written to slipstream needs ``value``; ``key``, ``headers`` and
    ``timestamp`` are optional; other columns are an error (they would be silently lost)."""
    lowered = [n.lower() for n in names]
    if "value" not in lowered:
        raise InvalidArgument(
            f"a DataFrame written to slipstream needs a 'value' column; it has {names}. "
            "Select one, e.g. df.select(to_json(struct(*df.columns)).alias('value'))"
        )
    unknown = [n for n in names if n.lower() not in SINK_COLUMNS]
    if unknown:
        raise InvalidArgument(
            f"columns {unknown} cannot be written to slipstream; the sink takes "
            f"{', '.join(SINK_COLUMNS)}. Drop them or pack them into 'value'"
        )


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dt.date | dt.datetime | dt.time):
        return value.isoformat()
    raise NotImplementedError(f"cannot write {type(value).__name__} as JSON")


def _to_binary(array: pa.Array, column: str) -> pa.Array:
    if pa.types.is_binary(array.type):
        return array
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        return array.cast(pa.binary())
    if pa.types.is_large_binary(array.type):
        return array.cast(pa.binary())
    if column == "key" and (pa.types.is_integer(array.type) or pa.types.is_decimal(array.type)):
        return array.cast(pa.string()).cast(pa.binary())
    # structs, maps, lists, numbers: written as JSON, like Spark's to_json
    encoder = msgspec.json.Encoder(enc_hook=_json_default)
    return pa.array(
        [None if v is None else encoder.encode(v) for v in array.to_pylist()], pa.binary()
    )


def _headers(array: pa.Array) -> pa.Array:
    """``map<string, binary|string>`` or ``array<struct<key, value>>`` as the event format's
    header list."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_map(array.type):
        entries = pa.StructArray.from_arrays(
            [array.keys.cast(pa.string()), _to_binary(array.items, "headers")],
            fields=list(HEADER_TYPE.value_type),
        )
        return pa.ListArray.from_arrays(array.offsets, entries, mask=array.is_null())
    try:
        return array.cast(HEADER_TYPE)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidArgument(
            "the 'headers' column must be map<string, binary> or "
            f"array<struct<key: string, value: binary>>, not {array.type}"
        ) from exc


def from_spark_batch(batch: pa.RecordBatch) -> dict[str, pa.Array | None]:
    """A DataFrame batch as ``send_many`` arguments: values, keys, timestamps (ms), headers."""
    names = {name.lower(): name for name in batch.schema.names}
    value = batch.column(names["value"])
    if value.null_count:
        raise InvalidArgument(
            "the 'value' column has nulls; slipstream events always have a value "
            "(filter them out or coalesce to an empty string)"
        )
    key = batch.column(names["key"]) if "key" in names else None
    timestamp = batch.column(names["timestamp"]) if "timestamp" in names else None
    if timestamp is not None:
        if not pa.types.is_timestamp(timestamp.type):
            raise InvalidArgument(
                f"the 'timestamp' column must be a timestamp, not {timestamp.type}"
            )
        millis = pc.cast(timestamp, pa.timestamp("ms", tz="UTC"), safe=False).cast(pa.int64())
        if millis.null_count:
            now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
            millis = pc.fill_null(millis, now)
        timestamp = millis
    headers = batch.column(names["headers"]) if "headers" in names else None
    return {
        "values": _to_binary(value, "value"),
        "keys": None if key is None else _to_binary(key, "key"),
        "timestamps": timestamp,
        "headers": None if headers is None else _headers(headers),
    }
