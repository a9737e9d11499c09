"""``slipstream audit verify | tail``: check and read the audit trail (``_system/audit``).

Both read the stream through the public client, so with authentication on they need an admin
token. ``verify`` checks the whole retained history with the pure ``verify_chains`` (seq
continuity, every record's hash, every link; in a cluster's trail each broker's chain on its
own) and exits 1 at the first gap or edit of any chain; ``tail`` prints records as they are,
unchecked. Any broker of a cluster serves both: the stream is the cluster's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
import typer
from rich.markup import escape

import slipstream

from ..security._audit import (
    AuditRecord,
    ChainReport,
    broker_of,
    decode_record,
    verify_chains,
)
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


def trail_dict(
    chains: dict[str, ChainReport], first_offset: int | None, stream: str = AUDIT_STREAM
) -> dict[str, Any]:
    """The ``--json`` form of a trail's verification: ``ok`` and ``records`` over every
    chain, ``chains`` one entry per chain (``broker``: its broker's id, null for a standalone
    broker's records) with the fields of ``report_dict``; a single chain's fields also at the
    top (a standalone broker's trail reads as it always did), and the first broken chain's
    ``problem`` (with its ``broker``)."""
    entries = []
    for name, report in chains.items():
        entry = report_dict(report, first_offset, stream)
        del entry["stream"]
        entries.append({"broker": name or None, **entry})
    if len(chains) == 1:
        (single,) = chains.values()
        document = report_dict(single, first_offset, stream)
    else:
        document = {
            "ok": all(r.ok for r in chains.values()),
            "stream": stream,
            "records": sum(r.records for r in chains.values()),
            "first_seq": None,
            "last_seq": None,
            "head": None,
            "mid_chain": any(r.mid_chain for r in chains.values()),
        }
        broken = next((e for e in entries if not e["ok"]), None)
        if broken is not None:
            for key in ("broker", "problem", "problem_seq", "problem_offset"):
                if key in broken:
                    document[key] = broken[key]
    document["chains"] = entries
    return document


def trail_text(
    chains: dict[str, ChainReport], first_offset: int | None, stream: str = AUDIT_STREAM
) -> list[tuple[bool, str]]:
    """(ok, line) per chain: a standalone broker's trail as one line, as it always was; a
    cluster's one line per broker, its name first."""
    if not chains:
        return [(True, f"{stream} is empty: nothing to verify")]
    if list(chains) == [""]:
        return [(chains[""].ok, report_text(chains[""], first_offset, stream))]
    lines = []
    for name, report in chains.items():
        who = f"broker {name}" if name else "records without a broker (a standalone broker's)"
        lines.append((report.ok, f"{who}: {report_text(report, first_offset, stream)}"))
    return lines


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
    before it. In a cluster's trail each broker's chain is checked on its own (any broker
    answers). Prints OK with the counts and the head hash of each chain (keep them elsewhere
    to detect a later rewrite), or its first gap or edit; exits 1 if any chain is broken."""
    with connect(broker) as client:
        history = _History(client, stream)
        trimmed, values = history.peeked()
        # a copy elsewhere may hold a trimmed trail from its own offset 0: unknown
        chains = verify_chains(values, trimmed=trimmed if stream == AUDIT_STREAM else None)
    if as_json:
        print_json(trail_dict(chains, history.first_offset, stream))
    else:
        for ok, text in trail_text(chains, history.first_offset, stream):
            if ok:
                out.print(escape(text), highlight=False)
            else:
                err.print(f"[bold red]{escape(text)}[/]", highlight=False)
    if not all(report.ok for report in chains.values()):
        raise typer.Exit(1)


def record_line(record: AuditRecord, broker: str = "") -> str:
    """``seq time event subject peer details`` for people (``broker/seq`` in a cluster's
    trail)."""
    details = " ".join(
        f"{key}={msgspec.json.encode(value).decode()}" for key, value in record.details.items()
    )
    subject = record.subject if record.subject is not None else "-"
    chain = f"{broker}/" if broker else ""
    return (
        f"{chain}{record.seq:>6} {iso_ms(record.time_ms)} {record.event:<22} {subject} "
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
                    line = record_line(decode_record(value), broker_of(value))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    line = f"offset {event.offset}: not an audit record: {value[:80]!r}"
                out.print(escape(line), highlight=False, soft_wrap=True)
        except KeyboardInterrupt:
            pass
        finally:
            reader.close()
