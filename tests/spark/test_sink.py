"""The slipstream sink in real Spark against a real broker: exactly-once micro-batches, batch
writes, and what happens when Spark repeats or abandons a batch."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import BrokerProcess, produce_json
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

import slipstream
from slipstream.spark._sink import StagedPartition, StreamWriter


def events(client: slipstream.Client, stream: str) -> list[slipstream.Event]:
    with client.reader(stream, "earliest", end=client.tail(stream)) as reader:
        return list(reader)


def test_streaming_write_carries_keys_headers_and_event_time(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/in", segments=2)
    client.create_stream("t/out", segments=3)
    produce_json(client, "t/in", 500)
    with client.producer("t/in") as producer:
        producer.send(b"{}", key="with-headers", headers={"trace": b"abc"}, timestamp=1234)
    query = (
        spark.readStream.format("slipstream")
        .option("broker", broker.address)
        .option("stream", "t/in")
        .option("startingPosition", "earliest")
        .option("maxEventsPerTrigger", 200)
        .load()
        .select("key", "value", "headers", "timestamp")
        .writeStream.format("slipstream")
        .option("broker", broker.address)
        .option("stream", "t/out")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    source = {
        (e.key, e.value, e.timestamp, tuple(e.headers.items())) for e in events(client, "t/in")
    }
    written = events(client, "t/out")
    assert len(written) == 501
    assert {(e.key, e.value, e.timestamp, tuple(e.headers.items())) for e in written} == source
    # keys are routed by the output stream's own key ranges: one key, one segment
    assert len({(e.key, e.segment) for e in written}) == len({e.key for e in written})
    last = client.last_commit(f"spark:{query.id}")
    assert last is not None
    assert last.metadata == {"query": query.id, "batch": 2, "events": 101}
    assert client.transactions() == []  # nothing left staged


def test_struct_values_are_written_as_json(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/in", segments=1)
    client.create_stream("t/out", segments=1)
    produce_json(client, "t/in", 20)
    query = (
        spark.readStream.format("slipstream")
        .option("broker", broker.address)
        .option("stream", "t/in")
        .option("startingPosition", "earliest")
        .option("schema", "n INT")
        .load()
        .selectExpr(
            "CAST(n % 3 AS STRING) AS key", "named_struct('n', n, 'double', n * 2) AS value"
        )
        .writeStream.format("slipstream")
        .option("broker", broker.address)
        .option("stream", "t/out")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    written = sorted(json.loads(e.value)["n"] for e in events(client, "t/out"))
    assert written == list(range(20))
    assert {json.loads(e.value)["double"] for e in events(client, "t/out")} == {
        2 * n for n in range(20)
    }


def writer(broker: BrokerProcess, stream: str) -> StreamWriter:
    """The sink's driver side as Spark creates it for a batch: a new object every time."""
    schema = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
    return StreamWriter({"broker": broker.address, "stream": stream}, schema, False)


def stage(broker: BrokerProcess, stream: str, query: str, batch: int, rows: int) -> StagedPartition:
    """What one task's write() does for batch ``batch`` of query ``query``."""
    data = pa.RecordBatch.from_pydict(
        {
            "key": [f"k{i}" for i in range(rows)],
            "value": [b"%d/%d" % (batch, i) for i in range(rows)],
        }
    )
    return writer(broker, stream).stage(iter([data]), query, f"spark:{query}:{batch}:0")


def test_a_batch_committed_twice_or_rerun_changes_nothing(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    client.create_stream("t/out", segments=2)
    first = [stage(broker, "t/out", "q1", 0, 10), stage(broker, "t/out", "q1", 0, 5)]
    writer(broker, "t/out").commit(list(first), 0)
    assert len(events(client, "t/out")) == 15
    # Spark crashed inside commit(0): after the restart it re-runs batch 0 and commits it again
    again = [stage(broker, "t/out", "q1", 0, 10), stage(broker, "t/out", "q1", 0, 5)]
    writer(broker, "t/out").commit(list(again), 0)
    writer(broker, "t/out").commit(list(first), 0)  # and the very same messages once more
    assert len(events(client, "t/out")) == 15
    assert client.transactions() == []  # the repeated staging was aborted, not left behind
    # the next batch goes through, and a new query (new checkpoint) starts its own count
    writer(broker, "t/out").commit([stage(broker, "t/out", "q1", 1, 3)], 1)
    writer(broker, "t/out").commit([stage(broker, "t/out", "q2", 0, 4)], 0)
    assert len(events(client, "t/out")) == 22
    assert client.last_commit("spark:q1").metadata == {"query": "q1", "batch": 1, "events": 3}


def test_staged_data_of_crashed_and_aborted_batches_is_removed(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    client.create_stream("t/out", segments=1)
    # a task of a run that crashed before its driver committed
    orphan = stage(broker, "t/out", "q1", 4, 7)
    other_query = stage(broker, "t/out", "q9", 4, 1)
    assert {t.txn_id for t in client.transactions()} == {orphan.txn_id, other_query.txn_id}
    writer(broker, "t/out").commit([stage(broker, "t/out", "q1", 4, 2)], 4)
    assert [t.txn_id for t in client.transactions()] == [other_query.txn_id]
    assert [e.value for e in events(client, "t/out")] == [b"4/0", b"4/1"]
    # Spark aborts a batch it gives up on (e.g. a graceful stop mid-batch)
    writer(broker, "t/out").abort([other_query, None], 4)
    assert client.transactions() == []
    assert len(events(client, "t/out")) == 2


def test_batch_write_is_atomic_and_append_only(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client
) -> None:
    client.create_stream("t/backfill", segments=2)
    rows = [(f"k{i}", json.dumps({"n": i})) for i in range(1000)]
    df = spark.createDataFrame(rows, "key STRING, value STRING").repartition(4)
    df.write.format("slipstream").option("broker", broker.address).option(
        "stream", "t/backfill"
    ).mode("append").save()
    written = events(client, "t/backfill")
    assert sorted(json.loads(e.value)["n"] for e in written) == list(range(1000))
    assert client.transactions() == []
    with pytest.raises(PySparkException, match="append-only"):
        df.write.format("slipstream").option("broker", broker.address).option(
            "stream", "t/backfill"
        ).mode("overwrite").save()


def test_bad_sink_input_gets_clear_errors(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client
) -> None:
    client.create_stream("t/out", segments=1)
    base = spark.createDataFrame([("a", "b")], "key STRING, payload STRING")
    sink = base.write.format("slipstream").option("broker", broker.address).mode("append")
    with pytest.raises(PySparkException, match="needs a 'value' column"):
        sink.option("stream", "t/out").save()
    renamed = base.withColumnRenamed("payload", "value")
    with pytest.raises(PySparkException, match="StreamNotFound"):
        renamed.write.format("slipstream").option("broker", broker.address).option(
            "stream", "t/nowhere"
        ).mode("append").save()
    nulls = spark.createDataFrame([("a", None)], "key STRING, value STRING")
    with pytest.raises(PySparkException, match="has nulls"):
        nulls.write.format("slipstream").option("broker", broker.address).option(
            "stream", "t/out"
        ).mode("append").save()
    time.sleep(0.2)
    assert client.transactions() == []  # failed tasks aborted what they had staged
    assert events(client, "t/out") == []
