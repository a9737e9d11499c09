"""Arrow conversions between event batches and Spark rows (no Spark, no broker)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from slipstream import InvalidArgument
from slipstream.format import HEADER_TYPE, make_record_batch
from slipstream.spark import MalformedValue
from slipstream.spark._convert import (
    check_sink_schema,
    constant_strings,
    from_spark_batch,
    parse_json_values,
    to_spark_batch,
)

SPARK_SOURCE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("stream", pa.string()),
        pa.field("segment", pa.int32()),
        pa.field("offset", pa.int64()),
    ]
)
ITEM = pa.schema([pa.field("item", pa.string()), pa.field("price", pa.float64())])


def reader_batch(values: list[bytes]) -> pa.RecordBatch:
    """A batch as Reader.batches() yields it: event columns plus segment and offset."""
    count = len(values)
    record = make_record_batch(
        pa.array([b"k%d" % i for i in range(count)], pa.binary()),
        pa.array(values, pa.binary()),
        pa.array([1_700_000_000_000 + i for i in range(count)], pa.timestamp("ms", tz="UTC")),
        pa.array([[{"key": "h", "value": b"v"}]] * count, HEADER_TYPE),
    )
    return record.append_column("segment", pa.array([3] * count, pa.int32())).append_column(
        "offset", pa.array(range(100, 100 + count), pa.int64())
    )


def test_to_spark_batch_matches_the_declared_schema_exactly() -> None:
    batch = to_spark_batch(reader_batch([b"a", b"b"]), "demo/orders", SPARK_SOURCE_SCHEMA)
    assert batch.schema == SPARK_SOURCE_SCHEMA
    row = batch.to_pylist()[1]
    assert row["key"] == b"k1" and row["value"] == b"b"
    assert row["timestamp"] == dt.datetime(2023, 11, 14, 22, 13, 20, 1000, tzinfo=dt.UTC)
    assert (row["stream"], row["segment"], row["offset"]) == ("demo/orders", 3, 101)
    assert row["headers"] == [{"key": "h", "value": b"v"}]


def test_constant_strings() -> None:
    assert constant_strings("a/b", 3).to_pylist() == ["a/b"] * 3
    assert constant_strings("a/b", 0).to_pylist() == []


def test_json_values_parse_into_columns() -> None:
    values = pa.array([b'{"item": "x", "price": 1.5, "extra": 1}', b'{"item": "y"}'], pa.binary())
    table = parse_json_values(values, ITEM, "PERMISSIVE")
    assert table.to_pylist() == [{"item": "x", "price": 1.5}, {"item": "y", "price": None}]
    # a slice of a larger array (non-zero offset) parses only its own rows
    assert parse_json_values(values.slice(1), ITEM, "PERMISSIVE").to_pylist() == [
        {"item": "y", "price": None}
    ]


def test_values_spanning_lines_take_the_row_path() -> None:
    values = pa.array([b'{"item":\n "x",\n "price": 2}', b'{"item": "z"}'], pa.binary())
    assert parse_json_values(values, ITEM, "FAILFAST").to_pylist() == [
        {"item": "x", "price": 2.0},
        {"item": "z", "price": None},
    ]


def test_malformed_values_are_nulls_or_an_error_per_mode() -> None:
    values = pa.array(
        [b'{"item": "x", "price": 1}', b"not json", b"", b'{"item": "y", "price": "high"}'],
        pa.binary(),
    )
    rows = parse_json_values(values, ITEM, "PERMISSIVE").to_pylist()
    assert rows[0] == {"item": "x", "price": 1.0}
    assert rows[1] == rows[2] == rows[3] == {"item": None, "price": None}
    with pytest.raises(MalformedValue, match=r"row 1 .*PERMISSIVE"):
        parse_json_values(values, ITEM, "FAILFAST")


def test_schema_columns_are_added_to_the_source_columns() -> None:
    schema = pa.schema([*SPARK_SOURCE_SCHEMA, *ITEM])
    batch = to_spark_batch(reader_batch([b'{"item": "a", "price": 2}', b"[1]"]), "s/t", schema)
    assert batch.schema == schema
    assert batch.column("item").to_pylist() == ["a", None]
    assert batch.column("price").to_pylist() == [2.0, None]


def test_sink_batch_with_strings_structs_maps_and_timestamps() -> None:
    batch = pa.RecordBatch.from_pydict(
        {
            "key": pa.array(["a", None]),
            "value": pa.array([{"n": 1, "at": dt.date(2026, 1, 2)}, {"n": 2, "at": None}]),
            "headers": pa.array([[("h", b"1")], []], pa.map_(pa.string(), pa.binary())),
            "timestamp": pa.array(
                [dt.datetime(2026, 11, 22, 0, 0, 0, 1500, tzinfo=dt.UTC), None],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    columns = from_spark_batch(batch)
    assert columns["keys"] is not None and columns["keys"].to_pylist() == [b"a", None]
    assert columns["values"] is not None
    assert columns["values"].to_pylist() == [b'{"n":1,"at":"2026-01-02"}', b'{"n":2,"at":null}']
    assert columns["headers"] is not None
    assert columns["headers"].type == HEADER_TYPE
    assert columns["headers"].to_pylist() == [[{"key": "h", "value": b"1"}], []]
    timestamps = columns["timestamps"]
    assert timestamps is not None and timestamps[0].as_py() == 1795305600001  # ms, truncated
    assert timestamps[1].as_py() > 1795305600001  # a null timestamp becomes "now"


def test_sink_rejects_what_it_cannot_write() -> None:
    check_sink_schema(["key", "VALUE", "headers", "timestamp"])
    with pytest.raises(InvalidArgument, match="needs a 'value' column"):
        check_sink_schema(["key", "payload"])
    with pytest.raises(InvalidArgument, match=r"columns \['extra'\] cannot be written"):
        check_sink_schema(["value", "extra"])
    with pytest.raises(InvalidArgument, match="has nulls"):
        from_spark_batch(pa.RecordBatch.from_pydict({"value": pa.array([b"x", None])}))
    with pytest.raises(InvalidArgument, match="must be a timestamp"):
        from_spark_batch(pa.RecordBatch.from_pydict({"value": [b"x"], "timestamp": [1]}))
    with pytest.raises(InvalidArgument, match="headers"):
        from_spark_batch(pa.RecordBatch.from_pydict({"value": [b"x"], "headers": [1]}))
