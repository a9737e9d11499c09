"""The slipstream source over scaled streams, in real Spark against a real broker: every event
once and every key's events in order (by batch, then ``(segment, offset)``) for a query that
reads while the stream is split and merged, for Trigger.AvailableNow and for batch reads."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from conftest import BrokerProcess
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

import slipstream
from slipstream.streams import key_hash

KEYS = 16


def produce_keyed(
    client: slipstream.Client,
    stream: str,
    sent: dict[str, int],
    count: int,
    keys: list[str] | None = None,
) -> None:
    """``count`` events ``{"k": key, "n": i}``, ``i`` counting per key from 0 (in ``sent``),
    keys ``k0 .. k15`` in turn (or ``keys``)."""
    keys = keys or [f"k{i}" for i in range(KEYS)]
    with client.producer(stream) as producer:
        for i in range(count):
            key = keys[i % len(keys)]
            n = sent.get(key, 0)
            producer.send(json.dumps({"k": key, "n": n}).encode(), key=key)
            sent[key] = n + 1


def read_stream(spark: SparkSession, broker: BrokerProcess, stream: str, **options: Any) -> Any:
    reader = spark.readStream.format("slipstream").option("broker", broker.address)
    for key, value in {"stream": stream, "schema": "k STRING, n INT", **options}.items():
        reader = reader.option(key, str(value))
    return reader.load()


class BatchLog:
    """A foreachBatch sink keeping ``(batch, segment, offset, key, n)`` of every row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        got = [(batch_id, r.segment, r.offset, r.k, r.n) for r in df.collect()]
        with self.lock:
            self.rows.extend(got)

    def count(self) -> int:
        with self.lock:
            return len(self.rows)


def check_once_and_in_order(
    rows: list[tuple[int, int, int, str, int]], sent: dict[str, int]
) -> None:
    """Every event once; per key, ordering by (batch, segment, offset) gives append order."""
    per_key: dict[str, list[tuple[int, int, int, int]]] = {}
    for batch, segment, offset, key, n in rows:
        per_key.setdefault(key, []).append((batch, segment, offset, n))
    assert sorted(per_key) == sorted(sent)
    for key, events in per_key.items():
        ordered = [n for *_, n in sorted(events)]
        assert ordered == list(range(sent[key])), f"{key}: {sorted(events)}"


def wait_for(query: StreamingQuery, log: BatchLog, total: int) -> None:
    deadline = time.monotonic() + 180
    while log.count() < total and time.monotonic() < deadline:
        assert query.exception() is None
        time.sleep(0.2)


def test_a_query_reading_while_the_stream_splits_and_merges(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    """Small batches make the query lag behind the scales, so predecessors still hold unread
    events when their successors already do: a plan that read a successor before its
    predecessors' ends were in the batch would deliver a key's later events first."""
    client.create_stream("t/elastic", segments=2)
    sent: dict[str, int] = {}
    produce_keyed(client, "t/elastic", sent, 200)
    log = BatchLog()
    df = read_stream(
        spark,
        broker,
        "t/elastic",
        startingPosition="earliest",
        maxEventsPerTrigger=45,
        subscription="spark-elastic",
    )
    query = (
        df.writeStream.foreachBatch(log)
        .option("checkpointLocation", str(tmp_path / "elastic"))
        .start()
    )
    try:
        client.scale_stream("t/elastic", split=0)  # 2, 3
        produce_keyed(client, "t/elastic", sent, 200)
        client.scale_stream("t/elastic", split=1)  # 4, 5
        produce_keyed(client, "t/elastic", sent, 200)
        client.scale_stream("t/elastic", merge=[3, 4])  # 6
        produce_keyed(client, "t/elastic", sent, 200)
        client.scale_stream("t/elastic", split=6)  # 7, 8
        produce_keyed(client, "t/elastic", sent, 100)
        wait_for(query, log, 900)
        time.sleep(1)  # a duplicate would arrive in a later batch
        assert query.exception() is None
        check_once_and_in_order(log.rows, sent)
        batches = {batch for batch, *_ in log.rows}
        assert len(batches) >= 20  # small batches: the query lagged behind the scales
        assert {segment for _, segment, *_ in log.rows} == set(range(9))
        # the subscription records the committed cut, successors included
        tail = client.tail("t/elastic").positions
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = client.describe_subscription("t/elastic", "spark-elastic")
            recorded = {s.segment: s.position for s in info.segments}
            if recorded == tail:
                break
            time.sleep(0.2)
        assert recorded == tail
    finally:
        query.stop()


def test_history_over_scales_available_now_and_batch_reads(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    client.create_stream("t/grown", segments=1)
    sent: dict[str, int] = {}
    produce_keyed(client, "t/grown", sent, 120)
    info = client.scale_stream("t/grown", split=0, into=3)  # 1, 2, 3
    # nothing for segment 1 until the merge: sealed empty, it must not let 4 overtake 2
    one = next(s for s in info.segments if s.number == 1)
    elsewhere = [
        f"k{i}" for i in range(KEYS) if not one.key_lo <= key_hash(b"k%d" % i) <= one.key_hi
    ]
    produce_keyed(client, "t/grown", sent, 150, elsewhere)
    before = client.tail("t/grown")
    before_sent = dict(sent)
    client.scale_stream("t/grown", merge=[1, 2])  # 4
    produce_keyed(client, "t/grown", sent, 150)
    client.scale_stream("t/grown", merge=[3, 4])  # 5
    produce_keyed(client, "t/grown", sent, 80)

    # Trigger.AvailableNow in small batches: every event once, each key in order
    log = BatchLog()
    df = read_stream(spark, broker, "t/grown", startingPosition="earliest", maxEventsPerTrigger=60)
    query = (
        df.writeStream.foreachBatch(log)
        .option("checkpointLocation", str(tmp_path / "now"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None
    check_once_and_in_order(log.rows, sent)
    assert len({batch for batch, *_ in log.rows}) >= 500 // 60

    # a batch read of the whole history: once, and per key in (segment, offset) order
    def read_batch(**options: str) -> list[Any]:
        reader = spark.read.format("slipstream").options(
            broker=broker.address, stream="t/grown", schema="k STRING, n INT", **options
        )
        return reader.load().collect()

    rows = [(0, r.segment, r.offset, r.k, r.n) for r in read_batch()]
    check_once_and_in_order(rows, sent)
    # from a cut taken before the merges: the rest of the old segments, then their successors
    since = read_batch(**{"from": before.to_json()})
    later = [(0, r.segment, r.offset, r.k, r.n - before_sent[r.k]) for r in since]
    check_once_and_in_order(later, {k: sent[k] - before_sent[k] for k in sent})
    # up to that cut: nothing of the segments opened after it
    until = read_batch(to=before.to_json())
    check_once_and_in_order([(0, r.segment, r.offset, r.k, r.n) for r in until], before_sent)
