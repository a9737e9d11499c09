"""``slipstream subscription create | list | describe | delete | reset``.

A subscription is a named, durable cursor on one stream; ``slipstream consume STREAM
--subscription NAME`` (or ``client.consumer``) joins its group. These commands manage the
cursor and show where its group stands: per segment the committed position, the backlog and
the lag, and the members reading it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import typer
from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from slipstream.protocol import SubscriptionInfo

from .._errors import InvalidArgument
from ..streams import human_bytes, parse_duration_ms
from ._common import (
    BrokerOption,
    connect,
    err,
    examples,
    human_duration_ms,
    iso_ms,
    out,
    print_json,
)

MODES = ("ordered", "queue", "key_ordered_queue")
QUEUE_MODES = ("queue", "key_ordered_queue")

subscription_app = typer.Typer(
    help="Durable subscriptions of a stream (consumer groups and work queues): create, list, "
    "describe (positions, backlog, lag, members), delete and reset.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)

StreamName = Annotated[str, typer.Argument(help="Stream name: scope/name, e.g. demo/orders.")]
SubscriptionName = Annotated[
    str, typer.Argument(help="Subscription name, e.g. billing (lowercase, digits, . _ -).")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
START_HELP = (
    "earliest, latest, an ISO-8601 time with a timezone, a time relative to now (-30s, -15m, "
    "-1h, -2d), or a StreamCut (JSON, as printed by 'slipstream consume --end-cut')."
)


# --- rendering ---------------------------------------------------------------------------------


def human_lag(ms: int) -> str:
    """A lag for people: ``0s``, ``850ms``, ``4.2s``, ``12m30s``, ``2d3h`` (seconds dropped
    above a minute, minutes above a day: a lag is read, not computed with)."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}s"
    if ms < 86_400_000:
        return human_duration_ms(ms - ms % 1000)
    return human_duration_ms(ms - ms % 3_600_000)


def subscription_dict(info: SubscriptionInfo) -> dict[str, Any]:
    """The ``--json`` form: the API's fields, plus the ISO creation time and the totals of
    backlog events, backlog bytes and the largest lag."""
    return {
        "stream": info.stream,
        "name": info.name,
        "mode": info.mode,
        "generation": info.generation,
        "created_ms": info.created_ms,
        "created": iso_ms(info.created_ms),
        "options": dict(info.options),
        "backlog_events": sum(s.backlog_events for s in info.segments),
        "backlog_bytes": sum(s.backlog_bytes for s in info.segments),
        "lag_ms": max((s.lag_ms for s in info.segments), default=0),
        "segments": [msgspec.structs.asdict(s) for s in info.segments],
        "members": [msgspec.structs.asdict(m) for m in info.members],
    }


def _options_text(info: SubscriptionInfo) -> str:
    options = info.options
    if not options:
        return ""
    parts = [
        f"ack timeout {human_duration_ms(options['ack_timeout_ms'])}",
        f"max deliveries {options['max_deliveries']}",
        f"backoff {human_duration_ms(options['backoff_ms'])}"
        f"..{human_duration_ms(options['max_backoff_ms'])}",
        f"max unacked {options['max_unacked']:,}",
        f"dead letters to {options['dead_letter'] or info.stream + '.dlq'}",
    ]
    return ", ".join(parts)


def subscriptions_table(stream: str, infos: list[SubscriptionInfo]) -> Table:
    table = Table(
        title=f"{len(infos)} subscription{'s' if len(infos) != 1 else ''} of {stream}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("Subscription", style="bold cyan", no_wrap=True)
    table.add_column("Mode")
    table.add_column("Generation", justify="right")
    table.add_column("Created")
    for info in infos:
        table.add_row(info.name, info.mode, str(info.generation), iso_ms(info.created_ms))
    return table


def describe_tables(info: SubscriptionInfo) -> list[Text | Table]:
    """A heading, a row per segment (position, end, backlog in events and bytes, lag, the
    member reading it; queues add in flight, waiting and dead-lettered), then a row per
    member."""
    queue = info.mode in QUEUE_MODES
    names = {m.member_id: m.name for m in info.members}
    title = Text.assemble(
        (f"{info.stream} {info.name}", "bold cyan"),
        f"  {info.mode}, generation {info.generation}, created {iso_ms(info.created_ms)}",
    )
    if queue:
        title.append(f"\n{_options_text(info)}", style="dim")
    segments = Table(show_footer=True, box=box.SIMPLE_HEAD)
    segments.add_column("Segment", "total", justify="right")
    segments.add_column("Position", justify="right")
    segments.add_column("End", justify="right")
    segments.add_column(
        "Backlog", f"{sum(s.backlog_events for s in info.segments):,}", justify="right"
    )
    segments.add_column(
        "Backlog bytes",
        human_bytes(sum(s.backlog_bytes for s in info.segments)),
        justify="right",
        no_wrap=True,
    )
    segments.add_column(
        "Lag", human_lag(max((s.lag_ms for s in info.segments), default=0)), justify="right"
    )
    if queue:
        segments.add_column(
            "In flight", f"{sum(s.in_flight for s in info.segments):,}", justify="right"
        )
        segments.add_column(
            "Waiting", f"{sum(s.waiting for s in info.segments):,}", justify="right"
        )
        segments.add_column(
            "Dead-lettered", f"{sum(s.dead_lettered for s in info.segments):,}", justify="right"
        )
    segments.add_column("Member", no_wrap=True)
    for s in info.segments:
        member = f"{s.owner} {names.get(s.owner, '')}".rstrip() if s.owner else "-"
        counts = [f"{s.in_flight:,}", f"{s.waiting:,}", f"{s.dead_lettered:,}"] if queue else []
        segments.add_row(
            str(s.segment),
            f"{s.position:,}",
            f"{s.end_offset:,}",
            f"{s.backlog_events:,}",
            human_bytes(s.backlog_bytes),
            human_lag(s.lag_ms),
            *counts,
            member,
        )
    if not info.members:
        return [title, segments, Text("no members joined", style="dim")]
    members = Table(
        title=f"{len(info.members)} member{'s' if len(info.members) != 1 else ''}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    members.add_column("Id", justify="right")
    members.add_column("Name", style="cyan", no_wrap=True)
    members.add_column("Peer", no_wrap=True)
    members.add_column("Segments")
    members.add_column("Idle", justify="right")
    for m in info.members:
        members.add_row(
            str(m.member_id),
            m.name,
            m.peer,
            ", ".join(map(str, sorted(m.segments))) or "-",
            human_lag(m.idle_ms),
        )
    return [title, segments, members]


def queue_options(
    mode: str,
    ack_timeout: str | None,
    max_deliveries: int | None,
    backoff: str | None,
    max_backoff: str | None,
    max_unacked: int | None,
    dead_letter: str | None,
) -> dict[str, Any]:
    """The client's queue options (seconds) from the command line's (90s, 1m); refuses them
    for an ordered subscription, which has none."""
    seconds = {"ack_timeout": ack_timeout, "backoff": backoff, "max_backoff": max_backoff}
    given: dict[str, Any] = {
        key: parse_duration_ms(text) / 1000 for key, text in seconds.items() if text is not None
    }
    counts = {"max_deliveries": max_deliveries, "max_unacked": max_unacked}
    given.update({key: value for key, value in counts.items() if value is not None})
    if dead_letter is not None:
        given["dead_letter"] = dead_letter
    if given and mode not in QUEUE_MODES:
        flags = ", ".join("--" + key.replace("_", "-") for key in given)
        raise InvalidArgument(
            f"{flags}: options of work queues; add --mode queue or --mode key_ordered_queue"
        )
    return given


# --- commands ----------------------------------------------------------------------------------


@subscription_app.command(
    "create",
    epilog=examples(
        "slipstream subscription create demo/orders billing",
        "slipstream subscription create demo/orders audit --start -1h",
        "slipstream subscription create demo/orders fraud --start latest --exist-ok",
        "slipstream subscription create demo/orders emails --mode queue --ack-timeout 1m "
        "--max-deliveries 3",
    ),
)
def subscription_create(
    stream: StreamName,
    name: SubscriptionName,
    start: Annotated[str, typer.Option("--start", help="Where it begins: " + START_HELP)] = (
        "earliest"
    ),
    mode: Annotated[
        str,
        typer.Option(
            help="ordered: a consumer group, each segment read in order by one member; queue: "
            "events spread over all members, acknowledged one by one; key_ordered_queue: a "
            "queue that hands out one key's events one at a time, in order."
        ),
    ] = "ordered",
    ack_timeout: Annotated[
        str | None,
        typer.Option(
            help="Queues: deliver again what is not acknowledged this long after "
            "delivery (default 30s)."
        ),
    ] = None,
    max_deliveries: Annotated[
        int | None,
        typer.Option(
            min=1, help="Queues: deliveries before an event is dead-lettered (default 5)."
        ),
    ] = None,
    backoff: Annotated[
        str | None,
        typer.Option(help="Queues: first wait before a redelivery; it doubles (default 1s)."),
    ] = None,
    max_backoff: Annotated[
        str | None, typer.Option(help="Queues: longest wait before a redelivery (default 60s).")
    ] = None,
    max_unacked: Annotated[
        int | None,
        typer.Option(
            min=1, help="Queues: events one member may hold unacknowledged (default 1000)."
        ),
    ] = None,
    dead_letter: Annotated[
        str | None,
        typer.Option(help="Queues: stream for events out of deliveries (default <stream>.dlq)."),
    ] = None,
    exist_ok: Annotated[
        bool,
        typer.Option("--exist-ok", help="Succeed if it exists already (it is left as it is)."),
    ] = False,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Create a subscription: a named, durable cursor on a stream. Each subscription receives
    every event of the stream, independently of the others; consumers join it with
    'slipstream consume STREAM --subscription NAME' or client.consumer(STREAM, NAME)."""
    if mode not in MODES:
        raise InvalidArgument(f"--mode {mode!r}: use one of {', '.join(MODES)}")
    options = queue_options(
        mode, ack_timeout, max_deliveries, backoff, max_backoff, max_unacked, dead_letter
    )
    with connect(broker) as client:
        client.create_subscription(stream, name, start, mode, exist_ok=exist_ok, **options)
        info = client.describe_subscription(stream, name)
    if as_json:
        print_json(subscription_dict(info))
        return
    backlog = sum(s.backlog_events for s in info.segments)
    err.print(
        f"subscription [bold cyan]{escape(name)}[/] of {escape(stream)} ({info.mode}): "
        f"{backlog:,} event{'s' if backlog != 1 else ''} to consume",
        highlight=False,
    )


@subscription_app.command(
    "list",
    epilog=examples(
        "slipstream subscription list demo/orders",
        "slipstream subscription list demo/orders --json",
    ),
)
def subscription_list(
    stream: StreamName, as_json: JsonFlag = False, broker: BrokerOption = ""
) -> None:
    """List a stream's subscriptions: name, mode, generation (how often it was reset) and
    creation time. 'describe' shows one's positions, backlog and members."""
    with connect(broker) as client:
        infos = sorted(client.list_subscriptions(stream), key=lambda info: info.name)
    if as_json:
        print_json([subscription_dict(info) for info in infos])
    else:
        out.print(subscriptions_table(stream, infos))


@subscription_app.command(
    "describe",
    epilog=examples(
        "slipstream subscription describe demo/orders billing",
        "slipstream subscription describe demo/orders billing --json",
    ),
)
def subscription_describe(
    stream: StreamName, name: SubscriptionName, as_json: JsonFlag = False, broker: BrokerOption = ""
) -> None:
    """Where a subscription's group stands. Per segment: the committed position (next event
    to consume), the segment's end, the backlog in events and bytes (bytes estimated from the
    segment's average event size), the lag (age of the oldest event not consumed) and the
    member reading it; queues add events in flight, waiting for redelivery and dead-lettered.
    Then the members: id, name, address, segments, time since their last poll."""
    with connect(broker) as client:
        info = client.describe_subscription(stream, name)
    if as_json:
        print_json(subscription_dict(info))
        return
    for table in describe_tables(info):
        out.print(table)


@subscription_app.command(
    "delete",
    epilog=examples("slipstream subscription delete demo/orders billing"),
)
def subscription_delete(
    stream: StreamName, name: SubscriptionName, broker: BrokerOption = ""
) -> None:
    """Delete a subscription and its positions; the stream's events are untouched. Its live
    consumers stop with SubscriptionNotFound at their next poll."""
    with connect(broker) as client:
        client.delete_subscription(stream, name)
    err.print(
        f"deleted subscription [bold cyan]{escape(name)}[/] of {escape(stream)}", highlight=False
    )


@subscription_app.command(
    "reset",
    epilog=examples(
        "slipstream subscription reset demo/orders billing --to -1d",
        "slipstream subscription reset demo/orders billing --to 2026-11-23T00:00:00Z",
        "slipstream subscription reset demo/orders billing --to latest",
        """slipstream subscription reset demo/orders billing --to "$(cat cut.json)" """,
    ),
)
def subscription_reset(
    stream: StreamName,
    name: SubscriptionName,
    to: Annotated[str, typer.Option("--to", help="The new position: " + START_HELP)],
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Move every position of a subscription to --to: how a team reprocesses yesterday
    (--to -1d) or skips a backlog (--to latest). It starts a new generation: live consumers
    restart from the new positions within a poll (no restart of theirs), and commits of
    positions from before the reset are refused."""
    with connect(broker) as client:
        reset = client.reset_subscription(stream, name, to)
        info = client.describe_subscription(stream, name)
    if as_json:
        print_json(subscription_dict(info))
        return
    backlog = sum(s.backlog_events for s in info.segments)
    err.print(
        f"reset [bold cyan]{escape(name)}[/] of {escape(stream)} to {escape(to)}: generation "
        f"{reset.generation}, {backlog:,} event{'s' if backlog != 1 else ''} to consume; live "
        "consumers restart from there",
        highlight=False,
        soft_wrap=True,
    )
