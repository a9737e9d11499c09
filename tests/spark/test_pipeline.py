"""The auctions example (examples/auctions) on real Spark and a real broker: event time,
watermarks, the stateful step, and the chain of two jobs."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random
from pathlib import Path

from auctions import pipeline
from auctions.app import replay_job, windows_of
from conftest import BrokerProcess
from pyspark.sql import SparkSession

import slipstream

T0 = 1_795_000_000_000  # ms; a multiple of 10 s, so windows start at T0 + k * 10 s


def bid(auction: str, price: float) -> bytes:
    return json.dumps({"auction": auction, "bidder": "u1", "price": price}).encode()


def read_all(client: slipstream.Client, stream: str) -> list[dict]:
    with client.reader(stream, "earliest", end=client.tail(stream)) as reader:
        return [json.loads(e.value) for e in reader]


def recompute_windows(spark: SparkSession, broker: BrokerProcess) -> dict[tuple[str, str], dict]:
    """Job 1's windows computed in one batch query over the whole bids history."""
    history = (
        spark.read.format("slipstream")
        .option("broker", broker.address)
        .option("stream", pipeline.BIDS)
        .option("schema", pipeline.BID_SCHEMA)
        .load()
    )
    rows = pipeline.window_stats(history).select("value").collect()
    return {(w["auction"], w["start"]): w for w in (json.loads(r.value) for r in rows)}


def run_windows(
    spark: SparkSession, broker: BrokerProcess, tmp_path: Path, per_batch: int
) -> list[int]:
    """Job 1 over everything there is, ``per_batch`` bids per micro-batch; the rows per batch."""
    query = pipeline.start_windows(
        spark,
        broker.address,
        str(tmp_path / "windows"),
        source={"maxEventsPerTrigger": str(per_batch)},
        trigger={"availableNow": True},
    )
    query.awaitTermination(180)
    assert query.exception() is None
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def test_late_bids_count_only_while_the_watermark_allows(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    """Spark (3.4 and later) drops a row as late when it is behind the watermark of the batch
    *before* the current one, and closes (emits and forgets) windows whose end is at or behind
    the current batch's watermark; each batch's watermark is the largest event time seen in
    earlier batches minus the delay (5 s here)."""
    pipeline.create_streams(client, segments=1)
    # event times in seconds after T0 (the price is the same number); one segment keeps order
    batches = [
        [1, 2, 3, 12],  # -> watermark 7 s for the next batch
        [4, 31, 32, 33],  # 4 is behind 7 but rows are dropped by the previous batch's (0): kept
        [35, 36, 37, 38],  # watermark 28: windows [0, 10) and [10, 20) close
        [15, 9, 39, 47],  # 15 and 9 are behind the previous batch's watermark (28): dropped
        [70, 71, 72, 73],  # watermark 42: [30, 40) closes; afterwards 68: [40, 50) closes
    ]
    with client.producer(pipeline.BIDS) as producer:
        for seconds in (s for batch in batches for s in batch):
            producer.send(bid("a1", float(seconds)), key="a1", timestamp=T0 + seconds * 1000)
    assert run_windows(spark, broker, tmp_path, per_batch=4) == [4] * len(batches)
    windows = {(w["start"], w["bids"], w["max_price"]) for w in read_all(client, pipeline.WINDOWS)}
    start = dt.datetime.fromtimestamp(T0 / 1000, dt.UTC)

    def at(seconds: int) -> str:
        return (start + dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    assert windows == {
        (at(0), 4, 4.0),
        (at(10), 1, 12.0),
        (at(30), 8, 39.0),
        (at(40), 1, 47.0),
    }  # [70, 80) is still open: its end is ahead of the last watermark (68 s)


def test_streaming_windows_equal_a_batch_recomputation_and_chain_into_price_moves(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    pipeline.create_streams(client, segments=3)
    rnd = random.Random(7)
    generator = pipeline.BidGenerator(auctions=6, seed=3)
    with client.producer(pipeline.BIDS) as producer:
        for i in range(3000):
            key, value, _ = generator.next(0)
            # 10 ms apart, up to 3 s late: always inside the 5 s watermark
            producer.send(value, key=key, timestamp=T0 + i * 10 - rnd.randint(0, 3000))
    run_windows(spark, broker, tmp_path, per_batch=700)
    streamed = {(w["auction"], w["start"]): w for w in read_all(client, pipeline.WINDOWS)}
    assert len(streamed) >= 6 * 2

    recomputed = recompute_windows(spark, broker)
    last_end = max(w["end"] for w in streamed.values())
    closed = {k: w for k, w in recomputed.items() if w["end"] <= last_end}
    assert streamed == closed

    # job 2, chained on job 1's output: each window's move, exactly once, with correct state
    query = pipeline.start_prices(
        spark, broker.address, str(tmp_path / "prices"), trigger={"availableNow": True}
    )
    query.awaitTermination(180)
    assert query.exception() is None
    moves = read_all(client, pipeline.PRICE_MOVES)
    assert len(moves) == len(streamed)
    by_auction: dict[str, list[dict]] = {}
    for move in moves:
        by_auction.setdefault(move["auction"], []).append(move)
    for auction, rows in by_auction.items():
        rows.sort(key=lambda m: m["end"])
        expected = sorted(
            (w for (a, _), w in streamed.items() if a == auction), key=lambda w: w["end"]
        )
        assert [m["max_price"] for m in rows] == [w["max_price"] for w in expected]
        for before, after in itertools.pairwise(rows):
            assert after["previous"] == before["max_price"]
            change = (after["max_price"] - before["max_price"]) / before["max_price"] * 100
            assert after["change_pct"] == round(change, 1)
            assert after["alert"] == (change >= 25)


def test_replaying_a_new_version_over_history_recovers_the_bids_version_one_dropped(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    """The replay workflow: version 2 (watermark 15 s) over the whole history into its own
    stream, compared window by window with version 1 (5 s)."""
    pipeline.create_streams(client, segments=2)
    rnd = random.Random(11)
    generator = pipeline.BidGenerator(auctions=4, seed=5)
    late = 0
    with client.producer(pipeline.BIDS) as producer:
        for i in range(3000):  # 30 s of bids; in the first 15 s, 5 % come 8-12 s late
            key, value, _ = generator.next(0)
            delay = rnd.randint(8000, 12000) if i < 1500 and rnd.random() < 0.05 else 0
            late += delay > 0
            producer.send(value, key=key, timestamp=T0 + i * 10 - delay)
    run_windows(spark, broker, tmp_path, per_batch=300)  # version 1, as the live job ran it

    v2 = pipeline.WindowJob(watermark="15 seconds", output="auctions/windows-v2")
    result = replay_job(spark, broker.address, client, v2, tmp_path / "v2")

    everything = recompute_windows(spark, broker)
    old, new = windows_of(client, pipeline.WINDOWS), windows_of(client, v2.output)
    # version 2 drops nothing (no bid is 15 s late): every window it closed is the full truth
    assert result.horizon == max(w["end"] for w in new.values())
    assert new == {k: w for k, w in everything.items() if w["end"] <= result.horizon}
    assert result.compared == len(new) and not result.only_v1 and not result.only_v2
    assert result.same + len(result.differ) == result.compared
    # version 1 dropped some late bids, never counted one version 2 did not
    assert 0 < result.bids_v2 - result.bids_v1 <= late
    for d in result.differ:
        assert d["bids"][0] < d["bids"][1]
        assert old[(d["auction"], d["start"])]["bids"] == d["bids"][0]
    assert result.bids_v2 == sum(new[k]["bids"] for k in new)
