"""The slipstream source in real Spark against a real broker: streaming and batch reads."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import BrokerProcess, produce_json
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

import slipstream
from slipstream import StreamCut
from slipstream.spark import _source
from slipstream.spark._source import SubscriptionProgress


def read_stream(spark: SparkSession, broker: BrokerProcess, stream: str, **options: Any) -> Any:
    reader = spark.readStream.format("slipstream").option("broker", broker.address)
    for key, value in {"stream": stream, **options}.items():
        reader = reader.option(key, str(value))
    return reader.load()


def read_batch(
    spark: SparkSession, broker: BrokerProcess, stream: str, **options: Any
) -> DataFrame:
    reader = spark.read.format("slipstream").option("broker", broker.address)
    for key, value in {"stream": stream, **options}.items():
        reader = reader.option(key, str(value))
    return reader.load()


def run_available_now(df: DataFrame, tmp_path: Path, name: str) -> tuple[StreamingQuery, list[Any]]:
    """Run to the current end with Trigger.AvailableNow into a Parquet sink (exactly-once
    and restartable, unlike the memory sink); returns the query and all rows written so far."""
    query = (
        df.writeStream.format("parquet")
        .option("path", str(tmp_path / name / "out"))
        .option("checkpointLocation", str(tmp_path / name / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    return query, df.sparkSession.read.parquet(str(tmp_path / name / "out")).collect()


def test_stream_from_earliest_with_admission_control(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/orders", segments=3)
    produce_json(client, "t/orders", 1000)
    df = read_stream(
        spark, broker, "t/orders", startingPosition="earliest", maxEventsPerTrigger=300
    )
    query, rows = run_available_now(df, tmp_path, "admission")
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [300, 300, 300, 100]
    assert sorted(json.loads(r.value)["n"] for r in rows) == list(range(1000))
    # per segment, offsets are contiguous and in order; keys stay on their segment
    by_segment: dict[int, list[int]] = {}
    for row in rows:
        by_segment.setdefault(row.segment, []).append(row.offset)
        assert row.stream == "t/orders"
        assert row.timestamp.tzinfo is None or row.timestamp.utcoffset() == dt.timedelta(0)
    for offsets in by_segment.values():
        assert sorted(offsets) == list(range(len(offsets)))
    # a restart from the checkpoint reads only what is new
    produce_json(client, "t/orders", 10, start=1000)
    _, rows = run_available_now(df, tmp_path, "admission")
    assert sorted(json.loads(r.value)["n"] for r in rows) == list(range(1010))


def test_max_bytes_per_trigger(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/bytes", segments=1)
    with client.producer("t/bytes") as producer:
        for _ in range(200):
            producer.send(os.urandom(1000))  # incompressible: stored bytes = sent bytes
    df = read_stream(
        spark, broker, "t/bytes", startingPosition="earliest", maxBytesPerTrigger=50_000
    )
    query, rows = run_available_now(df, tmp_path, "bytes")
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert len(rows) == 200
    assert len(sizes) >= 4 and max(sizes) <= 50  # about 50 KB of ~1 KB events per batch


def test_live_stream_sees_new_events(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/live", segments=2)
    produce_json(client, "t/live", 5)  # before the query: not read from "latest"
    df = read_stream(spark, broker, "t/live", schema="n INT")
    query = (
        df.writeStream.format("memory")
        .queryName("live")
        .option("checkpointLocation", str(tmp_path / "live"))
        .start()
    )
    try:
        deadline = time.monotonic() + 60
        while not query.recentProgress and time.monotonic() < deadline:
            time.sleep(0.2)
        produce_json(client, "t/live", 20, start=100)
        while time.monotonic() < deadline:
            got = sorted(r.n for r in spark.sql("SELECT n FROM live").collect())
            if len(got) >= 20:
                break
            time.sleep(0.2)
        assert got == list(range(100, 120))
    finally:
        query.stop()


def test_starting_positions_time_and_cut(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/pos", segments=2)
    produce_json(client, "t/pos", 10)
    middle = client.tail("t/pos")
    time.sleep(0.05)
    since = dt.datetime.now(dt.UTC)
    produce_json(client, "t/pos", 10, start=10)
    from_cut = read_stream(spark, broker, "t/pos", startingPosition=middle.to_json())
    _, rows = run_available_now(from_cut, tmp_path, "from_cut")
    assert sorted(json.loads(r.value)["n"] for r in rows) == list(range(10, 20))
    from_time = read_stream(spark, broker, "t/pos", startingPosition=since.isoformat())
    _, rows = run_available_now(from_time, tmp_path, "from_time")
    assert sorted(json.loads(r.value)["n"] for r in rows) == list(range(10, 20))


def test_batch_read_of_history_between_times_and_cuts(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client
) -> None:
    client.create_stream("t/history", segments=4)
    produce_json(client, "t/history", 100)
    time.sleep(0.05)
    start = dt.datetime.now(dt.UTC)
    produce_json(client, "t/history", 50, start=100)
    cut = client.tail("t/history")
    time.sleep(0.05)
    produce_json(client, "t/history", 25, start=150)
    whole = read_batch(spark, broker, "t/history", schema="n INT")
    assert sorted(r.n for r in whole.select("n").collect()) == list(range(175))
    between = read_batch(
        spark,
        broker,
        "t/history",
        schema="n INT",
        **{"from": start.isoformat(), "to": cut.to_json()},
    )
    assert sorted(r.n for r in between.select("n").collect()) == list(range(100, 150))
    # small partitions: the same events, split over more tasks
    split = read_batch(spark, broker, "t/history", maxEventsPerPartition=7)
    assert split.rdd.getNumPartitions() > 20
    assert split.count() == 175
    # SQL over history
    split.createOrReplaceTempView("history")
    per_key = spark.sql("SELECT CAST(key AS STRING) k, count(*) c FROM history GROUP BY k")
    assert {r.k: r.c for r in per_key.collect()} == {f"k{i}": 17 + (i < 5) for i in range(10)}


def test_json_schema_modes(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client
) -> None:
    client.create_stream("t/json", segments=1)
    produce_json(client, "t/json", 3, item="x")
    with client.producer("t/json") as producer:
        producer.send(b"{broken")
    rows = read_batch(spark, broker, "t/json", schema="n INT, item STRING").collect()
    assert [(r.n, r.item) for r in rows] == [(0, "x"), (1, "x"), (2, "x"), (None, None)]
    assert rows[3].value == b"{broken"  # the raw value stays readable
    failing = read_batch(spark, broker, "t/json", schema="n INT", mode="FAILFAST")
    with pytest.raises(PySparkException, match=r"MalformedValue|not JSON of the schema"):
        failing.collect()


def test_bad_input_gets_clear_errors(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    with pytest.raises(PySparkException, match=r"StreamNotFound|t/missing"):
        read_batch(spark, broker, "t/missing").collect()
    with pytest.raises(PySparkException, match='option "stream" is required'):
        spark.read.format("slipstream").option("broker", broker.address).load().collect()
    df = read_stream(spark, broker, "t/x", maxEventsPerTrigger="many")
    query = df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "b")).start()
    with pytest.raises(PySparkException, match="maxEventsPerTrigger must be a positive"):
        query.awaitTermination(60)
    with pytest.raises(PySparkException, match="already has"):
        read_batch(spark, broker, "t/x", schema="offset INT").collect()
    with pytest.raises(PySparkException, match=r"BrokerUnavailable|no broker|refused"):
        spark.read.format("slipstream").option("broker", "127.0.0.1:1").option(
            "stream", "t/x"
        ).load().collect()


def test_stream_deleted_under_a_running_query(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/doomed", segments=1)
    produce_json(client, "t/doomed", 10)
    df = read_stream(spark, broker, "t/doomed", startingPosition="earliest")
    query = (
        df.writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "doomed"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 60
        while not query.recentProgress and time.monotonic() < deadline:
            time.sleep(0.1)
        client.delete_stream("t/doomed")
        with pytest.raises(PySparkException, match=r"StreamNotFound: stream 't/doomed'"):
            query.awaitTermination(60)
    finally:
        query.stop()


def _end_offset(query: StreamingQuery) -> dict[int, int]:
    """The positions a query has committed (the end of its last completed micro-batch)."""
    progress = query.lastProgress
    if not progress or not progress["sources"][0].get("endOffset"):
        return {}
    end = progress["sources"][0]["endOffset"]
    cut = json.loads(end) if isinstance(end, str) else end
    return {int(s): int(o) for s, o in cut["positions"].items()}


def _recorded(client: slipstream.Client, stream: str, name: str) -> dict[int, int]:
    info = client.describe_subscription(stream, name)
    return {s.segment: s.position for s in info.segments}


def test_subscription_option_records_the_query_s_committed_progress(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/lag", segments=2)
    produce_json(client, "t/lag", 50)
    df = read_stream(
        spark,
        broker,
        "t/lag",
        startingPosition="earliest",
        maxEventsPerTrigger=20,
        subscription="spark-job",
    )

    def start() -> StreamingQuery:
        return (
            df.writeStream.format("noop")
            .option("checkpointLocation", str(tmp_path / "lag"))
            .start()
        )

    def caught_up(query: StreamingQuery, events: int) -> dict[int, int]:
        """Wait until the query committed ``events`` events and the subscription says so."""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert query.exception() is None
            end = _end_offset(query)
            if sum(end.values()) == events and _recorded(client, "t/lag", "spark-job") == end:
                return end
            time.sleep(0.2)
        raise AssertionError(
            f"committed {_end_offset(query)}, recorded {_recorded(client, 't/lag', 'spark-job')}"
        )

    query = start()
    try:
        # missing before: created at the query's start and then moved with each batch
        assert caught_up(query, 50) == client.tail("t/lag").positions
        assert len([p for p in query.recentProgress if p["numInputRows"]]) >= 3
        info = client.describe_subscription("t/lag", "spark-job")
        assert [s.backlog_events for s in info.segments] == [0, 0]
        assert not info.members  # a mirror of Spark's checkpoint, not a group member
        produce_json(client, "t/lag", 30, start=50)
        caught_up(query, 80)
    finally:
        query.stop()
    produce_json(client, "t/lag", 5, start=80)  # while the query is stopped: a backlog of 5
    # the CLI shows the stopped job's backlog like any consumer's
    command = ["subscription", "describe", "t/lag", "spark-job", "--json", "--broker"]
    described = subprocess.run(
        [sys.executable, "-m", "slipstream", *command, broker.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(described.stdout)
    assert report["backlog_events"] == 5 and report["lag_ms"] > 0
    # a consumer group using the subscription: the query refuses to start, saying why
    with client.consumer("t/lag", "spark-job", name="billing-1"):
        query = start()
        with pytest.raises(PySparkException, match=r"GroupActive.*billing-1"):
            query.awaitTermination(60)
    # the group gone, the restarted query continues from its checkpoint and records again
    query = start()
    try:
        caught_up(query, 85)
    finally:
        query.stop()


def test_a_failed_progress_record_is_logged_and_tried_again_never_raised(
    client: slipstream.Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SubscriptionProgress alone (what the planner calls after each batch), on a real broker."""
    client.create_stream("t/rec", segments=2)
    produce_json(client, "t/rec", 20)
    cut = client.tail("t/rec")
    progress = SubscriptionProgress("t/rec", "job")
    progress.record(client, StreamCut("t/rec", {0: 0, 1: 0}))  # claims: creates it there
    assert _recorded(client, "t/rec", "job") == {0: 0, 1: 0}
    with client.consumer("t/rec", "job", commit="manual"):  # a group joined meanwhile
        progress.record(client, cut)  # refused with GroupActive: logged, not raised
        assert "GroupActive" in caplog.text
        assert _recorded(client, "t/rec", "job") == {0: 0, 1: 0}
    progress.record(client, cut)  # too soon after the failure: not tried
    assert _recorded(client, "t/rec", "job") == {0: 0, 1: 0}
    monkeypatch.setattr(_source, "RECORD_RETRY_S", 0.0)
    progress.record(client, cut)  # with a later batch: stored
    assert _recorded(client, "t/rec", "job") == cut.positions
    client.delete_subscription("t/rec", "job")
    produce_json(client, "t/rec", 10, start=20)
    later = client.tail("t/rec")
    progress.record(client, later)  # deleted under the query: created again, at its progress
    assert _recorded(client, "t/rec", "job") == later.positions
    refused = pytest.raises(slipstream.GroupActive, match="stop them, or name another")
    with client.consumer("t/rec", "job", commit="manual"), refused:  # a new query's claim
        SubscriptionProgress("t/rec", "job").claim(client, later)
