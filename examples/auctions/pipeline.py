"""Live auctions: a real-time pipeline on slipstream and Spark, in two chained jobs.

    bids (auctions/bids)                 JSON {"auction", "bidder", "price"}, keyed by auction,
      |                                  event time = when the bid was placed (some arrive late);
      |                                  an elastic stream: its segments split in a rush hour
      |                                  and merge again when it is quiet
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
from dataclasses import dataclass, field
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

#: bids per second that one segment of the bids stream should carry: the rush hour (5 x this)
#: splits it, the quiet phase (0.3 x) lets the pieces merge again (docs/scaling.md has the rule).
#: Measured on a 2-core machine shared with other work: the generator alone makes 80,000-
#: 100,000 bids/s and holds 5,000/s exactly; in a 5,000/s rush job 1 runs 3-7 s of bids
#: behind (not growing) and is back within a batch of the tail once the rush is over
DEFAULT_TARGET = 1000
#: the most segments the bids stream may have (the Spark job reads each in its own task)
MAX_BID_SEGMENTS = 8


def bids_scaling(target: int = DEFAULT_TARGET) -> slipstream.ScalingPolicy:
    """The bids stream's policy: split a segment above ``target`` bids/s into two, merge cold
    neighbours, between 1 and :data:`MAX_BID_SEGMENTS` segments."""
    return slipstream.ScalingPolicy.by_event_rate(
        target, scale_factor=2, min_segments=1, max_segments=MAX_BID_SEGMENTS
    )


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
    client: slipstream.Client,
    segments: int | None = None,
    outputs: tuple[str, ...] = (),
    target: int = DEFAULT_TARGET,
) -> None:
    """The pipeline's streams and the notifier's subscription (existing ones are left as
    they are, but for the bids stream's scaling policy). The subscription exists before job 2
    writes a price move, so the notifier misses none, even those written before its first
    member joins (on a data directory from before the notifier, "earliest" makes it act once on
    the alerts already there).

    The bids stream is elastic (:func:`bids_scaling` with ``target``): it starts with one
    segment (or ``segments``) and the broker splits and merges it by load. A bids stream from
    an older run (a fixed count of segments, or another target) gets this policy now; that is
    idempotent, and its segments then follow the load from the next scaling pass (a fixed
    stream's 4 segments merge after five quiet minutes). The other streams get ``segments``
    (default 4) fixed ones: they carry one event per window."""
    policy = bids_scaling(target)
    try:
        client.create_stream(BIDS, segments=segments or 1, scaling=policy)
    except slipstream.StreamExists:
        if client.describe_stream(BIDS).scaling != str(policy):
            client.update_stream(BIDS, scaling=policy)
    for name in (WINDOWS, PRICE_MOVES, *outputs):
        with contextlib.suppress(slipstream.StreamExists):
            client.create_stream(name, segments=segments or 4)
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


@dataclass(frozen=True)
class Phase:
    """``seconds`` of bids at ``rate`` per second."""

    name: str
    seconds: float
    rate: float


@dataclass(frozen=True)
class Cycle:
    """How the generator's rate varies: its phases in turn, over and over (one phase: a
    steady rate). Build with :meth:`steady`, :meth:`rush_hour` or :meth:`parse`."""

    name: str
    phases: tuple[Phase, ...]
    period: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.phases or any(p.seconds <= 0 or p.rate < 0 for p in self.phases):
            raise ValueError(f"a cycle needs phases of > 0 s at >= 0 bids/s: {self.phases}")
        object.__setattr__(self, "period", sum(p.seconds for p in self.phases))

    @classmethod
    def steady(cls, rate: float) -> Cycle:
        return cls(f"steady {rate:,.0f}/s", (Phase("steady", 3600, rate),))

    @classmethod
    def rush_hour(cls, target: int = DEFAULT_TARGET) -> Cycle:
        """14.5 minutes for a ``target`` bids/s per segment policy: 60 s quiet (0.3 x target,
        one segment), a one-minute rush hour (5 x target: the segment splits within seconds,
        its halves again 10 s later: 4 segments), then 750 s quiet. The merge rule wants a
        pair of neighbours below half the target for 300 s, and a segment takes part in one
        scale at a time: about five minutes after the rush the coldest neighbours merge (one
        pair or two), five minutes later the next, and the next rush hour splits again what
        is left (measured: 1 -> 2 -> 4 segments 4 and 15 s into the rush, 4 -> 3 after 7.1
        minutes)."""
        quiet, rush = 0.3 * target, 5.0 * target
        phases = (Phase("quiet", 60, quiet), Phase("rush hour", 60, rush))
        return cls("rush-hour", (*phases, Phase("quiet", 750, quiet)))

    @classmethod
    def parse(cls, text: str, target: int = DEFAULT_TARGET) -> Cycle:
        """``rush-hour`` (:meth:`rush_hour` for ``target``) or phases as ``SECONDS:RATE``
        separated by commas, e.g. ``30:300,30:2500,60:300``. Raises ValueError."""
        if text == "rush-hour":
            return cls.rush_hour(target)
        try:
            pairs = [part.split(":") for part in text.split(",")]
            phases = tuple(
                Phase(f"phase {i + 1}", float(s), float(r)) for i, (s, r) in enumerate(pairs)
            )
        except ValueError:
            raise ValueError(
                f"bad cycle {text!r}: use rush-hour, or SECONDS:RATE phases such as "
                "30:300,30:2500,60:300"
            ) from None
        return cls(text, phases)

    def at(self, elapsed: float) -> tuple[Phase, float]:
        """The phase ``elapsed`` seconds into the run, and the seconds left in it."""
        into = elapsed % self.period
        for phase in self.phases:
            if into < phase.seconds:
                return phase, phase.seconds - into
            into -= phase.seconds
        return self.phases[-1], 0.0

    def due(self, elapsed: float) -> float:
        """How many bids the first ``elapsed`` seconds hold (the integral of the rate)."""
        rounds, into = divmod(elapsed, self.period)
        total = rounds * sum(p.seconds * p.rate for p in self.phases)
        for phase in self.phases:
            total += min(into, phase.seconds) * phase.rate
            into -= phase.seconds
            if into <= 0:
                break
        return total


def generate(
    client: slipstream.Client, rate: float | Cycle, stop: Any, counter: list[int] | None = None
) -> None:
    """Send bids until ``stop.is_set()`` (a threading.Event): ``rate`` per second, or as
    the cycle's phases say. A generator that falls behind (a busy machine) catches up in
    bursts of at most 10,000 bids."""
    cycle = rate if isinstance(rate, Cycle) else Cycle.steady(rate)
    generator = BidGenerator()
    with client.producer(BIDS, linger_ms=5) as producer:
        started = time.monotonic()
        sent = 0
        while not stop.is_set():
            elapsed = time.monotonic() - started
            due = int(cycle.due(elapsed)) - sent
            if due <= 0:
                phase, _ = cycle.at(elapsed)
                time.sleep(0.01 if phase.rate <= 0 else min(0.01, 1 / phase.rate))
                continue
            now_ms = time.time_ns() // 1_000_000
            for _ in range(min(due, 10_000)):
                key, value, ts = generator.next(now_ms)
                producer.send(value, key=key, timestamp=ts)
            sent += min(due, 10_000)
            if counter is not None:
                counter[0] = sent
