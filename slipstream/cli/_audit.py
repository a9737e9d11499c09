"""``slipstream audit verify | tail``: check and read the audit trail (``_system/audit``).

Both read the stream through the public client, so with authentication on they need an admin
token. ``verify`` checks the whole retained history with the pure ``verify_chain`` (seq
continuity, every record's hash, every link) and exits 1 at the first gap or edit; ``tail``
prints records as they are, unchecked.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
import typer
from rich.markup import escape

import slipstream

from ..security._audit import AuditRecord, ChainReport, decode_record, verify_chain
from ..streams import AUDIT_STREAM
from ._common import BrokerOption, connect, err, examples, iso_ms, out, print_json

audit_app = typer.Typer(
    help="The audit trail (_system/audit): verify its hash chain, show its records.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]


class _History:
    """The audit stream's event values from its first retained event to the tail as of the
    start, remembering the offset of the first (0 unless retention trimmed the stream)."""

    def __init__(self, client: slipstream.Client, stream: str) -> None:
        self.client = client
        self.stream = stream
        self.first_offset: int | None = None

    def events(self) -> Iterator[Any]:
        end = self.client.tail(self.stream)
        with self.client.reader(self.stream, start="earliest", end=end) as reader:
            yield from reader

    def peeked(self) -> tuple[bool, Iterator[bytes]]:
        """(trimmed, values): whether the history starts after offset 0, and the values."""
        events = self.events()
        first = next(events, None)
        if first is None:
            return False, iter(())
        self.first_offset = first.offset

        def values() -> Iterator[bytes]:
            yield first.value or b""
            for event in events:
                yield event.value or b""

        return first.offset > 0, values()


def report_dict(
    report: ChainReport, first_offset: int | None, stream: str = AUDIT_STREAM
) -> dict[str, Any]:
    """The ``--json`` form of a verification."""
    document: dict[str, Any] = {
        "ok": report.ok,
        "stream": stream,
        "records": report.records,
        "first_seq": report.first_seq,
        "last_seq": report.last_seq,
        "head": report.head,
        "mid_chain": report.mid_chain,
    }
    if not report.ok:
        document["problem"] = report.problem
        document["problem_seq"] = report.problem_seq
        if first_offset is not None and report.problem_index is not None:
            document["problem_offset"] = first_offset + report.problem_index
    return document


def report_text(report: ChainReport, first_offset: int | None, stream: str = AUDIT_STREAM) -> str:
    """One or two lines for people."""
    if report.ok:
        if report.records == 0:
            return f"{stream} is empty: nothing to verify"
        text = (
            f"audit chain OK: {report.records} records, seq {report.first_seq}..{report.last_seq}"
            f", head {report.head}"
        )
        if report.mid_chain:
            text += (
                f"\nstarted mid-chain at seq {report.first_seq}: retention removed the records "
                "before it, whose links were taken on trust"
            )
        return text
    where = ""
    if first_offset is not None and report.problem_index is not None:
        where = f" (offset {first_offset + report.problem_index})"
    checked = f"{report.records} records before it verified" + (
        f", up to seq {report.last_seq}" if report.last_seq is not None else ""
    )
    return f"audit chain BROKEN{where}: {report.problem}; {checked}"


@audit_app.command(
    "verify",
    epilog=examples("slipstream audit verify", "slipstream audit verify --json"),
)
def audit_verify(
    as_json: JsonFlag = False,
    stream: Annotated[
        str,
        typer.Option(
            help="Verify a copy of the trail in another stream (an archive) instead.",
            show_default=False,
        ),
    ] = AUDIT_STREAM,
    broker: BrokerOption = "",
) -> None:
    """Check the audit trail's hash chain from its first retained record to its tail: every
    seq follows the one before, every record hashes to its hash and links to the record
    before it. Prints OK with the counts and the head hash (keep it elsewhere to detect a
    later rewrite), or the first gap or edit; exits 1 on a broken chain."""
    with connect(broker) as client:
        history = _History(client, stream)
        trimmed, values = history.peeked()
        # a copy elsewhere may hold a trimmed trail from its own offset 0: unknown
        report = verify_chain(values, trimmed=trimmed if stream == AUDIT_STREAM else None)
    text = report_text(report, history.first_offset, stream)
    if as_json:
        print_json(report_dict(report, history.first_offset, stream))
    elif report.ok:
        out.print(escape(text), highlight=False)
    else:
        err.print(f"[bold red]{escape(text)}[/]", highlight=False)
    if not report.ok:
        raise typer.Exit(1)


def record_line(record: AuditRecord) -> str:
    """``seq time event subject peer details`` for people."""
    details = " ".join(
        f"{key}={msgspec.json.encode(value).decode()}" for key, value in record.details.items()
    )
    subject = record.subject if record.subject is not None else "-"
    return (
        f"{record.seq:>6} {iso_ms(record.time_ms)} {record.event:<22} {subject} "
        f"{record.peer} {details}".rstrip()
    )


@audit_app.command(
    "tail",
    epilog=examples(
        "slipstream audit tail", "slipstream audit tail -f", "slipstream audit tail --json -n 5"
    ),
)
def audit_tail(
    last: Annotated[
        int, typer.Option("--last", "-n", help="Start this many records before the tail.")
    ] = 20,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new records (Ctrl-C to stop).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON record per line (as stored).")
    ] = False,
    broker: BrokerOption = "",
) -> None:
    """Print the audit trail's newest records (seq, time, event, subject, peer, details),
    unchecked: 'slipstream audit verify' checks them."""
    if last < 0:
        raise typer.BadParameter("must be 0 or more", param_hint="--last")
    with connect(broker) as client:
        tail = client.tail(AUDIT_STREAM)
        info = client.describe_stream(AUDIT_STREAM)
        first = min((s.start_offset for s in info.segments), default=0)
        start = slipstream.StreamCut(
            AUDIT_STREAM, {n: max(first, o - last) for n, o in tail.positions.items()}
        )
        reader = client.reader(AUDIT_STREAM, start=start, end=None if follow else tail)
        try:
            for event in reader:
                value = event.value or b""
                if as_json:
                    sys.stdout.write(value.decode(errors="replace") + "\n")
                    sys.stdout.flush()
                    continue
                try:
                    line = record_line(decode_record(value))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    line = f"offset {event.offset}: not an audit record: {value[:80]!r}"
                out.print(escape(line), highlight=False, soft_wrap=True)
        except KeyboardInterrupt:
            pass
        finally:
            reader.close()
