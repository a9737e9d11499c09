"""``slipstream quota set | list | delete``: per-scope quotas (docs/security.md "Quotas").

A tenant over a rate quota is slowed down (acknowledgements, answers and data delayed), never
refused; only a connection past the connection quota is refused. ``set`` replaces the scope's
whole quota: a limit not given is no limit.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from .._errors import InvalidArgument
from ..streams import human_bytes, parse_size_bytes
from ._common import BrokerOption, connect, err, examples, out, print_json

quota_app = typer.Typer(
    help="Quotas per scope: produce and consume bytes/s, requests/s, connections. Over a rate, "
    "a tenant is slowed down, not refused.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


def _per_second(text: str, option: str) -> str:
    stripped = text.strip()
    if stripped.lower().endswith("/s"):
        return stripped[:-2]
    raise typer.BadParameter(
        f"{text!r} is not a rate per second: write it with /s, like 10MB/s or 1000/s",
        param_hint=option,
    )


def parse_byte_rate(text: str, option: str) -> int:
    """``10MB/s``, ``512KiB/s``, ``1000000/s`` -> bytes per second (> 0)."""
    try:
        return parse_size_bytes(_per_second(text, option))
    except InvalidArgument as exc:
        raise typer.BadParameter(
            f"{exc.message}, per second: e.g. 10MB/s or 512KiB/s", param_hint=option
        ) from None


def parse_count(text: str, option: str, *, rate: bool) -> int:
    """``1000/s`` (``rate``) or ``50`` -> a positive integer."""
    number = _per_second(text, option) if rate else text.strip()
    if not number.isdigit() or int(number) <= 0:
        example = "1000/s" if rate else "50"
        raise typer.BadParameter(f"a positive number, e.g. {example}", param_hint=option)
    return int(number)


@quota_app.command(
    "set",
    epilog=examples(
        "slipstream quota set demo --produce 10MB/s --consume 20MB/s --requests 1000/s "
        "--connections 50",
        "slipstream quota set batch --produce 512KiB/s",
    ),
)
def quota_set(
    scope: Annotated[str, typer.Argument(help="The scope (tenant) the quota is for.")],
    produce: Annotated[
        str | None,
        typer.Option(
            help="Bytes per second appended to the scope's streams: 10MB/s.", show_default=False
        ),
    ] = None,
    consume: Annotated[
        str | None,
        typer.Option(
            help="Bytes per second read from the scope's streams: 20MB/s.", show_default=False
        ),
    ] = None,
    requests: Annotated[
        str | None,
        typer.Option(
            help="Requests per second on the scope's streams: 1000/s.", show_default=False
        ),
    ] = None,
    connections: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Open connections of tokens limited to the scope (with --auth).",
            show_default=False,
        ),
    ] = None,
    broker: BrokerOption = "",
) -> None:
    """Set (replace) a scope's quota; limits not given are removed. Applies at once."""
    if produce is None and consume is None and requests is None and connections is None:
        raise typer.BadParameter(
            "give at least one of --produce, --consume, --requests, --connections "
            "(slipstream quota delete removes a quota)"
        )
    with connect(broker) as client:
        client.set_quota(
            scope,
            produce_bytes=None if produce is None else parse_byte_rate(produce, "--produce"),
            consume_bytes=None if consume is None else parse_byte_rate(consume, "--consume"),
            requests=None if requests is None else parse_count(requests, "--requests", rate=True),
            connections=connections,
        )
    err.print(f"quota of scope [bold]{escape(scope)}[/] set", highlight=False)


@quota_app.command("delete", epilog=examples("slipstream quota delete demo"))
def quota_delete(
    scope: Annotated[str, typer.Argument(help="The scope whose quota goes.")],
    broker: BrokerOption = "",
) -> None:
    """Remove a scope's quota: no limits from now on."""
    with connect(broker) as client:
        had = any(q.scope == scope for q in client.quotas())
        client.delete_quota(scope)
    if had:
        err.print(f"quota of scope [bold]{escape(scope)}[/] removed", highlight=False)
    else:
        err.print(f"scope [bold]{escape(scope)}[/] had no quota", highlight=False)


@quota_app.command("list", epilog=examples("slipstream quota list", "slipstream quota list --json"))
def quota_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
    broker: BrokerOption = "",
) -> None:
    """Every scope's quota (bytes per second, requests per second, connections)."""
    with connect(broker) as client:
        quotas = client.quotas()
    if as_json:
        print_json(
            [
                {
                    "scope": q.scope,
                    "produce_bytes_per_s": q.produce_bytes,
                    "consume_bytes_per_s": q.consume_bytes,
                    "requests_per_s": q.requests,
                    "connections": q.connections,
                }
                for q in quotas
            ]
        )
        return
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("scope", "produce", "consume", "requests", "connections"):
        table.add_column(column)
    for q in quotas:
        table.add_row(
            escape(q.scope),
            "" if q.produce_bytes is None else f"{human_bytes(q.produce_bytes)}/s",
            "" if q.consume_bytes is None else f"{human_bytes(q.consume_bytes)}/s",
            "" if q.requests is None else f"{q.requests}/s",
            "" if q.connections is None else str(q.connections),
        )
    out.print(table)
