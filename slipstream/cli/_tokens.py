"""``slipstream token create | revoke | list``: tokens for a broker started with ``--auth``.

The first administrator is bootstrapped on the broker's machine: ``token create --data-dir D``
signs with the key file in the data directory, without a broker (docs/security.md). Every
other call goes through the broker with an admin token (``--token`` / ``SLIPSTREAM_TOKEN``).
A token is printed once, on stdout; it is never logged, and the broker stores only its id and
claims.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from ..security import Role, TokenKeys, parse_duration_s
from ._common import BrokerOption, connect, err, examples, out, print_json

token_app = typer.Typer(
    help="Tokens for a broker with --auth: create (offline with --data-dir for the first "
    "admin, else through the broker), revoke, list.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]


def _iso(seconds: int | None) -> str:
    if seconds is None:
        return ""
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC).isoformat().replace("+00:00", "Z")


@token_app.command(
    "create",
    epilog=examples(
        "slipstream token create --data-dir .slipstream --subject ops --role admin",
        "slipstream token create --subject alice --scope demo --expires 7d",
    ),
)
def token_create(
    subject: Annotated[str, typer.Option(help="Who the token is for (rules name it).")],
    role: Annotated[str, typer.Option(help="admin (may do everything) or user.")] = "user",
    scope: Annotated[
        str | None,
        typer.Option(help="Limit the token to this scope's streams.", show_default=False),
    ] = None,
    expires: Annotated[str, typer.Option(help="Lifetime: 90s, 15m, 12h, 7d, 2w.")] = "30d",
    algorithm: Annotated[str, typer.Option(help="EdDSA (Ed25519) or HS256.")] = "EdDSA",
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Sign offline with this broker data directory's key (bootstrap the first "
            "admin on the broker's machine); without it the broker issues the token.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """Create a token and print it (once: it is not stored, only its id and claims)."""
    if role not in (Role.ADMIN, Role.USER):
        raise typer.BadParameter("use admin or user", param_hint="--role")
    expires_s = parse_duration_s(expires)
    if data_dir is not None:
        if not data_dir.is_dir():
            raise typer.BadParameter(
                f"{data_dir} is not a directory; pass the broker's --data-dir",
                param_hint="--data-dir",
            )
        keys = TokenKeys.load(data_dir)
        issued = keys.issue(subject, role, scope=scope, expires_s=expires_s, algorithm=algorithm)
        token, token_id, expires_at = issued.token, issued.token_id, issued.expires_at
    else:
        with connect(broker) as client:
            created = client.create_token(
                subject, role, scope=scope, expires_s=expires_s, algorithm=algorithm
            )
        token, token_id, expires_at = created.token, created.info.token_id, created.info.expires_at
    if as_json:
        print_json(
            {
                "token": token,
                "token_id": token_id,
                "subject": subject,
                "role": role,
                "scope": scope,
                "expires_at": _iso(expires_at),
            }
        )
        return
    err.print(
        f"token [bold]{token_id}[/] for [bold]{escape(subject)}[/] ({role}"
        f"{', scope ' + escape(scope) if scope else ''}), expires {_iso(expires_at)}; "
        "pass it as --token or SLIPSTREAM_TOKEN",
        highlight=False,
    )
    print(token)


@token_app.command("revoke", epilog=examples("slipstream token revoke 3f2a9c0d1e4b5a69"))
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (token list shows them).")],
    broker: BrokerOption = "",
) -> None:
    """Revoke a token by id: refused from now on, and connections using it are closed."""
    with connect(broker) as client:
        client.revoke_token(token_id)
    err.print(f"token [bold]{escape(token_id)}[/] revoked", highlight=False)


@token_app.command("list", epilog=examples("slipstream token list --json"))
def token_list(as_json: JsonFlag = False, broker: BrokerOption = "") -> None:
    """The tokens the broker issued (ids and claims, never the tokens) and the revoked ids."""
    with connect(broker) as client:
        tokens = client.list_tokens()
    if as_json:
        print_json(
            [
                {
                    "token_id": t.token_id,
                    "subject": t.subject,
                    "role": t.role,
                    "scope": t.scope,
                    "created_at": _iso(t.created_at or None),
                    "expires_at": _iso(t.expires_at or None),
                    "revoked": t.revoked,
                }
                for t in tokens
            ]
        )
        return
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("id", "subject", "role", "scope", "created", "expires", "revoked"):
        table.add_column(column)
    for t in tokens:
        table.add_row(
            t.token_id,
            escape(t.subject),
            t.role,
            escape(t.scope or ""),
            _iso(t.created_at or None),
            _iso(t.expires_at or None),
            "yes" if t.revoked else "",
        )
    out.print(table)
