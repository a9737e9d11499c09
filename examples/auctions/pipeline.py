"""Live auctions: a real-time pipeline on slipstream and Spark, in two chained jobs.

    bids (auctions/bids)                 JSON {"auction", "bidder", "price"}, keyed by auction,
      |                                  event time = when the bid was placed (some arrive late)
      |  job 1 "windows": 10 s tumbling windows per auction with a 5 s watermark
      v
    auctions/windows                     one event per closed window: bids, max and mean price
      |
      |  job 2 "prices": per-auction state (applyInPandasWithState) tracks the price from
      v                  window to window and flags jumps of 25 % or more
    auctions/price-moves                 one event per window: previous max, change, alert

Both jobs read with the ``slipstream`` source and write with its transactional sink, each from
its own checkpoint: every window is written exactly once, and job 2 sees each window exactly
once, across crashes and restarts of either job or of the broker.

Everything here uses public APIs only (``slipstream`` and ``slipstream.spark``).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

import slipstream

BIDS = "auctions/bids"
WINDOWS = "auctions/windows"
PRICE_MOVES = "auctions/price-moves"
BID_SCHEMA = "auction STRING, bidder STRING, price DOUBLE"
WINDOW_SCHEMA = (
    "auction STRING, start TIMESTAMP, end TIMESTAMP, bids BIGINT, max_price DOUBLE, "
    "mean_price DOUBLE"
)
MOVE_SCHEMA = (
    "auction STRING, end TIMESTAMP, max_price DOUBLE, previous DOUBLE, change_pct DOUBLE, "
    "alert BOOLEAN"
)
JUMP = 0.25  # a window's top bid 25 % above the previous window's: an alert

#: the consumer group that acts on price moves (a subscription of PRICE_MOVES), and the
#: subscriptions in which the live jobs record their progress (the source's "subscription"
#: option), so that one ``describe_subscription`` shows every consumer's backlog and lag
NOTIFIER = "notifier"
WINDOWS_JOB = "windows-job"
PRICES_JOB = "prices-job"

# Spark's Python workers run track_prices. Shipping this module by value (not as an import by
# name) lets the example run from a checkout without being installed where the workers look.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class WindowJob:
    """Job 1, as a versioned definition: a new version (say a longer watermark) can be replayed
    over the whole history into its own output stream and compared with this one."""

    window: str = "10 seconds"
    watermark: str = "5 seconds"
    output: str = WINDOWS


def create_streams(
    client: slipstream.Client, segments: int = 4, outputs: tuple[str, ...] = ()
) -> None:
    """The pipeline's streams and the notifier's subscription (existing ones are left as
    they are). The subscription exists before job 2 writes a price move, so the notifier
    misses none, even those written before its first member joins (on a data directory from
    before the notifier, "earliest" makes it act once on the alerts already there)."""
    for name in (BIDS, WINDOWS, PRICE_MOVES, *outputs):
        with contextlib.suppress(slipstream.StreamExists):
            client.create_stream(name, segments=segments)
    client.create_subscription(PRICE_MOVES, NOTIFIER, "earliest", exist_ok=True)


def read(spark: SparkSession, broker: str, stream: str, schema: str, **options: str) -> DataFrame:
    reader = (
        spark.readStream.format("slipstream")
        .option("broker", broker)
        .option("stream", stream)
        .option("startingPosition", "earliest")
        .option("schema", schema)
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def window_stats(bids: DataFrame, job: WindowJob = WindowJob()) -> DataFrame:
    """Bids per auction per event-time window. Bids later than the watermark are dropped, as
    Spark documents; a window is emitted once, when the watermark passes its end."""
    windows = (
        bids.withWatermark("timestamp", job.watermark)
        .groupBy(F.window("timestamp", job.window).alias("window"), "auction")
        .agg(
            F.count("*").alias("bids"),
            F.max("price").alias("max_price"),
            F.round(F.avg("price"), 2).alias("mean_price"),
        )
    )
    return windows.select(
        F.col("auction").alias("key"),
        F.to_json(
            F.struct(
                "auction",
                F.col("window.start").alias("start"),
                F.col("window.end").alias("end"),
                "bids",
                "max_price",
                "mean_price",
            )
        ).alias("value"),
        F.col("window.end").alias("timestamp"),  # a window's event time is its end
    )


def track_prices(
    key: tuple[Any, ...], frames: Iterator[pd.DataFrame], state: GroupState
) -> Iterator[pd.DataFrame]:
    """Per auction: compare each closed window's top bid with the previous window's."""
    (previous,) = state.get if state.exists else (math.nan,)
    rows = pd.concat(list(frames)).sort_values("end")
    moves = []
    for window in rows.itertuples():
        change = (window.max_price - previous) / previous * 100 if previous == previous else 0.0
        moves.append(
            {
                "auction": key[0],
                "end": window.end,
                "max_price": window.max_price,
                "previous": previous,
                "change_pct": round(change, 1),
                "alert": change >= JUMP * 100,
            }
        )
        previous = window.max_price
    state.update((previous,))
    yield pd.DataFrame(moves)


def price_moves(windows: DataFrame) -> DataFrame:
    moves = (
        windows.select("auction", "end", "max_price")
        .groupBy("auction")
        .applyInPandasWithState(
            track_prices, MOVE_SCHEMA, "previous DOUBLE", "append", GroupStateTimeout.NoTimeout
        )
    )
    return moves.select(
        F.col("auction").alias("key"),
        F.to_json(F.struct(*moves.columns)).alias("value"),
        F.col("end").alias("timestamp"),
    )


def write(
    df: DataFrame,
    broker: str,
    stream: str,
    checkpoint: str,
    *,
    trigger: dict[str, Any] | None = None,
) -> StreamingQuery:
    writer = (
        df.writeStream.format("slipstream")
        .option("broker", broker)
        .option("stream", stream)
        .option("checkpointLocation", checkpoint)
        .outputMode("append")
        .trigger(**(trigger or {"processingTime": "1 second"}))
    )
    return writer.queryName(stream.replace("/", "_").replace("-", "_")).start()


def start_windows(
    spark: SparkSession, broker: str, checkpoint: str, job: WindowJob = WindowJob(), **kw: Any
) -> StreamingQuery:
    """Job 1: bids -> windows."""
    bids = read(spark, broker, BIDS, BID_SCHEMA, **kw.pop("source", {}))
    return write(window_stats(bids, job), broker, job.output, checkpoint, **kw)


def start_prices(spark: SparkSession, broker: str, checkpoint: str, **kw: Any) -> StreamingQuery:
    """Job 2: windows -> price moves (chained on job 1's output stream).

    Read job 1's micro-batches whole: no ``maxEventsPerTrigger`` here. Between job 1's
    batches an auction's windows are in end order (the watermark only moves forward), but
    within one batch they are not (different tasks write them, merged in one commit), and
    track_prices can sort only what one of its own batches brings. A limit could split a job 1
    batch and hand track_prices a window older than its state."""
    windows = read(spark, broker, WINDOWS, WINDOW_SCHEMA, **kw.pop("source", {}))
    return write(price_moves(windows), broker, PRICE_MOVES, checkpoint, **kw)


# --- the bids ---------------------------------------------------------------------------------


class BidGenerator:
    """Realistic bids: a few hot auctions and a long tail; each auction's price wanders around
    its own level (bids up to 1.5 % apart, pulled back toward the level by ``REVERSION`` of the
    gap at each bid, in log terms: a mean-reverting walk that stays within a band for ever) and
    now and then jumps 30-60 % (a bidding war: what job 2 flags; it fades again over a few dozen
    bids). Network reality: 8 % of bids arrive 0.5-4 s late (inside the watermark) and 1 %
    arrive 8-20 s late (after it: Spark drops them from windows)."""

    #: share of the log gap between an auction's price and its level closed at each of its bids
    REVERSION = 0.02

    def __init__(self, auctions: int = 40, seed: int | None = None) -> None:
        self.random = random.Random(seed)
        self.levels = {f"a{i:03d}": 10.0 + 5 * i for i in range(auctions)}
        self.prices = dict(self.levels)  # unrounded: rounding each step would add a drift
        self.names = list(self.prices)
        self.weights = [1 / (i + 1) for i in range(auctions)]

    def next(self, now_ms: int) -> tuple[str, bytes, int]:
        """(key, JSON value, event time in ms) of the next bid."""
        rnd = self.random
        auction = rnd.choices(self.names, self.weights)[0]
        jump = rnd.uniform(1.3, 1.6) if rnd.random() < 0.002 else rnd.uniform(0.985, 1.015)
        gap = math.log(self.levels[auction] / self.prices[auction])
        self.prices[auction] *= jump * math.exp(self.REVERSION * gap)
        lateness = rnd.random()
        if lateness < 0.01:
            now_ms -= rnd.randint(8_000, 20_000)
        elif lateness < 0.09:
            now_ms -= rnd.randint(500, 4_000)
        value = (
            f'{{"auction": "{auction}", "bidder": "u{rnd.randint(1, 500)}", '
            f'"price": {round(self.prices[auction], 2)}}}'
        )
        return auction, value.encode(), now_ms


def generate(
    client: slipstream.Client, rate: float, stop: Any, counter: list[int] | None = None
) -> None:
    """Send ``rate`` bids per second until ``stop.is_set()`` (a threading.Event)."""
    generator = BidGenerator()
    with client.producer(BIDS, linger_ms=5) as producer:
        started = time.monotonic()
        sent = 0
        while not stop.is_set():
            due = int((time.monotonic() - started) * rate) - sent
            if due <= 0:
                time.sleep(min(0.01, 1 / rate))
                continue
            now_ms = time.time_ns() // 1_000_000
            for _ in range(min(due, 10_000)):
                key, value, ts = generator.next(now_ms)
                producer.send(value, key=key, timestamp=ts)
            sent += min(due, 10_000)
            if counter is not None:
                counter[0] = sent
