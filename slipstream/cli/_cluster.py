"""``slipstream cluster``: the brokers serving a catalog and which holds each container
(docs/cluster.md). A standalone broker shows itself holding every container."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from ._common import BrokerOption, connect, examples, out, print_json

EXAMPLES = examples(
    "slipstream cluster --broker h1:7070,h2:7070",
    "slipstream cluster --json | jq '.owners'",
)


def cluster(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
    broker: BrokerOption = "",
) -> None:
    """The live brokers (address, HTTP address, up since, containers served) and the owner of
    each container; a container with no owner is moving (a takeover or hand-over under way)."""
    with connect(broker) as client:
        info = client.describe_cluster()
    if as_json:
        print_json(
            {
                "containers": info.containers,
                "brokers": [
                    {
                        "broker_id": b.broker_id,
                        "address": b.address,
                        "http_address": b.http_address,
                        "containers": b.containers,
                        "started_ms": b.started_ms,
                    }
                    for b in info.brokers
                ],
                "owners": [owner or None for owner in info.owners],
            }
        )
        return
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("broker", "address", "http", "up", "containers"):
        table.add_column(column)
    now_ms = time.time() * 1000
    for b in info.brokers:
        table.add_row(
            escape(b.broker_id),
            escape(b.address),
            escape(b.http_address or "-"),
            _duration((now_ms - b.started_ms) / 1000),
            ", ".join(map(str, b.containers)) or "-",
        )
    out.print(table)
    moving = [str(c) for c, owner in enumerate(info.owners) if not owner]
    out.print(
        f"{info.containers} containers, {len(info.brokers)} brokers"
        + (f"; moving (no owner yet): {', '.join(moving)}" if moving else "")
    )


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"
