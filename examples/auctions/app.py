"""``python -m auctions live | replay``: the auctions pipeline as the main job, and its replay.

live    starts a broker (embedded: local files and SQLite under --data-dir, or --broker; or
        with --cluster a local cluster: PostgreSQL, SeaweedFS and two brokers, cluster.py), a
        bid generator, both Spark jobs, a consumer group that acts on price alerts (the notifier),
        and a live view of windows as they close, alerts as they are notified, rates, each
        consumer's backlog and lag, and the elastic bids stream's segments (split in the
        generator's rush hour, merged when it is quiet, with the rule that fired), until
        Ctrl-C or --duration; then stops everything in order (generator, queries, Spark,
        notifier, broker). Restarting resumes from the checkpoints (the jobs, exactly once)
        and the notifier's subscription (at least once).
replay  runs version 2 of job 1 (other window or watermark) from the start of the bids stream
        into its own output stream and compares it with version 1's windows: the "rewind and
        test the new version" workflow. The live job may keep running meanwhile (--broker).

Both use public APIs only: slipstream, slipstream.broker.EmbeddedBroker, slipstream.spark.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

import slipstream
from slipstream.broker import EmbeddedBroker, choose_port
from slipstream.protocol import ScaleEventInfo
from slipstream.spark import session

from . import pipeline
from .cluster import ClusterError, LocalCluster

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None)
console = Console(stderr=True)

#: where ./run.sh keeps the main job's data: .slipstream/auctions at the repository's root,
#: whichever directory the commands run from
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / ".slipstream" / "auctions"
DataDir = Annotated[
    Path,
    typer.Option(
        help="Embedded broker's data directory; checkpoints go next to it. Default: "
        ".slipstream/auctions at the repository's root, where ./run.sh keeps it.",
        show_default=False,
    ),
]
Broker = Annotated[
    str | None,
    typer.Option(
        help="Use this running broker (host:port, or a cluster's h1:p1,h2:p2); start none."
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="No live view; a JSON summary on stdout.")]
Cluster = Annotated[
    Path | None,
    typer.Option(
        help="Start a local cluster under this directory and run on it: PostgreSQL, SeaweedFS "
        "and two brokers in cluster mode on 127.0.0.1:7070 and :7072 (auctions/cluster.py; "
        "./run.sh --cluster). Kept between runs; checkpoints go in it too.",
        show_default=False,
    ),
]
Master = Annotated[
    str,
    typer.Option(
        envvar="SLIPSTREAM_SPARK_MASTER",
        help="Spark's master: local[2] (in this process), or a standalone cluster's "
        "spark://HOST:7077 (docs/spark.md).",
    ),
]


@contextlib.contextmanager
def platform(
    broker: str | None, data_dir: Path, cluster: LocalCluster | None = None
) -> Iterator[tuple[str, slipstream.Client, str]]:
    """The broker's address, a client and the address of the broker's web console: a running
    broker (its console on the default --http-port), a local cluster (started here, its
    brokers' addresses and consoles; stopped last), or an embedded broker stopped last."""
    embedded = None
    if cluster is not None:
        console.print(f"[dim]starting PostgreSQL, SeaweedFS and two brokers in {cluster.root} ...")
        try:
            cluster.start()
        except ClusterError as exc:  # names the part that failed and its log
            console.print(f"[red]the local cluster did not start:[/] {exc}")
            raise typer.Exit(1) from None
        broker = cluster.addresses
    elif broker is None:
        embedded = EmbeddedBroker(data_dir, choose_port(), fsync="always")
        embedded.start()
        broker = embedded.address
    host = broker.split(",")[0].rsplit(":", 1)[0]  # of the first in a list h1:p1,h2:p2
    web = f"http://{host}:{embedded.http_port if embedded is not None else 7071}/"
    if cluster is not None:
        web = " and ".join(cluster.consoles)
    try:
        with slipstream.connect(broker) as client:
            yield broker, client, web
    finally:
        if embedded is not None:
            embedded.stop()
        if cluster is not None:
            console.print("[dim]stopping the brokers, SeaweedFS and PostgreSQL ...")
            cluster.stop()


def checkpoints_of(data_dir: Path) -> Path:
    """Where the Spark jobs keep their checkpoints: next to the broker's data directory."""
    return data_dir.with_name(data_dir.name + "-checkpoints")


def reset_checkpoints_if_new(
    client: slipstream.Client, checkpoints: Path, target: int = pipeline.DEFAULT_TARGET
) -> None:
    """Checkpoints hold offsets into the bids stream: worthless, and harmful, without it.
    Then the streams, and the bids stream's scaling policy for ``target`` (also on a data
    directory from an older run, whose bids stream had a fixed count)."""
    if pipeline.BIDS not in {s.name for s in client.list_streams("auctions")}:
        shutil.rmtree(checkpoints, ignore_errors=True)
    pipeline.create_streams(client, target=target)


# --- live -------------------------------------------------------------------------------------


@dataclass
class Board:
    """What the live view shows; followers fill it from the output streams."""

    started: float = field(default_factory=time.monotonic)
    sent: list[int] = field(default_factory=lambda: [0])
    windows: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=8)
    )
    alerts: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=6)
    )
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    samples: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=10)
    )
    close_delays: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=200)
    )
    #: when the generator started its cycle (monotonic), for the phase it is in
    cycle_started: float | None = None

    def on_window(self, window: dict[str, Any]) -> None:
        end = dt.datetime.fromisoformat(window["end"]).timestamp()
        window["closed_after"] = time.time() - end  # watermark (5 s) + a micro-batch or two
        self.close_delays.append(window["closed_after"])
        self.windows.appendleft(window)
        self.counts["windows"] += 1
        self.counts["window_bids"] += window["bids"]

    def on_move(self, move: dict[str, Any]) -> None:
        """The notifier's action on one price move: an alert is "notified" (shown and counted,
        with how long after its window's end it got here: watermark, both jobs, the group)."""
        self.counts["moves"] += 1
        if move["alert"]:
            end = dt.datetime.fromisoformat(move["end"]).timestamp()
            move["notified_after"] = time.time() - end
            self.counts["alerts"] += 1
            self.alerts.appendleft(move)


def follow(broker: str, stream: str, on_value: Callable[[dict[str, Any]], None]) -> None:
    """Call ``on_value`` with each new event's JSON value (a daemon thread: until the broker
    goes away at shutdown, or the program exits)."""
    with contextlib.suppress(slipstream.BrokerUnavailable), slipstream.connect(broker) as client:
        for event in client.reader(stream, "latest"):
            on_value(json.loads(event.value))


class Notifier:
    """A member of the ``notifier`` consumer group on auctions/price-moves, in a thread: it
    hands each price move to ``on_move`` (which acts on alerts). The group's committed
    positions make it resume where it stopped, after a restart too; commits are automatic
    (about once a second, and on close), so delivery is at least once: a crash may notify an
    alert again, never lose one. More members with the same subscription would share the
    stream's segments. Its failure is kept in ``error`` for the caller to raise."""

    def __init__(
        self, broker: str, on_move: Callable[[dict[str, Any]], None], name: str = "notifier-1"
    ) -> None:
        self.broker, self.on_move, self.name = broker, on_move, name
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Notifier:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with (
                slipstream.connect(self.broker) as client,
                client.consumer(pipeline.PRICE_MOVES, pipeline.NOTIFIER, name=self.name) as group,
            ):
                while not self.stop.is_set():
                    for event in group.poll(0.5):
                        self.on_move(json.loads(event.value))
        except BaseException as exc:  # kept for the main thread, which stops the program
            self.error = exc

    def close(self, drained: Callable[[], bool] | None = None, timeout: float = 15.0) -> None:
        """Stop, first waiting up to ``timeout`` s until ``drained()`` (say, no backlog);
        leaving the group commits what was handled."""
        deadline = time.monotonic() + timeout
        while drained is not None and self.error is None and time.monotonic() < deadline:
            if drained():
                break
            time.sleep(0.2)
        self.stop.set()
        self.thread.join(timeout)


#: who consumes what, for the live view: name -> (stream, subscription)
CONSUMERS = {
    "job 1 windows": (pipeline.BIDS, pipeline.WINDOWS_JOB),
    "job 2 prices": (pipeline.WINDOWS, pipeline.PRICES_JOB),
    "notifier group": (pipeline.PRICE_MOVES, pipeline.NOTIFIER),
}


def consumer_status(client: slipstream.Client, stream: str, subscription: str) -> dict[str, Any]:
    """A subscription's consumption as ``describe_subscription`` reports it: the Spark jobs
    record their progress with the source's ``subscription`` option, the notifier is a group;
    both look the same here, as in ``slipstream subscription describe``."""
    try:
        info = client.describe_subscription(stream, subscription)
    except slipstream.SubscriptionNotFound:  # a job creates its own when it starts
        return {"members": 0, "position": 0, "backlog_events": 0, "lag_ms": 0, "started": False}
    return {
        "members": len(info.members),
        "position": sum(s.position for s in info.segments),
        "backlog_events": sum(s.backlog_events for s in info.segments),
        "lag_ms": max((s.lag_ms for s in info.segments), default=0),
        "started": True,
    }


def cluster_line(client: slipstream.Client, local: LocalCluster | None = None) -> str | None:
    """Each broker of a cluster, its address and the containers it serves, in one line for the
    live view (``DescribeCluster``, which any broker answers); None for a single broker unless
    ``local`` (the cluster this program started) is given. A container nobody serves right now
    (a takeover or hand-over under way) is named as moving."""
    try:
        info = client.describe_cluster()
    except slipstream.SlipstreamError as exc:
        return f"cluster: not described just now ({type(exc).__name__})"
    if len(info.brokers) < 2 and local is None:
        return None
    brokers = [
        f"{b.broker_id} {b.address} serves containers "
        + (", ".join(map(str, sorted(b.containers))) or "-")
        for b in info.brokers
    ]
    moving = [c for c, owner in enumerate(info.owners) if not owner]
    return "cluster: " + " | ".join(brokers) + (f" | moving: {moving}" if moving else "")


def produce(broker: str, cycle: pipeline.Cycle, stop: threading.Event, board: Board) -> None:
    with slipstream.connect(broker) as client:
        board.cycle_started = time.monotonic()
        pipeline.generate(client, cycle, stop, board.sent)


def scale_summary(scale: ScaleEventInfo) -> dict[str, Any]:
    """One split or merge of the bids stream, as the live view and the summary show it: the
    action, the segments sealed and opened, the rule that fired (``manual`` for one by hand)
    and the rate it compared, in a few words (``describe --history`` has the full sentence)."""
    action = "merge" if len(scale.sealed) > 1 else "split"
    try:
        decision = json.loads(scale.reason)
    except ValueError:
        decision = {"rule": "manual"}  # the reason of a scale by hand is the word "manual"
    rule = decision.get("rule", "manual")
    why = "by hand"
    threshold = decision.get("threshold")
    inputs = decision.get("inputs") or []
    if threshold is not None and inputs:
        rates = [i["rates"][decision["policy"].split()[0]] for i in inputs]
        if rule.startswith("hot_"):
            window = "last_" + rule.removeprefix("hot_")
            why = f"{max(r[window] for r in rates):,.0f}/s > {threshold:,.0f}/s"
        else:  # cold_300s: together, every 10 s of the last 300 s
            why = f"peak {sum(r['peak_10s'] for r in rates):,.0f}/s < {threshold:,.0f}/s"
    elif rule != "manual":
        why = decision.get("reason", rule)
    return {
        "epoch": scale.epoch,
        "at_ms": scale.at_ms,
        "action": action,
        "sealed": sorted(scale.sealed),
        "created": list(scale.created),
        "rule": rule,
        "why": why,
    }


class BidsWatch:
    """The bids stream's segments over time, from ``describe_stream`` (each open segment's
    key range, and its rate from how its end moved over the last few seconds) and, when the
    epoch changes, ``scale_history`` (the splits and merges, and why)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.policy = ""
        self.open: list[slipstream.SegmentInfo] = []
        self.rates: dict[int, float] = {}
        self.scales: list[dict[str, Any]] = []
        self._ends: collections.deque[tuple[float, dict[int, int]]] = collections.deque(maxlen=10)
        self._history_epoch = -1

    def update(self, client: slipstream.Client) -> None:
        info = client.describe_stream(pipeline.BIDS)
        now = time.monotonic()
        self.epoch, self.policy = info.epoch, info.scaling
        self.open = sorted((s for s in info.segments if not s.sealed), key=lambda s: s.key_lo)
        self._ends.append((now, {s.number: s.end_offset for s in info.segments}))
        then, ends = self._ends[0]  # the last 5 s: 10 views apart
        seconds = max(now - then, 1e-9)
        self.rates = {
            s.number: (s.end_offset - ends.get(s.number, s.start_offset)) / seconds
            for s in self.open
        }
        if self.epoch != self._history_epoch:
            self.scales = [scale_summary(e) for e in client.scale_history(pipeline.BIDS)]
            self._history_epoch = self.epoch

    def summary(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "policy": self.policy,
            "open_segments": len(self.open),
            "splits": sum(1 for s in self.scales if s["action"] == "split"),
            "merges": sum(1 for s in self.scales if s["action"] == "merge"),
            "scales": self.scales,
        }


def key_range(segment: slipstream.SegmentInfo) -> str:
    """A segment's key-hash range by its top 16 bits, as ``describe --history`` (abridged)."""
    return f"{segment.key_lo >> 48:04x}-{segment.key_hi >> 48:04x}"


def key_space_bar(segments: list[slipstream.SegmentInfo], width: int = 40) -> str:
    """The open segments side by side over the key space, each as wide as its range."""
    cells, edge = [], 0
    for s in segments:
        right = round((s.key_hi + 1) / 2**64 * width)
        label = str(s.number)
        cells.append(label.center(max(right - edge - 1, len(label)), "\u2500"))
        edge = right
    return "|" + "|".join(cells) + "|"


def render_bids(watch: BidsWatch, phase: str) -> Table:
    """The bids stream's open segments (key ranges, rates) and its last scaling decisions."""
    segments = Table(
        title=f"{pipeline.BIDS}: epoch {watch.epoch}, {len(watch.open)} open segments",
        caption=key_space_bar(watch.open),
        expand=True,
    )
    for name in ("segment", "keys", "bids/s", "stored"):
        segments.add_column(name, justify="left" if name == "keys" else "right")
    for s in watch.open:
        rate = watch.rates.get(s.number, 0.0)
        segments.add_row(str(s.number), key_range(s), f"{rate:,.0f}", f"{s.end_offset:,}")
    timeline = Table(
        title=f"scaling ({watch.policy or 'no policy'}); {phase}",
        caption=f"all of it: slipstream stream describe {pipeline.BIDS} --history",
        expand=True,
    )
    for name in ("time (UTC)", "epoch", "change", "rule", "why"):
        timeline.add_column(name, no_wrap=True, justify="right" if name == "epoch" else "left")
    for scale in watch.scales[-6:]:
        at = dt.datetime.fromtimestamp(scale["at_ms"] / 1000, dt.UTC).strftime("%H:%M:%S")
        sealed = ", ".join(map(str, scale["sealed"]))
        created = ", ".join(map(str, scale["created"]))
        timeline.add_row(
            at,
            str(scale["epoch"]),
            f"{scale['action']} {sealed} -> {created}",
            scale["rule"],
            scale["why"],
        )
    if not watch.scales:
        timeline.add_row("-", "-", "no split or merge yet", "", "")
    both = Table.grid(expand=True, padding=(0, 1))
    both.add_column(ratio=2)
    both.add_column(ratio=3)
    both.add_row(segments, timeline)
    return both


def job_status(query: Any) -> dict[str, Any]:
    """A query's last micro-batch in a few numbers."""
    progress = query.lastProgress
    if not progress:
        return {"batch": None}
    source = progress["sources"][0]
    status = {
        "batch": progress["batchId"],
        "rows_per_s": round(source.get("processedRowsPerSecond") or 0.0),
        "batch_ms": progress["durationMs"].get("triggerExecution", 0),
        "watermark": progress.get("eventTime", {}).get("watermark", "-"),
        "dropped_late": sum(
            op.get("numRowsDroppedByWatermark", 0) for op in progress.get("stateOperators", [])
        ),
    }
    return status


def phase_of(board: Board, cycle: pipeline.Cycle) -> tuple[str, float]:
    """The generator's phase in words (with the seconds left in it) and its rate."""
    if board.cycle_started is None:
        return "generator starting", 0.0
    phase, left = cycle.at(time.monotonic() - board.cycle_started)
    if len(cycle.phases) == 1:
        return f"{cycle.name}", phase.rate
    return f"{cycle.name}: {phase.name} at {phase.rate:,.0f}/s, {left:.0f} s left", phase.rate


def render(
    board: Board,
    cycle: pipeline.Cycle,
    jobs: dict[str, dict[str, Any]],
    consumers: dict[str, dict[str, Any]],
    watch: BidsWatch,
    web: str,
    cluster: str | None = None,
) -> Group:
    windows = Table(title="windows as they close (auctions/windows)", expand=True)
    for name in ("auction", "window (UTC)", "bids", "max", "mean", "closed after"):
        windows.add_column(name, justify="left" if name.startswith(("auction", "w")) else "right")
    for w in board.windows:
        span = f"{w['start'][11:19]}-{w['end'][11:19]}"
        row = (w["bids"], f"{w['max_price']:.2f}", f"{w['mean_price']:.2f}")
        windows.add_row(w["auction"], span, *map(str, row), f"{w['closed_after']:.1f} s")
    alerts = Table(
        title="price alerts notified by the notifier group: a window's top bid 25 % over the last",
        expand=True,
    )
    for name in ("auction", "window end", "previous", "max", "change", "notified after"):
        alerts.add_column(name, justify="left" if name[0] in "aw" else "right")
    for a in board.alerts:
        alerts.add_row(
            a["auction"],
            a["end"][11:19],
            f"{a['previous']:.2f}",
            f"{a['max_price']:.2f}",
            f"+{a['change_pct']:.1f} %",
            f"{a['notified_after']:.1f} s",
        )
    lags = Table(title="consumers (slipstream subscription describe STREAM NAME)", expand=True)
    for name in ("consumer", "stream / subscription", "members", "consumed", "backlog", "lag"):
        lags.add_column(name, justify="left" if name[0] in "cs" and name != "consumed" else "right")
    for name, c in consumers.items():
        stream, subscription = CONSUMERS[name]
        lags.add_row(
            name,
            f"{stream} / {subscription}",
            str(c["members"]) if c["started"] else "-",
            f"{c['position']:,}",
            f"{c['backlog_events']:,} events",
            f"{c['lag_ms'] / 1000:.1f} s",
        )
    board.samples.append((time.monotonic(), board.sent[0]))  # the last 5 s: 10 views apart
    (t0, sent0), (t1, sent1) = board.samples[0], board.samples[-1]
    delays = sorted(board.close_delays)
    phase, rate = phase_of(board, cycle)
    # full-width lines above the grid, whose columns are sized for the counters
    header = [
        Text.from_markup(f"[bold]console {web}[/] (streams, segments over time, messages, lag)")
    ]
    if cluster is not None:
        header.append(Text(cluster))
    stats = Table.grid(padding=(0, 2))
    stats.add_row(
        f"bids {sent1:,} ({(sent1 - sent0) / max(t1 - t0, 1e-9):,.0f}/s, target {rate:,.0f})",
        f"windows {board.counts['windows']:,}",
        f"moves {board.counts['moves']:,}",
        f"alerts {board.counts['alerts']:,}",
        f"window closed after p50 {delays[len(delays) // 2]:.1f} s" if delays else "",
    )
    for name, s in jobs.items():
        if s.get("batch") is None:
            stats.add_row(f"{name}: starting (Spark plans the first micro-batch)")
            continue
        stats.add_row(
            f"{name}: batch {s['batch']}",
            f"{s['rows_per_s']:,} rows/s",
            f"{s['batch_ms']:,} ms/batch",
            f"watermark {s['watermark'][11:19] or '-'}, late dropped {s['dropped_late']}",
        )
    return Group(*header, stats, render_bids(watch, phase), lags, windows, alerts)


def choose_cycle(rate: float | None, cycle: str | None, target: int) -> pipeline.Cycle:
    """--rate alone: that steady rate; --cycle: its phases; neither: the rush hour."""
    if rate is not None and cycle is not None:
        raise typer.BadParameter("give --rate (a steady rate) or --cycle, not both")
    if rate is not None:
        return pipeline.Cycle.steady(rate)
    try:
        return pipeline.Cycle.parse(cycle or "rush-hour", target)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cycle") from None


@app.command(
    epilog="Examples: python -m auctions live (the rush-hour cycle: splits after about a "
    "minute, merges after about 7 and 12); python -m auctions live --rate 2000 --duration 60; "
    "python -m auctions live --cycle 30:300,30:3000,400:300"
)
def live(
    rate: Annotated[
        float | None,
        typer.Option(min=1, help="A steady rate of bids per second instead of a cycle."),
    ] = None,
    cycle: Annotated[
        str | None,
        typer.Option(
            help="How the bid rate varies, over and over: 'rush-hour' (the default: 60 s at "
            "0.3 x --target, 60 s at 5 x, 750 s at 0.3 x) or SECONDS:RATE phases, e.g. "
            "30:300,30:3000,400:300.",
            show_default=False,
        ),
    ] = None,
    target: Annotated[
        int,
        typer.Option(
            min=1,
            help="Bids per second per segment of the elastic bids stream: a segment above "
            "2 x this splits within seconds; neighbours below half of it for 5 minutes merge.",
        ),
    ] = pipeline.DEFAULT_TARGET,
    duration: Annotated[
        float | None, typer.Option(min=0, help="Stop after this many seconds (default: Ctrl-C).")
    ] = None,
    broker: Broker = None,
    data_dir: DataDir = DEFAULT_DATA_DIR,
    master: Master = "local[2]",
    cluster: Cluster = None,
    as_json: AsJson = False,
) -> None:
    """The live auctions pipeline: broker, bid generator, both Spark jobs, the notifier
    group, a live view."""
    chosen = choose_cycle(rate, cycle, target)
    local = None
    if cluster is not None:
        if broker is not None:
            raise typer.BadParameter("give --cluster (start one) or --broker, not both")
        local = LocalCluster(cluster)
        data_dir = local.root / "auctions"  # its checkpoints: auctions-checkpoints beside it
    checkpoints = checkpoints_of(data_dir)
    shown: str | None = None  # the cluster's line in the view
    with platform(broker, data_dir, local) as (address, client, web):
        reset_checkpoints_if_new(client, checkpoints, target)
        board, stop, watch = Board(), threading.Event(), BidsWatch()
        threading.Thread(
            target=follow, args=(address, pipeline.WINDOWS, board.on_window), daemon=True
        ).start()
        notifier = Notifier(address, board.on_move).start()
        console.print(
            f"[dim]broker {address}, console {web}; starting Spark (Java 17, about 10 s) ..."
        )
        # pandas in Spark's Python workers warns about NaN columns (a first window has no
        # previous price): noise in a live view. The workers inherit this process's environment.
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
        spark = session("auctions", master=master, log_level="ERROR")
        generator = threading.Thread(
            target=produce, args=(address, chosen, stop, board), daemon=True
        )
        generator.start()
        queries = {
            "job 1 windows": pipeline.start_windows(
                spark,
                address,
                str(checkpoints / "windows"),
                source={"subscription": pipeline.WINDOWS_JOB},
            ),
            "job 2 prices": pipeline.start_prices(
                spark,
                address,
                str(checkpoints / "prices"),
                source={"subscription": pipeline.PRICES_JOB},
            ),
        }
        deadline = None if duration is None else time.monotonic() + duration
        try:
            with Live(console=console, refresh_per_second=2, transient=as_json) as view:
                while deadline is None or time.monotonic() < deadline:
                    for query in queries.values():
                        if query.exception() is not None:
                            raise query.exception()  # type: ignore[misc]
                    if notifier.error is not None:
                        raise notifier.error
                    jobs = {name: job_status(q) for name, q in queries.items()}
                    consumers = {n: consumer_status(client, *c) for n, c in CONSUMERS.items()}
                    watch.update(client)
                    shown = cluster_line(client, local)
                    if not as_json:
                        view.update(render(board, chosen, jobs, consumers, watch, web, shown))
                    time.sleep(0.5)
        except KeyboardInterrupt:
            console.print("[dim]stopping: generator, queries, Spark, broker ...")
        finally:
            stop.set()
            generator.join(10)
            jobs = {name: job_status(q) for name, q in queries.items()}
            # stopping interrupts a micro-batch in flight; Spark logs the interrupted abort as an
            # error with a long trace. Nothing is lost: the batch's staged transactions are
            # aborted as orphans when the query starts again (or time out), so keep it quiet.
            spark.sparkContext.setLogLevel("OFF")
            for query in queries.values():
                query.stop()
            spark.stop()
            # nothing writes price moves now: the notifier handles what is left, then leaves
            notifier_of = CONSUMERS["notifier group"]
            notifier.close(
                drained=lambda: consumer_status(client, *notifier_of)["backlog_events"] == 0
            )
            consumers = {n: consumer_status(client, *c) for n, c in CONSUMERS.items()}
            price_moves = sum(client.tail(pipeline.PRICE_MOVES).positions.values())
            watch.update(client)
    summary = {
        "seconds": round(time.monotonic() - board.started, 1),
        "bids": board.sent[0],
        **{name: board.counts[name] for name in ("windows", "window_bids", "moves", "alerts")},
        "jobs": jobs,
        "consumers": consumers,
        "price_moves_stored": price_moves,
        "cycle": chosen.name,
        "bids_stream": watch.summary(),
        "checkpoints": str(checkpoints),
        "console": web,
        "cluster": shown,
    }
    if as_json:
        print(json.dumps(summary))
    else:
        console.print(f"stopped cleanly: {json.dumps(summary)}")


# --- replay -----------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Version 2's windows against version 1's, over windows both have had time to close."""

    v1: str
    v2: str
    horizon: str  # windows ending at or before this are compared
    compared: int = 0
    same: int = 0
    bids_v1: int = 0
    bids_v2: int = 0
    differ: list[dict[str, Any]] = field(default_factory=list)
    only_v1: list[str] = field(default_factory=list)
    only_v2: list[str] = field(default_factory=list)


def windows_of(client: slipstream.Client, stream: str) -> dict[tuple[str, str], dict[str, Any]]:
    with client.reader(stream, "earliest", end=client.tail(stream)) as reader:
        values = (json.loads(event.value) for event in reader)
        return {(w["auction"], w["start"]): w for w in values}


def compare(client: slipstream.Client, v1: str, v2: str) -> Comparison:
    old, new = windows_of(client, v1), windows_of(client, v2)
    ends = [max((w["end"] for w in ws.values()), default="") for ws in (old, new)]
    result = Comparison(v1, v2, horizon=min(ends))
    keys = {k for ws in (old, new) for k, w in ws.items() if w["end"] <= result.horizon}
    for key in sorted(keys, key=lambda k: (k[1], k[0])):
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            (result.only_v2 if a is None else result.only_v1).append(f"{key[0]} {key[1]}")
            continue
        result.compared += 1
        result.bids_v1 += a["bids"]
        result.bids_v2 += b["bids"]
        if a == b:
            result.same += 1
        else:
            fields = ("bids", "max_price", "mean_price")
            result.differ.append(
                {"auction": key[0], "start": key[1], **{f: [a[f], b[f]] for f in fields}}
            )
    return result


def replay_job(
    spark: Any, address: str, client: slipstream.Client, job: pipeline.WindowJob, checkpoint: Path
) -> Comparison:
    """Run ``job`` over the whole bids stream (from scratch, into ``job.output``), compare."""
    with contextlib.suppress(slipstream.StreamNotFound):
        client.delete_stream(job.output)
    client.create_stream(job.output, segments=4)
    shutil.rmtree(checkpoint, ignore_errors=True)
    query = pipeline.start_windows(
        spark, address, str(checkpoint), job, trigger={"availableNow": True}
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise query.exception()  # type: ignore[misc]
    return compare(client, pipeline.WINDOWS, job.output)


@app.command(
    epilog='Example: python -m auctions replay --watermark "15 seconds" --broker 127.0.0.1:7070'
)
def replay(
    watermark: Annotated[str, typer.Option(help="Version 2's watermark delay.")] = "15 seconds",
    window: Annotated[str, typer.Option(help="Version 2's window length.")] = "10 seconds",
    output: Annotated[str, typer.Option(help="Version 2's output stream (recreated).")] = (
        "auctions/windows-v2"
    ),
    broker: Broker = None,
    data_dir: DataDir = DEFAULT_DATA_DIR,
    master: Master = "local[2]",
    as_json: AsJson = False,
) -> None:
    """Replay the bids history through version 2 of job 1 and compare with version 1."""
    job = pipeline.WindowJob(window=window, watermark=watermark, output=output)
    checkpoint = checkpoints_of(data_dir) / output.replace("/", "-")
    with platform(broker, data_dir) as (address, client, _):
        console.print(f"[dim]replaying {pipeline.BIDS} from earliest through {job} ...")
        spark = session("auctions-replay", master=master, log_level="ERROR")
        try:
            result = replay_job(spark, address, client, job, checkpoint)
        finally:
            spark.stop()
    if as_json:
        print(json.dumps(asdict(result)))
        return
    console.print(
        f"{result.compared} windows ending by {result.horizon} compared: {result.same} the same, "
        f"{len(result.differ)} differ; bids counted v1 {result.bids_v1:,}, v2 {result.bids_v2:,}; "
        f"windows only in v1: {len(result.only_v1)}, only in v2: {len(result.only_v2)}"
    )
    table = Table(title=f"windows that differ ({result.v1} -> {result.v2}), first 20")
    for name in ("auction", "start", "bids", "max price", "mean price"):
        table.add_column(name)
    for d in result.differ[:20]:
        cells = (f"{x} -> {y}" for x, y in (d["bids"], d["max_price"], d["mean_price"]))
        table.add_row(d["auction"], d["start"], *cells)
    console.print(table)


def main() -> None:
    app()
