"""``slipstream acl grant | revoke | list | check``: access rules of a broker started with
``--auth`` (docs/security.md, "Authorization"). Every command needs an admin token
(``--token`` / ``SLIPSTREAM_TOKEN``)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from ..protocol import AccessRule
from ._common import BrokerOption, connect, err, examples, out, print_json

acl_app = typer.Typer(
    help="Access rules for a broker with --auth: grant, revoke, list, check (a dry run that "
    "says which rule decides). Rules only allow; with --auth on, what no rule allows is "
    "refused.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)

Subject = Annotated[
    str, typer.Argument(help="A token's subject or certificate name; '*' for everyone.")
]
ActionArg = Annotated[str, typer.Argument(help="produce, consume, manage or admin.")]
Pattern = Annotated[
    str,
    typer.Argument(
        help="Streams: '*', 'scope/*', '*/name', 'scope/name' ('*' and '?' within a part)."
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]


def _rule_dict(rule: AccessRule) -> dict[str, str]:
    return {"subject": rule.subject, "action": rule.action, "pattern": rule.pattern}


@acl_app.command(
    "grant",
    epilog=examples(
        "slipstream acl grant alice produce 'demo/*'",
        "slipstream acl grant '*' consume '*/public'",
    ),
)
def acl_grant(
    subject: Subject, action: ActionArg, pattern: Pattern, broker: BrokerOption = ""
) -> None:
    """Allow SUBJECT to do ACTION on the streams PATTERN matches (stored before it answers,
    in force on open connections at once)."""
    with connect(broker) as client:
        rule = client.grant(subject, action, pattern)
    err.print(
        f"granted: [bold]{escape(rule.subject)}[/] may {rule.action} "
        f"[bold]{escape(rule.pattern)}[/]",
        highlight=False,
    )


@acl_app.command("revoke", epilog=examples("slipstream acl revoke alice produce 'demo/*'"))
def acl_revoke(
    subject: Subject, action: ActionArg, pattern: Pattern, broker: BrokerOption = ""
) -> None:
    """Remove a rule (exactly as granted; 'acl list' shows them). Exit code 1 if there was
    no such rule."""
    with connect(broker) as client:
        removed = client.revoke(subject, action, pattern)
    if not removed:
        err.print(
            f"[red]no rule '{escape(subject)} {escape(action)} {escape(pattern)}'[/]; "
            "'slipstream acl list' shows the rules",
            highlight=False,
        )
        raise typer.Exit(1)
    err.print(f"revoked: {escape(subject)} {escape(action)} {escape(pattern)}", highlight=False)


@acl_app.command("list", epilog=examples("slipstream acl list", "slipstream acl list --json"))
def acl_list(as_json: JsonFlag = False, broker: BrokerOption = "") -> None:
    """Every rule, sorted by subject, action and pattern."""
    with connect(broker) as client:
        rules = client.rules()
    if as_json:
        print_json([_rule_dict(r) for r in rules])
        return
    if not rules:
        err.print("no rules: only admin tokens may do anything", highlight=False)
        return
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("subject", "action", "pattern"):
        table.add_column(column)
    for r in rules:
        table.add_row(escape(r.subject), r.action, escape(r.pattern))
    out.print(table)


@acl_app.command(
    "check",
    epilog=examples(
        "slipstream acl check alice consume demo/orders",
        "slipstream acl check alice produce demo/orders --scope demo --json",
    ),
)
def acl_check(
    subject: Annotated[str, typer.Argument(help="The subject to check.")],
    action: ActionArg,
    stream: Annotated[str, typer.Argument(help="A stream 'scope/name', or '*': broker-wide.")],
    role: Annotated[str, typer.Option(help="The subject's role: user or admin.")] = "user",
    scope: Annotated[
        str | None,
        typer.Option(help="As for a token limited to this scope.", show_default=False),
    ] = None,
    as_json: JsonFlag = False,
    broker: BrokerOption = "",
) -> None:
    """A dry run: would SUBJECT be allowed ACTION on STREAM, and which rule decides? Exit
    code 0 if allowed, 1 if refused."""
    with connect(broker) as client:
        decision = client.check_access(subject, action, stream, role=role, scope=scope)
    rule = decision.rule
    if as_json:
        print_json(
            {
                "allowed": decision.allowed,
                "rule": None if rule is None else _rule_dict(rule),
                "reason": decision.reason,
            }
        )
    else:
        verdict = "[green]allowed[/]" if decision.allowed else "[red]refused[/]"
        out.print(f"{verdict}: {escape(decision.reason)}", highlight=False)
    if not decision.allowed:
        raise typer.Exit(1)
