"""The typer application: ``slipstream up | stream ... | produce | consume | demo``."""

from __future__ import annotations

import inspect
import os
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.markup import escape

from .._errors import BrokerUnavailable, SlipstreamError
from ..broker import FSYNC_MODES, ConnectionLimits
from ..protocol import StreamInfo
from ..streams import parse_size_bytes
from ._acl import acl_app
from ._audit import audit_app
from ._cluster import EXAMPLES as CLUSTER_EXAMPLES
from ._cluster import cluster
from ._common import BrokerOption, connect, err, examples, out, print_json
from ._quotas import quota_app
from ._subscriptions import subscription_app
from ._tokens import token_app


def _flags_show_no_value_type() -> None:
    """typer 0.29 prints a type after every flag (``--yes -y <bool>``), as if flags took a
    value; print nothing there, as click does."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    setattr(TyperOption, "display_type_rich", display_type_rich)  # noqa: B010


def _help_in_whole_lines(*apps: typer.Typer) -> None:
    """Commands' help from their docstrings with the source's line breaks undone: in rich
    mode typer keeps them in the command list, which broke sentences mid-line."""
    for typer_app in apps:
        for info in typer_app.registered_commands:
            doc = info.callback.__doc__ if info.callback is not None else None
            if info.help is None and doc:
                paragraphs = inspect.cleandoc(doc).split("\n\n")
                info.help = "\n\n".join(" ".join(p.split()) for p in paragraphs)


_flags_show_no_value_type()

app = typer.Typer(
    help="slipstream: durable streams on your laptop. Start with 'slipstream up'.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
stream_app = typer.Typer(
    help="Create, update, list, describe and delete streams.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.add_typer(stream_app, name="stream")
txn_app = typer.Typer(
    help="See and abort open transactions; show a transactional id's last commit.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.add_typer(txn_app, name="txn")
app.add_typer(subscription_app, name="subscription")
app.add_typer(quota_app, name="quota")
app.add_typer(acl_app, name="acl")
app.add_typer(audit_app, name="audit")
app.add_typer(token_app, name="token")
app.command("cluster", epilog=CLUSTER_EXAMPLES)(cluster)


@app.callback()
def _root(
    tls: Annotated[
        bool,
        typer.Option(
            "--tls",
            help="Connect to the broker with TLS, verifying its certificate (implied by "
            "--tls-ca; $SLIPSTREAM_TLS).",
        ),
    ] = False,
    tls_ca: Annotated[
        Path | None,
        typer.Option(help="CA that signed the broker's certificate ($SLIPSTREAM_TLS_CA)."),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(help="Client certificate, for mutual TLS ($SLIPSTREAM_TLS_CERT)."),
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(help="Key of --tls-cert ($SLIPSTREAM_TLS_KEY).")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Token for a broker with --auth ($SLIPSTREAM_TOKEN; see 'slipstream token').",
            show_default=False,
        ),
    ] = None,
) -> None:
    """slipstream: durable streams, replayable history, exactly-once pipelines."""
    # every command connects through slipstream.connect, which reads these (docs/security.md)
    for name, value in (
        ("SLIPSTREAM_TLS", "1" if tls else None),
        ("SLIPSTREAM_TLS_CA", tls_ca),
        ("SLIPSTREAM_TLS_CERT", tls_cert),
        ("SLIPSTREAM_TLS_KEY", tls_key),
        ("SLIPSTREAM_TOKEN", token),
    ):
        if value is not None:
            os.environ[name] = str(value)


@app.command(epilog="Example: slipstream up --data-dir ./.slipstream --fsync always")
def up(
    data_dir: Annotated[Path, typer.Option(help="Where streams are stored.")] = Path(".slipstream"),
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for clients.")] = 7070,
    http_port: Annotated[
        int,
        typer.Option(
            help="Port of the admin HTTP API, /metrics and the console (same host); 0: any "
            "free port (logged); -1: no HTTP server (docs/http-api.md)."
        ),
    ] = 7071,
    fsync: Annotated[
        str,
        typer.Option(
            help="always: acknowledge after fdatasync (default, nothing acknowledged is lost); "
            "interval: acknowledge after write, sync every 50 ms; never: leave it to the OS."
        ),
    ] = "always",
    containers: Annotated[
        int, typer.Option(help="Journals (set when the data dir is created).")
    ] = 4,
    max_batch: Annotated[str, typer.Option(help="Largest batch a producer may send.")] = "8MiB",
    roll: Annotated[
        str, typer.Option(help="Journal file size that triggers a move to chunks.")
    ] = "64MiB",
    roll_seconds: Annotated[
        float, typer.Option(help="Move journal data to chunks at least this often.")
    ] = 300.0,
    retention_check_seconds: Annotated[
        float, typer.Option(help="How often retention runs.")
    ] = 30.0,
    idle_timeout: Annotated[
        float,
        typer.Option(
            help="Close a connection silent this many seconds with nothing open (no follow, "
            "request or append); clients connect again when they need to."
        ),
    ] = 300.0,
    max_follows: Annotated[
        int,
        typer.Option(help="Open follows per connection: a reader opens one per segment it reads."),
    ] = 4096,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            help="PEM certificate (chain): clients and the HTTP API then use TLS only "
            "(docs/security.md); SIGHUP reloads it."
        ),
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(help="Require client certificates signed by this CA (mutual TLS)."),
    ] = None,
    meta: Annotated[
        str | None,
        typer.Option(
            help="Keep the catalog (streams, chunks, subscriptions, transactions) on PostgreSQL: "
            "postgresql://user:password@host:port/database (docs/operations.md). Default: SQLite "
            "in --data-dir.",
            show_default=False,
        ),
    ] = None,
    auth: Annotated[
        bool,
        typer.Option(
            "--auth",
            help="Require authentication: a token or a client certificate on every connection "
            "and HTTP request (docs/security.md); keys are made in --data-dir on first start.",
        ),
    ] = False,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen on a non-loopback --host without --auth (anyone who reaches the port "
            "may do anything); logs a warning.",
        ),
    ] = False,
    objects: Annotated[
        str | None,
        typer.Option(
            help="Keep chunks (tier 2) in an S3-compatible object store: s3://bucket/prefix; "
            "credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (docs/operations.md). "
            "Default: files in --data-dir.",
            show_default=False,
        ),
    ] = None,
    s3_endpoint: Annotated[
        str | None,
        typer.Option(
            help="The object store's URL, e.g. http://127.0.0.1:8333 (default: "
            "AWS_ENDPOINT_URL, else AWS).",
            show_default=False,
        ),
    ] = None,
    objects_cache: Annotated[
        str, typer.Option(help="Local read cache of --objects chunks, in --data-dir.")
    ] = "1GiB",
    broker_id: Annotated[
        str | None,
        typer.Option(
            help="This broker's name as the holder of its containers' leases in the catalog "
            '(docs/operations.md, "Leases and fencing"). Default: host:port and a random '
            "suffix made once per data directory.",
            show_default=False,
        ),
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option(
            help="In a cluster (docs/cluster.md): the host:port other brokers and clients "
            "reach this broker at, when it differs from --host:--port (a container, NAT).",
            show_default=False,
        ),
    ] = None,
    lease_ttl: Annotated[
        float | None,
        typer.Option(
            help="Seconds a container's lease lasts unless renewed (every third of it); a "
            "broker that cannot renew stops acknowledging appends by then, and another may "
            "take the containers over after it. Default: 5 in a cluster, 10 standalone.",
            show_default=False,
        ),
    ] = None,
    journal: Annotated[
        str,
        typer.Option(
            help="Where appends are made durable before they are acknowledged: 'files' in "
            "--data-dir (fsync), or 'objects': one object per group commit in the --objects "
            'store, recorded in the catalog (docs/operations.md, "Journals in object '
            'storage").'
        ),
    ] = "files",
    journal_group_ms: Annotated[
        int | None,
        typer.Option(
            help="Group commit window: a group waits this long after its first append (or "
            "until --journal-group-bytes are queued) before one write and sync. Default: 50 "
            "with --journal objects, 0 with files.",
            show_default=False,
        ),
    ] = None,
    journal_group_bytes: Annotated[
        str, typer.Option(help="Group commit size that ends the window early.")
    ] = "4MiB",
) -> None:
    """Start the broker in the foreground; Ctrl-C (SIGINT) or SIGTERM stops it cleanly,
    SIGHUP reloads the TLS certificate files."""
    from .._tls import ServerTls
    from ._up import is_loopback, run_broker, setup_logging

    if fsync not in FSYNC_MODES:
        raise typer.BadParameter(f"use one of {', '.join(FSYNC_MODES)}", param_hint="--fsync")
    if not idle_timeout > 0:
        raise typer.BadParameter("must be more than 0 seconds", param_hint="--idle-timeout")
    if max_follows < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--max-follows")
    if not -1 <= http_port <= 65535:
        raise typer.BadParameter("use a port 0-65535, or -1 for none", param_hint="--http-port")
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("pass --tls-cert and --tls-key together", param_hint="--tls-cert")
    if tls_client_ca is not None and tls_cert is None:
        raise typer.BadParameter("needs --tls-cert and --tls-key", param_hint="--tls-client-ca")
    tls = None
    if tls_cert is not None and tls_key is not None:
        tls = ServerTls(tls_cert, tls_key, tls_client_ca)
    if not auth and not insecure and not is_loopback(host):
        raise typer.BadParameter(
            f"{host} is reachable from other machines, and without --auth anyone who reaches "
            "the port may read, write and delete every stream. Pass --auth (then create the "
            "first admin token with 'slipstream token create --data-dir DIR --subject ops "
            "--role admin'), or --insecure to accept that, or listen on 127.0.0.1",
            param_hint="--host",
        )
    if meta is not None and not meta.startswith(("postgresql://", "postgres://")):
        raise typer.BadParameter(
            "use a PostgreSQL URL: postgresql://user:password@host:port/database",
            param_hint="--meta",
        )
    if objects is not None and not objects.startswith("s3://"):
        raise typer.BadParameter("use s3://bucket/prefix", param_hint="--objects")
    if s3_endpoint is not None and objects is None:
        raise typer.BadParameter("needs --objects", param_hint="--s3-endpoint")
    if lease_ttl is not None and not lease_ttl >= 0.1:
        raise typer.BadParameter("must be at least 0.1 seconds", param_hint="--lease-ttl")
    if advertise is not None and not _is_address(advertise):
        raise typer.BadParameter("use host:port, e.g. 10.0.0.5:7070", param_hint="--advertise")
    if broker_id is not None and not broker_id.strip():
        raise typer.BadParameter("must not be empty", param_hint="--broker-id")
    if journal not in ("files", "objects"):
        raise typer.BadParameter("use files or objects", param_hint="--journal")
    if journal == "objects" and objects is None:
        raise typer.BadParameter("needs --objects s3://bucket/prefix", param_hint="--journal")
    if journal == "objects" and fsync != "always":
        raise typer.BadParameter(
            "an object journal acknowledges only stored and recorded groups: use --fsync "
            "always (the default)",
            param_hint="--fsync",
        )
    if journal_group_ms is not None and not 0 <= journal_group_ms <= 10_000:
        raise typer.BadParameter("use 0 to 10000 milliseconds", param_hint="--journal-group-ms")
    setup_logging(log_level)
    run_broker(
        data_dir,
        host,
        port,
        fsync,
        containers=containers,
        max_batch_bytes=parse_size_bytes(max_batch),
        roll_bytes=parse_size_bytes(roll),
        roll_ms=int(roll_seconds * 1000),
        retention_check_ms=int(retention_check_seconds * 1000),
        connection=ConnectionLimits(idle_timeout=idle_timeout, max_follows=max_follows),
        http_port=None if http_port == -1 else http_port,
        tls=tls,
        meta=meta,
        auth=auth,
        objects=objects,
        s3_endpoint=s3_endpoint,
        objects_cache_bytes=0 if objects_cache.strip() == "0" else parse_size_bytes(objects_cache),
        broker_id=broker_id,
        advertise=advertise,
        lease_ttl_ms=None if lease_ttl is None else int(lease_ttl * 1000),
        journal=journal,
        journal_group_ms=journal_group_ms,
        journal_group_bytes=parse_size_bytes(journal_group_bytes),
    )


# --- streams -----------------------------------------------------------------------------------

StreamName = Annotated[str, typer.Argument(help="Stream name: scope/name, e.g. demo/orders.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]


ScaleByEvents = Annotated[
    str | None,
    typer.Option(
        help="Scale by load: aim at this many events per second per segment (5000/s, 5k/s); "
        "hot segments split, cold neighbours merge (docs/scaling.md).",
        show_default=False,
    ),
]
ScaleByBytes = Annotated[
    str | None,
    typer.Option(
        help="Scale by load: aim at this many stored bytes per second per segment (2MiB/s).",
        show_default=False,
    ),
]
ScaleFactor = Annotated[
    int | None,
    typer.Option(
        help="The most successors one split makes (2 or more; default 2).", show_default=False
    ),
]
MinSegments = Annotated[
    int | None,
    typer.Option(
        help="Never fewer open segments (default 1); a new stream starts with this many.",
        show_default=False,
    ),
]
MaxSegments = Annotated[
    int | None,
    typer.Option(help="Never more open segments (default: the limit, 1024).", show_default=False),
]


def _policy_text(info: StreamInfo) -> str:
    return f", scaling {info.scaling}" if info.scaling else ""


@stream_app.command(
    "create",
    epilog=examples(
        "slipstream stream create demo/orders --segments 4",
        "slipstream stream create demo/clicks --retention-time 7d --retention-bytes 10GiB",
        "slipstream stream create demo/events --scale-by-events 5000/s --scale-factor 2 "
        "--min-segments 1 --max-segments 64",
        "slipstream stream create demo/blobs --scale-by-bytes 2MiB/s",
    ),
)
def stream_create(
    name: StreamName,
    segments: Annotated[
        int | None,
        typer.Option(
            "--segments",
            "-s",
            help="Segments (parallelism; keys are spread). Default 1; they change only by hand "
            "('slipstream stream scale') unless a --scale-by option is given.",
            show_default=False,
        ),
    ] = None,
    retention_time: Annotated[
        str | None, typer.Option(help="Keep events this long: 90s, 15m, 12h, 7d, 1h30m.")
    ] = None,
    retention_bytes: Annotated[
        str | None, typer.Option(help="Keep at most this much data: 512MiB, 10GiB, 1TB.")
    ] = None,
    scale_by_events: ScaleByEvents = None,
    scale_by_bytes: ScaleByBytes = None,
    scale_factor: ScaleFactor = None,
    min_segments: MinSegments = None,
    max_segments: MaxSegments = None,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Create a stream. Without retention options it keeps everything; without a --scale-by
    option its segments change only by hand."""
    from ..streams import policy_from_options
    from ._streams import retention_text, stream_dict

    by_rate = scale_by_events is not None or scale_by_bytes is not None
    policy = policy_from_options(
        # --segments alone is a segment count, not fixed(n): a stream without a policy scales
        # by hand freely; with a rate option it is refused (use --min-segments)
        segments=segments if by_rate else None,
        scale_by_events=scale_by_events,
        scale_by_bytes=scale_by_bytes,
        scale_factor=scale_factor,
        min_segments=min_segments,
        max_segments=max_segments,
    )
    with connect(broker) as client:
        info = client.create_stream(
            name,
            1 if segments is None else segments,
            retention_time=retention_time,
            retention_bytes=retention_bytes,
            scaling=policy,
        )
    if as_json:
        print_json(stream_dict(info))
    else:
        err.print(
            f"created [bold cyan]{escape(info.name)}[/]: {len(info.segments)} segment"
            f"{'s' if len(info.segments) != 1 else ''}, retention {retention_text(info)}"
            f"{escape(_policy_text(info))}",
            highlight=False,
            soft_wrap=True,
        )


@stream_app.command(
    "update",
    epilog=examples(
        "slipstream stream update demo/orders --retention-time 7d --retention-bytes 10GiB",
        "slipstream stream update demo/orders --retention-time forever",
        "slipstream stream update demo/orders --retention-bytes unlimited --json",
        "slipstream stream update demo/orders --scale-by-events 5000/s --max-segments 64",
        "slipstream stream update demo/orders --segments 8",
        "slipstream stream update demo/orders --no-scaling",
    ),
)
def stream_update(
    name: StreamName,
    retention_time: Annotated[
        str | None,
        typer.Option(
            help="Keep events this long: 90s, 15m, 12h, 7d, 1h30m; 'forever' removes the limit."
        ),
    ] = None,
    retention_bytes: Annotated[
        str | None,
        typer.Option(
            help="Keep at most this much data: 512MiB, 10GiB, 1TB; 'unlimited' removes the limit."
        ),
    ] = None,
    scale_by_events: ScaleByEvents = None,
    scale_by_bytes: ScaleByBytes = None,
    scale_factor: ScaleFactor = None,
    min_segments: MinSegments = None,
    max_segments: MaxSegments = None,
    segments: Annotated[
        int | None,
        typer.Option(
            "--segments",
            "-s",
            help="Keep exactly this many open segments (the policy fixed(n)); the broker "
            "splits or merges to get there.",
            show_default=False,
        ),
    ] = None,
    no_scaling: Annotated[
        bool,
        typer.Option(
            "--no-scaling",
            help="Remove the scaling policy: segments stay as they are and change only by hand.",
        ),
    ] = False,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Change a stream's retention or scaling policy. An option left out keeps that limit
    or the policy as it is; a --scale-by option replaces the whole policy (options not given
    take their defaults). The broker applies new limits at its next retention pass
    (--retention-check-seconds of 'slipstream up'): shrinking one removes the old data then,
    for good. A new policy applies from the broker's next scaling pass (within a second or
    so), its bounds first."""
    from .._errors import InvalidArgument
    from ..streams import ScalingPolicy, policy_from_options
    from ._streams import retention_text, stream_dict

    policy: ScalingPolicy | str | None = policy_from_options(
        segments=segments,
        scale_by_events=scale_by_events,
        scale_by_bytes=scale_by_bytes,
        scale_factor=scale_factor,
        min_segments=min_segments,
        max_segments=max_segments,
    )
    if no_scaling:
        if policy is not None:
            raise InvalidArgument(
                "--no-scaling removes the policy; leave out --segments and the --scale options"
            )
        policy = ""
    if retention_time is None and retention_bytes is None and policy is None:
        raise typer.BadParameter(
            "nothing to change: give --retention-time, --retention-bytes or both, or a scaling "
            "option (--scale-by-events, --scale-by-bytes, --segments, --no-scaling)",
            param_hint="'--retention-time' / '--retention-bytes'",
        )
    with connect(broker) as client:
        info = client.update_stream(
            name, retention_time=retention_time, retention_bytes=retention_bytes, scaling=policy
        )
    if as_json:
        print_json(stream_dict(info))
    else:
        err.print(
            f"updated [bold cyan]{escape(info.name)}[/]: retention {retention_text(info)}"
            f"{escape(_policy_text(info) or ', no scaling policy')}",
            highlight=False,
            soft_wrap=True,
        )


@stream_app.command(
    "list",
    epilog=examples("slipstream stream list", "slipstream stream list --scope demo --json"),
)
def stream_list(
    scope: Annotated[str | None, typer.Option(help="Only streams of this scope.")] = None,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """List streams with their segment, event and byte counts."""
    from ._streams import stream_dict, streams_table

    with connect(broker) as client:
        infos = sorted(client.list_streams(scope), key=lambda info: info.name)
    if as_json:
        print_json([stream_dict(info) for info in infos])
    else:
        out.print(streams_table(infos))


@stream_app.command(
    "describe",
    epilog=examples(
        "slipstream stream describe demo/orders",
        "slipstream stream describe demo/orders --json",
        "slipstream stream describe demo/orders --history",
        "slipstream stream describe demo/orders --history --json",
    ),
)
def stream_describe(
    name: StreamName,
    history: Annotated[
        bool,
        typer.Option(
            "--history",
            help="Show the epochs over time instead: when each split or merge happened, which "
            "segments it sealed (with their end offsets) and opened, which segment owned which "
            "key range, and why (by hand, or the rule with its rates and threshold).",
        ),
    ] = False,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Show a stream's segments: key-hash ranges (hex), events, offsets, bytes, first and
    last event times. Events counts what is retained: end offset minus start offset. Once
    the stream has scaled, segments of every epoch are listed: a sealed one's End is its final
    end, and From/to names its predecessors (<-) and successors (->)."""
    from ._streams import describe_table, history_dict, history_text, stream_dict

    with connect(broker) as client:
        info = client.describe_stream(name)
        events = client.scale_history(name) if history else []
    if history:
        document = history_dict(info, events)
        if as_json:
            print_json(document)
        else:
            out.print(history_text(document), highlight=False)
    elif as_json:
        print_json(stream_dict(info))
    else:
        out.print(describe_table(info))


@stream_app.command(
    "scale",
    epilog=examples(
        "slipstream stream scale demo/orders --split 0",
        "slipstream stream scale demo/orders --split 0 --into 4",
        "slipstream stream scale demo/orders --merge 2 3",
        "slipstream stream scale demo/orders --merge 2,3,4 --json",
    ),
)
def stream_scale(
    name: StreamName,
    split: Annotated[
        int | None,
        typer.Option(help="Split this open segment into --into successors.", show_default=False),
    ] = None,
    into: Annotated[int, typer.Option(help="How many successors a split makes (2 or more).")] = 2,
    merge: Annotated[
        list[str] | None,
        typer.Option(
            help="Merge these adjacent open segments into one: --merge 2 3 or --merge 2,3.",
            show_default=False,
        ),
    ] = None,
    more: Annotated[list[str] | None, typer.Argument(hidden=True, metavar="SEGMENT")] = None,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Split or merge segments by hand. The old segments are sealed and their successors
    opened in a new epoch, in one step (also across a broker crash); producers and readers
    follow by themselves and every key keeps its order. Under a scaling policy the result must
    stay within its --min-segments and --max-segments."""
    from .._errors import InvalidArgument
    from ._streams import stream_dict

    segments = _merge_segments(merge, more)
    if (split is None) == (segments is None):
        raise InvalidArgument(
            "give --split SEGMENT [--into N] or --merge SEGMENT SEGMENT [...]; "
            "'slipstream stream describe NAME' lists the segments"
        )
    if segments is not None and len(segments) < 2:
        raise InvalidArgument(
            f"--merge needs two or more adjacent segments, got {len(segments)}; "
            "to divide one, use --split"
        )
    with connect(broker) as client:
        if split is not None:
            info = client.scale_stream(name, split=split, into=into)
        else:
            info = client.scale_stream(name, merge=segments)
    created = [s for s in info.segments if s.epoch == info.epoch]
    if as_json:
        document = stream_dict(info)
        document["opened"] = [s.number for s in created]
        print_json(document)
        return
    sealed = str(split) if split is not None else ", ".join(str(n) for n in segments or [])
    opened = ", ".join(f"{s.number} ({s.key_lo:016x}-{s.key_hi:016x})" for s in created)
    err.print(
        f"scaled [bold cyan]{escape(info.name)}[/] to epoch {info.epoch}: sealed {sealed}, "
        f"opened {escape(opened)}",
        highlight=False,
        soft_wrap=True,
    )


def _merge_segments(merge: list[str] | None, more: list[str] | None) -> list[int] | None:
    """``--merge 2 3``, ``--merge 2,3`` or ``--merge 2 --merge 3`` -> [2, 3]: click options
    take one value, so the numbers after the first arrive as extra arguments."""
    from .._errors import InvalidArgument

    if merge is None:
        if more:
            raise InvalidArgument(
                f"unexpected {' '.join(more)!r}: segments to merge follow --merge, e.g. --merge 2 3"
            )
        return None
    numbers = []
    for text in [*merge, *(more or [])]:
        for part in text.split(","):
            if not part.strip().isdigit():
                raise InvalidArgument(
                    f"--merge takes segment numbers, got {part.strip()!r}; e.g. --merge 2 3"
                )
            numbers.append(int(part))
    return numbers


@stream_app.command(
    "delete",
    epilog=examples(
        "slipstream stream delete demo/orders", "slipstream stream delete demo/orders --yes"
    ),
)
def stream_delete(
    name: StreamName,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    broker: BrokerOption = "",
) -> None:
    """Delete a stream and all its events. Asks first unless --yes; without a terminal to
    ask on, --yes is required."""
    from ..streams import human_bytes

    with connect(broker) as client:
        if not yes:
            info = client.describe_stream(name)
            events = sum(s.end_offset - s.start_offset for s in info.segments)
            size = human_bytes(sum(s.bytes for s in info.segments))
            if not sys.stdin.isatty():
                raise typer.BadParameter(
                    f"{name} holds {events:,} events ({size}); pass --yes to delete it",
                    param_hint="--yes",
                )
            typer.confirm(f"Delete {name} and its {events:,} events ({size})?", abort=True)
        client.delete_stream(name)
    err.print(f"deleted [bold cyan]{escape(name)}[/]", highlight=False)


# --- produce and consume -----------------------------------------------------------------------


@app.command(
    epilog=examples(
        """echo '{"key": "user-42", "value": {"item": "book", "price": 12.5}}' """
        "| slipstream produce demo/orders",
        "cat orders.jsonl | slipstream produce demo/orders --key-field user",
        "tail -f app.log | slipstream produce demo/logs --raw",
    )
    + '\n\nA JSON object with a "value" field is an envelope: key, value (any JSON; a string is '
    "sent as its text, anything else as its JSON), headers (strings), timestamp (ms or "
    "ISO-8601). Any other line is the value itself.",
)
def produce(
    name: StreamName,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send each line's bytes as the value, no JSON.")
    ] = False,
    key_field: Annotated[
        str | None,
        typer.Option(help="Key each event by this top-level field of the value object."),
    ] = None,
    skip_bad: Annotated[
        bool,
        typer.Option("--skip-bad", help="Skip bad lines (and count them) instead of stopping."),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as JSON on stdout.")
    ] = False,
    linger_ms: Annotated[
        float, typer.Option(help="How long a batch may wait for more events.")
    ] = 5.0,
    batch_size: Annotated[
        str,
        typer.Option(
            help="Largest batch the producer sends, and so the largest event (up to the "
            "broker's --max-batch, 8MiB by default, less 64KiB of framing)."
        ),
    ] = "2MiB",
    skip: Annotated[
        int,
        typer.Option(
            min=0,
            help="Skip the first N input lines: resume where a failed run said its "
            "acknowledged events end.",
        ),
    ] = 0,
    delivery_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds to keep retrying events while the broker is unreachable before "
            "giving up on them (exit 1 with a resume hint).",
        ),
    ] = 120.0,
    broker: BrokerOption = "",
) -> None:
    """Send JSON lines (or raw lines) from stdin as events; every event is acknowledged
    (durable) before the command exits 0. A bad line stops it with exit code 1, naming the
    line; the events before it are sent. Events the broker cannot take (the stream was deleted,
    the broker stayed down) stop it with exit code 1, the count that was acknowledged and the
    --skip that resumes. Ctrl-C stops it with exit code 130 after the events read so far are
    acknowledged. A summary goes to stderr."""
    from ._produce import (
        Acknowledgements,
        DeliveryFailed,
        LineParser,
        ProduceStats,
        ProgressReport,
        StoppedAtBadLine,
        produce_lines,
        stdin_lines,
    )

    batch_bytes = parse_size_bytes(batch_size)
    lines = stdin_lines()
    parser = LineParser(raw=raw, key_field=key_field)
    stopped: StoppedAtBadLine | None = None
    failure: BaseException | None = None
    interrupted = False
    acks = Acknowledgements()
    stats = ProduceStats(name)
    with connect(broker, reconnect_timeout=delivery_timeout) as client:
        report: ProgressReport | None = None
        try:
            with client.producer(
                name,
                linger_ms=linger_ms,
                batch_bytes=batch_bytes,
                delivery_timeout=delivery_timeout,
            ) as producer:
                report = ProgressReport(err, lines)
                stats.started = time.monotonic()
                try:
                    produce_lines(
                        producer,
                        lines,
                        parser,
                        stats,
                        acks,
                        skip_bad=skip_bad,
                        report=report,
                        warn=err,
                        skip_lines=skip,
                    )
                except StoppedAtBadLine as exc:
                    stopped = exc
                except DeliveryFailed as exc:
                    failure = exc.error
                except KeyboardInterrupt:
                    interrupted = True
        except SlipstreamError as exc:  # leaving the block: events that were not acknowledged
            if stats.events == 0 and failure is None:
                raise  # the producer never opened (unknown stream, bad --batch-size)
            failure = failure or exc
        finally:
            if report is not None:
                report.close()
        stats.elapsed = time.monotonic() - stats.started
    stats.acknowledged = acks.total()
    if failure is None and acks.error is not None:
        failure = acks.error
    if failure is None and acks.unfinished():
        failure = BrokerUnavailable("the producer closed with events not acknowledged")
    if failure is not None:
        stats.resume_line = acks.first_unacknowledged_line() or stats.lines + 1
        message = failure.message if isinstance(failure, SlipstreamError) else str(failure)
        err.print(f"[bold red]error[/]: {escape(message)}", highlight=False, soft_wrap=True)
        err.print(escape(stats.failure_summary(acks)), highlight=False, soft_wrap=True)
    if stopped is not None:
        err.print(f"[bold red]error[/]: {escape(str(stopped))}", highlight=False, soft_wrap=True)
        err.print(
            f"stopped at line {stopped.line_number}: the {stats.acknowledged:,} events before "
            "it are acknowledged; fix the line, or pass --skip-bad to skip bad lines",
            highlight=False,
            soft_wrap=True,
        )
    if failure is None:
        err.print(stats.summary(), highlight=False, soft_wrap=True)
    if as_json:
        print_json(stats.as_dict())
    if stopped is not None or failure is not None:
        raise typer.Exit(1)
    if interrupted:
        raise typer.Exit(130)


class OutputFormat(StrEnum):
    json = "json"
    raw = "raw"
    table = "table"


@app.command(
    epilog=examples(
        "slipstream consume demo/orders --from earliest",
        "slipstream consume demo/orders --from latest --follow --format table",
        "slipstream consume demo/orders --from 2026-11-21T08:00:00Z --limit 100",
        "slipstream consume demo/orders --from -15m --follow",
        "slipstream consume demo/orders --limit 1000 --end-cut 2> cut.json",
        """slipstream consume demo/orders --from "$(cat cut.json)" """,
        "slipstream consume demo/orders --subscription billing --follow",
        "slipstream consume demo/orders --key user-42 --last 100",
        "slipstream consume demo/orders --from 2026-11-21T10:00Z --to 2026-11-21T10:05Z",
    ),
)
def consume(
    name: StreamName,
    start: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="earliest (the default), latest, an ISO-8601 time with a timezone, a time "
            "relative to now (-30s, -15m, -1h, -2d), or a StreamCut (JSON, as printed by "
            "--end-cut).",
            show_default=False,
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep following new events until Ctrl-C (which exits 0)."
        ),
    ] = False,
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", min=0, help="Stop after this many events.")
    ] = None,
    fmt: Annotated[
        OutputFormat,
        typer.Option(
            "--format",
            help="json: one object per line (key, value, headers, timestamp, time, segment, "
            "offset); raw: each value's bytes and a newline; table: columns for people.",
        ),
    ] = OutputFormat.json,
    end_cut: Annotated[
        bool,
        typer.Option(
            "--end-cut",
            help="At exit, print to stderr the StreamCut to resume from with --from.",
        ),
    ] = False,
    subscription: Annotated[
        str | None,
        typer.Option(
            help="Join this subscription's group instead (see 'slipstream subscription'): "
            "print the events of the segments the group gives this member, from the "
            "subscription's committed position, and commit them.",
        ),
    ] = None,
    commit: Annotated[
        str | None,
        typer.Option(
            help="With --subscription: auto (the default: what was printed is committed about "
            "once a second and at exit; at-least-once) or at_most_once (committed before it "
            "is printed).",
            show_default=False,
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            help="Find this routing key's events (through the broker's find index, not a "
            "scan): the last 100, or --last N, or the first --limit N from --from.",
            show_default=False,
        ),
    ] = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="Find events before this time (ISO-8601 with a timezone, or relative: -5m); "
            "with --from, the events of that window.",
            show_default=False,
        ),
    ] = None,
    last: Annotated[
        int | None,
        typer.Option(
            "--last", min=1, max=10_000, help="Find the newest N events (of --key, in the window)."
        ),
    ] = None,
    broker: BrokerOption = "",
) -> None:
    """Print a stream's events on stdout. Without --follow it reads up to the stream's end as
    of now and exits; with --follow it prints new events as soon as they are durable. With
    --subscription it is a member of that subscription's group: it reads from the committed
    position and commits what it printed. With --key, --to or --last it finds events through
    the broker's find index instead of reading the stream: a key's events, or a window's."""
    from ._consume import run_consume, run_find, run_group_consume

    if key is not None or to is not None or last is not None:
        clash = [
            flag
            for flag, given in (
                ("--follow", follow),
                ("--end-cut", end_cut),
                ("--subscription", subscription is not None),
            )
            if given
        ]
        if clash:
            raise typer.BadParameter(
                "a find (--key, --to, --last) prints what is stored and exits",
                param_hint=f"'{clash[0]}' with '--key' / '--to' / '--last'",
            )
        if last is not None and limit is not None:
            raise typer.BadParameter(
                "--last takes the newest events, --limit the first ones: give one",
                param_hint="'--last' with '--limit'",
            )
        if limit is not None and not 1 <= limit <= 10_000:
            raise typer.BadParameter("a find returns 1 to 10000 events", param_hint="--limit")
        with connect(broker) as client:
            code = run_find(
                client,
                name,
                key=key,
                start=start,
                end=to,
                last=last,
                limit=limit,
                fmt=fmt.value,
                console=out,
            )
        if code:
            raise typer.Exit(code)
        return

    if subscription is not None:
        if start is not None or end_cut:
            raise typer.BadParameter(
                "a group member starts from the subscription's committed position; move it "
                "with 'slipstream subscription reset STREAM NAME --to ...'",
                param_hint="'--from' / '--end-cut' with '--subscription'",
            )
        with connect(broker) as client:
            code = run_group_consume(
                client,
                name,
                subscription,
                commit=commit or "auto",
                follow=follow,
                limit=limit,
                fmt=fmt.value,
                console=out,
            )
        if code:
            raise typer.Exit(code)
        return
    if commit is not None:
        raise typer.BadParameter("needs --subscription", param_hint="--commit")
    with connect(broker) as client:
        code = run_consume(
            client,
            name,
            start or "earliest",
            follow=follow,
            limit=limit,
            fmt=fmt.value,
            end_cut=end_cut,
            console=out,
        )
    if code:
        raise typer.Exit(code)


# --- demo --------------------------------------------------------------------------------------


@app.command(
    epilog=examples(
        "slipstream demo",
        "slipstream demo --rate 5000 --duration 60",
        "slipstream demo --broker 127.0.0.1:7070",
    ),
)
def demo(
    rate: Annotated[float, typer.Option(min=1, help="Orders produced per second.")] = 1000.0,
    duration: Annotated[
        float | None, typer.Option(min=0, help="Stop after this many seconds (default: Ctrl-C).")
    ] = None,
    broker: Annotated[
        str | None,
        typer.Option(
            help="Use this running broker (host:port) instead of starting one. "
            "$SLIPSTREAM_BROKER is not consulted: the demo brings its own broker."
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(help="Port for the demo's broker (default: 7070 if free, else any free)."),
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="Data directory of the demo's broker.")] = Path(
        ".slipstream/demo-data"
    ),
    segments: Annotated[
        int, typer.Option(min=1, help="Segments of demo/orders when it is created.")
    ] = 4,
    fsync: Annotated[
        str, typer.Option(help="The demo broker's --fsync: always, interval or never.")
    ] = "always",
    as_json: Annotated[
        bool, typer.Option("--json", help="No live view; print the summary as JSON on stdout.")
    ] = False,
) -> None:
    """Live demo: start a broker, produce realistic order events to demo/orders (keyed by
    user) and follow them, showing rates and end-to-end latency until Ctrl-C or --duration.
    Then everything stops cleanly, broker included."""
    from ._demo import run_demo

    if fsync not in FSYNC_MODES:
        raise typer.BadParameter(f"use one of {', '.join(FSYNC_MODES)}", param_hint="--fsync")
    summary = run_demo(
        broker=broker,
        port=port,
        data_dir=data_dir,
        fsync=fsync,
        rate=rate,
        segments=segments,
        duration=duration,
        as_json=as_json,
        console=out,
    )
    if as_json:
        print_json(summary)


@txn_app.command("list", epilog=examples("slipstream txn list", "slipstream txn list --json"))
def txn_list(as_json: JsonFlag = False, broker: BrokerOption = "") -> None:
    """Open transactions: id, transactional id, state, age, timeout, events, bytes and how
    many segments they touch. Their events are invisible to readers until they commit."""
    from ._txns import txn_dict, txns_table

    with connect(broker) as client:
        txns = client.transactions()
    if as_json:
        print_json([txn_dict(t) for t in txns])
    else:
        out.print(txns_table(txns))


@txn_app.command("abort", epilog=examples("slipstream txn list", "slipstream txn abort 2005"))
def txn_abort(
    txn_id: Annotated[int, typer.Argument(help="Transaction id, from 'slipstream txn list'.")],
    broker: BrokerOption = "",
) -> None:
    """Abort an open transaction: its events are discarded and never become visible; its
    owner's commit fails with TransactionAborted (and it may run the transaction again)."""
    with connect(broker) as client:
        client.abort_transaction(txn_id)
    err.print(f"aborted transaction {txn_id}")


@txn_app.command("hand-over", epilog=examples("slipstream txn hand-over spark:orders-enricher bob"))
def txn_hand_over(
    transactional_id: Annotated[str, typer.Argument(help="The transactional id.")],
    subject: Annotated[str, typer.Argument(help="The subject that owns it from now on.")],
    broker: BrokerOption = "",
) -> None:
    """With authentication on, a transactional id belongs to the subject that first
    initialised it: hand it to another subject (admin only). Its running producer is not
    fenced; the new owner's next start does that."""
    with connect(broker) as client:
        client.hand_over(transactional_id, subject)
    err.print(f"transactional id {transactional_id} now belongs to {subject}")


@txn_app.command(
    "status",
    epilog=examples("slipstream txn status enricher-1", "slipstream txn status enricher-1 --json"),
)
def txn_status(
    transactional_id: Annotated[str, typer.Argument(help="The transactional id.")],
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """A transactional id's last committed transaction and the metadata stored with it
    (how an application that restarts knows where it was)."""
    from ._common import iso_ms

    with connect(broker) as client:
        last = client.last_commit(transactional_id)
    if last is None:
        if as_json:
            print_json(None)
        else:
            out.print(f"{escape(transactional_id)} has never committed a transaction")
        return
    document = {
        "txn_id": last.txn_id,
        "committed_ms": last.committed_ms,
        "committed": iso_ms(last.committed_ms),
        "epoch": last.epoch,
        "metadata": last.metadata,
    }
    if as_json:
        print_json(document)
    else:
        out.print(
            f"[bold cyan]{escape(transactional_id)}[/]: transaction {last.txn_id} committed "
            f"{document['committed']} (producer epoch {last.epoch})\n"
            f"metadata: {escape(msgspec.json.encode(last.metadata).decode())}"
        )


@txn_app.command(
    "identities",
    epilog=examples(
        "slipstream txn identities",
        "slipstream txn identities --prefix spark: --json",
    ),
)
def txn_identities(
    prefix: Annotated[
        str, typer.Option(help="Only the transactional ids that start with this.")
    ] = "",
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Transactional ids the broker knows, sorted: producer id, epoch, the last committed
    transaction, when, and the metadata stored with it (the Spark sink's queries are the
    ids under 'spark:'). Needs the admin action when the broker has --auth."""
    from ._txns import identities_table, identity_dict

    with connect(broker) as client:
        identities = client.identities(prefix)
    if as_json:
        print_json([identity_dict(i) for i in identities])
    else:
        out.print(identities_table(identities, prefix))


_help_in_whole_lines(app, stream_app, txn_app, subscription_app, audit_app)


def main() -> None:
    """Entry point: typed slipstream errors become one readable red line and exit code 1."""
    try:
        app()
    except SlipstreamError as exc:
        message = exc.message
        if isinstance(exc, BrokerUnavailable) and "slipstream up" not in message:
            message += "; is the broker running? Start one with 'slipstream up' or pass --broker"
        err.print(f"[bold red]error[/]: {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(1)


def _is_address(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
