"""``slipstream demo``: a broker, an order generator and a live follower in one command.

The broker runs as ``python -m slipstream up`` in a subprocess (its own process group, so a
Ctrl-C in the terminal reaches only the demo, which then shuts things down in order: stop
producing, flush, let the follower catch up, close, SIGTERM the broker). With ``--broker`` the
demo uses a running broker instead and starts none.

Latency is measured end to end: from the event's timestamp (the ``ts`` field of the order,
taken just before ``send``, in microseconds) to the moment the follower receives the event.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import datetime as dt
import math
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

import slipstream

from ..broker import EmbeddedBroker, choose_port

DEMO_STREAM = "demo/orders"


# --- the events -------------------------------------------------------------------------------


class Order(msgspec.Struct, frozen=True):
    """One order event, the value of every event the demo produces (as JSON)."""

    order_id: str
    user: str
    item: str
    quantity: int
    unit_price: float
    price: float
    currency: str
    ts: str  # ISO-8601 UTC with microseconds: when the order was placed (and sent)


_CATALOG = [
    ("espresso beans 1kg", 18.90),
    ("oat milk 6-pack", 11.40),
    ("ceramic mug", 9.50),
    ("pour-over kettle", 42.00),
    ("paper filters x100", 4.20),
    ("burr grinder", 129.00),
    ("travel tumbler", 24.90),
    ("chai tea tin", 7.80),
    ("dark chocolate bar", 3.60),
    ("barista apron", 29.00),
]


class OrderGenerator:
    """Orders from a few hundred users, a few of them much busier than the rest (Zipf-like),
    so per-key order and key routing show up in the segments."""

    def __init__(self, users: int = 300, seed: int | None = None) -> None:
        self.random = random.Random(seed)
        self.users = [f"user-{i:04d}" for i in range(1, users + 1)]
        weights = [1 / (rank**0.9) for rank in range(1, users + 1)]
        self.cumulative = list(_accumulate(weights))
        self.count = 0
        self.prefix = f"{self.random.getrandbits(24):06x}"

    def next(self, now_us: int) -> tuple[str, Order]:
        self.count += 1
        pick = self.random.random() * self.cumulative[-1]
        user = self.users[bisect.bisect_right(self.cumulative, pick)]
        item, unit_price = self.random.choice(_CATALOG)
        quantity = self.random.choices((1, 2, 3, 6), (70, 20, 7, 3))[0]
        moment = dt.datetime.fromtimestamp(now_us / 1e6, tz=dt.UTC)
        order = Order(
            order_id=f"ord-{self.prefix}-{self.count:07d}",
            user=user,
            item=item,
            quantity=quantity,
            unit_price=unit_price,
            price=round(unit_price * quantity, 2),
            currency="EUR",
            ts=moment.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        )
        return user, order


def _accumulate(weights: list[float]) -> Iterator[float]:
    total = 0.0
    for weight in weights:
        total += weight
        yield total


# --- measurements -----------------------------------------------------------------------------


class LatencyHistogram:
    """Latencies in buckets 2% wide: percentiles of a whole run without keeping samples."""

    RATIO = math.log(1.02)
    FLOOR_MS = 0.01

    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self.total = 0
        self.max_ms = 0.0

    def record(self, latency_ms: float) -> None:
        bucket = int(math.log(max(latency_ms, self.FLOOR_MS) / self.FLOOR_MS) / self.RATIO)
        self.counts[bucket] += 1
        self.total += 1
        self.max_ms = max(self.max_ms, latency_ms)

    def percentile(self, fraction: float) -> float | None:
        if not self.total:
            return None
        rank = math.ceil(fraction * self.total)
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return self.FLOOR_MS * math.exp((bucket + 1) * self.RATIO)
        return self.max_ms


@dataclass
class DemoStats:
    """Counters shared by the generator, the follower and the display (one event loop)."""

    address: str
    rate: float
    segments: int = 0
    sent: int = 0
    acknowledged: int = 0
    consumed: int = 0
    started: float = field(default_factory=time.monotonic)
    stopped: float | None = None
    recent_ms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=10_000)
    )
    histogram: LatencyHistogram = field(default_factory=LatencyHistogram)
    last_events: collections.deque[tuple[slipstream.Event, Order]] = field(
        default_factory=lambda: collections.deque(maxlen=8)
    )
    samples: collections.deque[tuple[float, int, int]] = field(
        default_factory=lambda: collections.deque(maxlen=64)
    )

    def elapsed(self) -> float:
        return (self.stopped or time.monotonic()) - self.started

    def sample(self) -> tuple[float, float]:
        """Acknowledged and consumed events per second over about the last second."""
        now = time.monotonic()
        self.samples.append((now, self.acknowledged, self.consumed))
        then, acked, consumed = next(
            (s for s in self.samples if now - s[0] <= 1.5), self.samples[0]
        )
        span = now - then
        if span <= 0:
            return 0.0, 0.0
        return (self.acknowledged - acked) / span, (self.consumed - consumed) / span

    def recent_percentiles(self) -> tuple[float | None, float | None]:
        if not self.recent_ms:
            return None, None
        ordered = sorted(self.recent_ms)
        last = len(ordered) - 1
        return ordered[int(last * 0.5)], ordered[int(last * 0.99)]

    def summary(self) -> dict[str, Any]:
        elapsed = max(self.elapsed(), 1e-9)
        p50, p99 = self.histogram.percentile(0.5), self.histogram.percentile(0.99)
        return {
            "broker": self.address,
            "stream": DEMO_STREAM,
            "duration_s": round(elapsed, 3),
            "produced": self.acknowledged,
            "consumed": self.consumed,
            "produced_per_s": round(self.acknowledged / elapsed, 1),
            "consumed_per_s": round(self.consumed / elapsed, 1),
            "latency_ms": {
                "p50": None if p50 is None else round(p50, 3),
                "p99": None if p99 is None else round(p99, 3),
                "max": round(self.histogram.max_ms, 3),
            },
        }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def render(stats: DemoStats, produced_rate: float, consumed_rate: float) -> Group:
    header = Text.assemble(
        ("slipstream demo", "bold magenta"),
        f"  broker {stats.address}  stream ",
        (DEMO_STREAM, "bold cyan"),
        f" ({stats.segments} segments)  target {stats.rate:,.0f} events/s  "
        f"running {stats.elapsed():.0f} s",
    )
    recent_p50, recent_p99 = stats.recent_percentiles()
    numbers = Table(box=box.SIMPLE_HEAVY, show_edge=False)
    numbers.add_column("")
    numbers.add_column("events/s", justify="right")
    numbers.add_column("total", justify="right")
    numbers.add_column("latency p50", justify="right")
    numbers.add_column("latency p99", justify="right")
    numbers.add_row("produced (acknowledged)", f"{produced_rate:,.0f}", f"{stats.acknowledged:,}")
    numbers.add_row(
        "consumed (live follower)",
        f"{consumed_rate:,.0f}",
        f"{stats.consumed:,}",
        _ms(recent_p50),
        _ms(recent_p99),
    )
    events = Table(title="latest orders", title_justify="left", box=box.SIMPLE, show_edge=False)
    for name, justify in (
        ("time", "left"),
        ("order", "left"),
        ("user (key)", "left"),
        ("item", "left"),
        ("qty", "right"),
        ("price", "right"),
        ("segment/offset", "right"),
    ):
        events.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for event, order in reversed(stats.last_events):
        events.add_row(
            order.ts[11:23],
            order.order_id,
            order.user,
            order.item,
            str(order.quantity),
            f"{order.price:.2f} {order.currency}",
            f"{event.segment}/{event.offset}",
        )
    hint = Text(
        f"In another terminal: slipstream consume {DEMO_STREAM} --broker {stats.address} "
        "--from latest --follow     Ctrl-C stops the demo.",
        style="dim",
    )
    return Group(header, numbers, events, hint)


def status_line(stats: DemoStats, produced_rate: float, consumed_rate: float) -> str:
    p50, p99 = stats.recent_percentiles()
    return (
        f"demo {stats.elapsed():5.1f} s: produced {stats.acknowledged:,} "
        f"({produced_rate:,.0f}/s), consumed {stats.consumed:,} ({consumed_rate:,.0f}/s), "
        f"latency p50 {_ms(p50)}, p99 {_ms(p99)}"
    )


# --- the pipeline -----------------------------------------------------------------------------


async def generate(
    producer: slipstream.AsyncProducer,
    stats: DemoStats,
    stopping: asyncio.Event,
    seed: int | None,
) -> None:
    """Send orders at ``stats.rate`` per second, paced by the clock; a stall is not made up
    with a burst (the backlog is dropped after half a second)."""
    generator = OrderGenerator(seed=seed)
    encode = msgspec.json.Encoder().encode
    pending: collections.deque[slipstream.Receipt] = collections.deque()
    loop = asyncio.get_running_loop()
    began, sent_since = loop.time(), 0
    while not stopping.is_set():
        due = int((loop.time() - began) * stats.rate) - sent_since
        if due > stats.rate / 2:
            began, sent_since, due = loop.time(), 0, 1
        for _ in range(due):
            now_us = time.time_ns() // 1000
            user, order = generator.next(now_us)
            pending.append(await producer.send(encode(order), key=user, timestamp=now_us // 1000))
            sent_since += 1
            stats.sent += 1
        while pending and pending[0].done():
            pending.popleft().result()  # raises the batch's typed error, if it failed
            stats.acknowledged += 1
        await asyncio.sleep(0.002)
    await producer.close()  # flushes: every event sent is acknowledged or raised by now
    stats.acknowledged += len(pending)


async def follow(reader: slipstream.AsyncReader, stats: DemoStats) -> None:
    decode = msgspec.json.Decoder(Order).decode
    async for event in reader:
        now_us = time.time_ns() // 1000
        order = decode(event.value)
        sent = dt.datetime.fromisoformat(order.ts)
        latency_ms = (now_us - sent.timestamp() * 1e6) / 1000
        stats.consumed += 1
        stats.recent_ms.append(latency_ms)
        stats.histogram.record(latency_ms)
        stats.last_events.append((event, order))


async def display(stats: DemoStats, live: Live | None, console: Console, quiet: bool) -> None:
    """Redraw the live view 4 times a second (or print a status line every 5 s when stdout is
    not a terminal)."""
    last_line = time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        produced_rate, consumed_rate = stats.sample()
        if live is not None:
            live.update(render(stats, produced_rate, consumed_rate), refresh=True)
        elif not quiet and time.monotonic() - last_line >= 5:
            last_line = time.monotonic()
            console.print(status_line(stats, produced_rate, consumed_rate), highlight=False)


async def run_pipeline(
    stats: DemoStats,
    *,
    segments: int,
    duration: float | None,
    console: Console,
    live_view: bool,
    quiet: bool,
    seed: int | None = None,
) -> None:
    """Create the stream if needed, then generate, follow and display until Ctrl-C, SIGTERM
    or ``duration``; then stop in order so every acknowledged event is also consumed."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    assert main_task is not None

    def on_signal() -> None:
        if stop.is_set():  # a second Ctrl-C: stop waiting for the orderly shutdown
            main_task.cancel()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        async with await slipstream.connect_async(stats.address) as client:
            with contextlib.suppress(slipstream.StreamExists):
                await client.create_stream(DEMO_STREAM, segments)
            stats.segments = sum(
                not s.sealed for s in (await client.describe_stream(DEMO_STREAM)).segments
            )
            # "latest", resolved here so that every event produced below is also followed
            reader = client.reader(DEMO_STREAM, start=await client.tail(DEMO_STREAM))
            producer = await client.producer(DEMO_STREAM)
            stopping = asyncio.Event()
            live = Live(console=console, auto_refresh=False) if live_view else None
            with live if live is not None else contextlib.nullcontext():
                async with asyncio.TaskGroup() as tasks:
                    following = tasks.create_task(follow(reader, stats))
                    showing = tasks.create_task(display(stats, live, console, quiet))
                    generating = tasks.create_task(generate(producer, stats, stopping, seed))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), duration)
                    stopping.set()
                    await generating
                    deadline = loop.time() + 5
                    while stats.consumed < stats.acknowledged and loop.time() < deadline:
                        await asyncio.sleep(0.01)
                    stats.stopped = time.monotonic()
                    following.cancel()
                    showing.cancel()
                    if live is not None:
                        produced_rate, consumed_rate = stats.sample()
                        live.update(render(stats, produced_rate, consumed_rate), refresh=True)
    except* slipstream.SlipstreamError as group:
        raise group.exceptions[0] from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_demo(
    *,
    broker: str | None,
    port: int | None,
    data_dir: Path,
    fsync: str,
    rate: float,
    segments: int,
    duration: float | None,
    as_json: bool,
    console: Console,
) -> dict[str, Any]:
    """Run the whole demo; returns the summary (also printed unless ``as_json``)."""
    embedded: EmbeddedBroker | None = None
    if broker is None:
        embedded = EmbeddedBroker(data_dir, port if port is not None else choose_port(), fsync)
        if not as_json:
            console.print(
                f"starting a broker on {embedded.address} (data in {data_dir}, log in "
                f"{embedded.log_path})",
                style="dim",
                highlight=False,
            )
        embedded.start()
        broker = embedded.address
    stats = DemoStats(broker, rate)
    try:
        _run_loop(
            run_pipeline(
                stats,
                segments=segments,
                duration=duration,
                console=console,
                live_view=console.is_terminal and not as_json,
                quiet=as_json,
            )
        )
    finally:
        if embedded is not None:
            code = embedded.stop()
            if code not in (0, None) and not as_json:
                console.print(
                    f"[yellow]the demo broker exited with code {code}[/] "
                    f"(log: {embedded.log_path})",
                    highlight=False,
                )
    summary = stats.summary()
    if not as_json:
        latency = summary["latency_ms"]
        console.print(
            f"demo done after {summary['duration_s']:.1f} s: produced {summary['produced']:,} "
            f"events ({summary['produced_per_s']:,.0f}/s), consumed {summary['consumed']:,}; "
            f"end-to-end latency p50 {_ms(latency['p50'])}, p99 {_ms(latency['p99'])}",
            highlight=False,
        )
    return summary


def _run_loop(coroutine: Any) -> None:
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        factory = None
    with (
        asyncio.Runner(loop_factory=factory) as runner,
        contextlib.suppress(asyncio.CancelledError),
    ):
        runner.run(coroutine)
