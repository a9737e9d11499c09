"""``slipstream consume``: events of a stream to stdout as JSON lines, raw values or a table.

JSON output, one object per line::

    {"key": "user-42", "value": {"item": "book"}, "headers": {"src": "web"},
     "timestamp": 1795337663638, "time": "2026-11-22T08:54:23.638Z", "segment": 1, "offset": 7}

``value`` is the value decoded as JSON if it is JSON, else its text; ``key`` and header values
are text. Bytes that are not UTF-8 are never dropped: the field is null (headers: absent) and
``key_base64`` / ``value_base64`` / ``headers_base64`` carry them. ``produce`` reads these lines
back as envelopes, so ``consume | produce`` copies a stream (a value that is a JSON string,
like ``"hi"`` with its quotes, comes back as its text ``hi``).

Where a run stopped is a StreamCut: for every segment, the offset after the last event written
out (or the start, for a segment with no event written). ``--from`` that cut resumes with the
next event, none skipped or repeated.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Generator, Iterator
from typing import Any, BinaryIO, Protocol, cast

import msgspec
import pyarrow as pa
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

import slipstream
from slipstream.format import to_json_value

from ._common import iso_ms, text_or_base64

FORMATS = ("json", "raw", "table")


class Rows:
    """The columns of one record batch from ``Reader.batches()`` as Python lists."""

    __slots__ = ("headers", "keys", "offsets", "segments", "timestamps", "values")

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.keys: list[bytes | None] = batch.column("key").to_pylist()
        self.values: list[bytes] = batch.column("value").to_pylist()
        self.timestamps: list[int] = batch.column("timestamp").cast(pa.int64()).to_pylist()
        headers = batch.column("headers")
        self.headers: list[list[dict[str, Any]] | None] = (
            [None] * len(batch) if headers.null_count == len(batch) else headers.to_pylist()
        )
        self.segments: list[int] = batch.column("segment").to_pylist()
        self.offsets: list[int] = batch.column("offset").to_pylist()

    @classmethod
    def of_events(cls, events: list[slipstream.Event]) -> Rows:
        """The same columns from the events a consumer's ``poll`` returned."""
        rows = cls.__new__(cls)
        rows.keys = [e.key for e in events]
        rows.values = [e.value for e in events]
        rows.timestamps = [e.timestamp for e in events]
        rows.headers = [
            [{"key": k, "value": v} for k, v in e.headers.items()] if e.headers else None
            for e in events
        ]
        rows.segments = [e.segment for e in events]
        rows.offsets = [e.offset for e in events]
        return rows

    def __len__(self) -> int:
        return len(self.values)


def event_json(
    key: bytes | None,
    value: bytes,
    headers: list[dict[str, Any]] | None,
    timestamp: int,
    segment: int,
    offset: int,
) -> dict[str, Any]:
    """The JSON object ``consume --format json`` prints for one event."""
    row: dict[str, Any] = {}
    if key is None:
        row["key"] = None
    else:
        row["key"], key_base64 = text_or_base64(key)
        if key_base64 is not None:
            row["key_base64"] = key_base64
    value_text, value_base64 = text_or_base64(value)
    if value_base64 is None:
        row["value"] = to_json_value(value) if value_text else value_text
    else:
        row["value"] = None
        row["value_base64"] = value_base64
    text_headers: dict[str, str] = {}
    binary_headers: dict[str, str] = {}
    for item in headers or ():
        text, encoded = text_or_base64(item["value"] or b"")
        if encoded is None:
            text_headers[item["key"]] = text or ""
        else:
            binary_headers[item["key"]] = encoded
    row["headers"] = text_headers
    if binary_headers:
        row["headers_base64"] = binary_headers
    row["timestamp"] = timestamp
    row["time"] = iso_ms(timestamp)
    row["segment"] = segment
    row["offset"] = offset
    return row


class Output(Protocol):
    def write(self, rows: Rows) -> None: ...


class JsonOutput:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.encode = msgspec.json.Encoder().encode

    def write(self, rows: Rows) -> None:
        encode = self.encode
        lines = [
            encode(event_json(*fields)) + b"\n"
            for fields in zip(
                rows.keys,
                rows.values,
                rows.headers,
                rows.timestamps,
                rows.segments,
                rows.offsets,
                strict=True,
            )
        ]
        self.stream.write(b"".join(lines))
        self.stream.flush()


class RawOutput:
    """Each value's bytes followed by a newline (values are not escaped)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def write(self, rows: Rows) -> None:
        self.stream.write(b"\n".join(rows.values) + b"\n")
        self.stream.flush()


def _cell(data: bytes | None) -> Text:
    if data is None:
        return Text("-", style="dim")
    try:
        return Text(data.decode())
    except UnicodeDecodeError:
        return Text(f"<{len(data)} bytes>", style="dim")


class TableOutput:
    """A table printed as events arrive: the header once, then rows in fixed-width columns,
    so a followed stream scrolls like a log."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.header_done = False

    def write(self, rows: Rows) -> None:
        table = Table(
            box=box.SIMPLE_HEAD,  # also without the header: its column gaps keep rows aligned
            show_header=not self.header_done,
            show_edge=False,
            pad_edge=False,
        )
        table.add_column("Seg/Offset", width=12, no_wrap=True, justify="right")
        table.add_column("Time", width=24, no_wrap=True)
        table.add_column("Key", width=14, no_wrap=True, overflow="ellipsis", style="cyan")
        table.add_column("Headers", width=16, no_wrap=True, overflow="ellipsis", style="dim")
        table.add_column("Value", ratio=1, no_wrap=True, overflow="ellipsis")
        for key, value, headers, timestamp, segment, offset in zip(
            rows.keys,
            rows.values,
            rows.headers,
            rows.timestamps,
            rows.segments,
            rows.offsets,
            strict=True,
        ):
            header_text = ",".join(
                f"{item['key']}={(item['value'] or b'').decode(errors='replace')}"
                for item in headers or ()
            )
            table.add_row(
                f"{segment}/{offset}", iso_ms(timestamp), _cell(key), header_text, _cell(value)
            )
        self.header_done = True
        self.console.print(table)


def make_output(fmt: str, stdout: BinaryIO, console: Console) -> Output:
    if fmt == "json":
        return JsonOutput(stdout)
    if fmt == "raw":
        return RawOutput(stdout)
    return TableOutput(console)


class Progress:
    """Where the consumer stands: the next offset of every segment it reads."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.next_offsets: dict[int, int] = {}
        self.events = 0

    def advance(self, rows: Rows) -> None:
        self.events += len(rows)
        for segment, offset in zip(rows.segments, rows.offsets, strict=True):
            self.next_offsets[segment] = offset + 1

    def cut(
        self, starts: dict[int, int], end: slipstream.StreamCut | None, completed: bool
    ) -> slipstream.StreamCut:
        """The StreamCut to resume from: ``starts`` are where the reader began each segment;
        a completed bounded read stands at ``end`` in every segment."""
        positions = dict(starts)
        if completed and end is not None:
            for segment, start in starts.items():
                positions[segment] = max(start, end.positions.get(segment, start))
        for segment, offset in self.next_offsets.items():
            positions[segment] = max(positions.get(segment, 0), offset)
        return slipstream.StreamCut(self.stream, positions)


def reader_starts(reader: slipstream.Reader) -> dict[int, int]:
    """Where the reader started each segment, as it resolved its ``start`` on the broker.

    The public Reader has no accessor for this yet; ``reader.core.starts`` is the resolved
    map (empty until the reader opened).
    """
    return dict(reader.core.starts)


def limited(batches: Iterator[pa.RecordBatch], limit: int | None) -> Iterator[Rows]:
    """Rows of each batch, cut off after ``limit`` events in all."""
    remaining = limit
    for batch in batches:
        if remaining is not None:
            if remaining <= 0:
                return
            if len(batch) > remaining:
                batch = batch.slice(0, remaining)
            remaining -= len(batch)
        yield Rows(batch)
        if remaining == 0:
            return


def silence_stdout() -> None:
    """After a broken pipe (``consume | head``): point stdout at /dev/null so the interpreter's
    final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_consume(
    client: slipstream.Client,
    stream: str,
    start: str,
    *,
    follow: bool,
    limit: int | None,
    fmt: str,
    end_cut: bool,
    console: Console,
) -> int:
    """Read and print events; returns the exit code.

    Without ``follow`` the read ends at the stream's tail as of the start of the command. With
    it, Ctrl-C is the normal way out and exits 0; a Ctrl-C during a bounded read exits 130.
    With ``end_cut`` the StreamCut to resume from is printed to stderr on every way out,
    errors included (say the broker went away), so a script can carry on from there.
    """
    end = None if follow else client.tail(stream)
    reader = client.reader(stream, start=start, end=end)
    output = make_output(fmt, sys.stdout.buffer, console)
    progress = Progress(stream)
    completed = False
    code = 0

    def exhaust(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        nonlocal completed
        yield from batches
        completed = True

    batches = cast(Generator[pa.RecordBatch, None, None], reader.batches())
    try:
        for rows in limited(exhaust(batches), limit):
            output.write(rows)
            progress.advance(rows)
    except KeyboardInterrupt:
        code = 0 if follow else 130
    except BrokenPipeError:
        silence_stdout()
    finally:
        batches.close()
        reader.close()
        starts = reader_starts(reader)
        if end_cut and starts:
            cut = progress.cut(starts, end, completed)
            sys.stderr.write(cut.to_json() + "\n")
            sys.stderr.flush()
    return code


#: ``--last`` when a find (``--key`` or ``--to``) gives neither ``--last`` nor ``--limit``
FIND_DEFAULT_LAST = 100


def run_find(
    client: slipstream.Client,
    stream: str,
    *,
    key: str | None,
    start: str | None,
    end: str | None,
    last: int | None,
    limit: int | None,
    fmt: str,
    console: Console,
) -> int:
    """Print the events a find returns (``--key`` / ``--to`` / ``--last``): the key's (or
    every key's) events in ``[start, end)``, the newest ``last`` or else the first ``limit``,
    in order (oldest first), each with its segment and offset. The broker reads only the
    batches its find indexes name."""
    newest_first = limit is None
    count = (last if last is not None else FIND_DEFAULT_LAST) if newest_first else limit
    assert count is not None
    start_at = None if start in (None, "earliest") else start
    events = client.find(
        stream, key=key, start=start_at, end=end, limit=count, newest_first=newest_first
    )
    if newest_first:
        events.reverse()  # printed as they were appended
    if not events:
        return 0
    try:
        make_output(fmt, sys.stdout.buffer, console).write(Rows.of_events(events))
    except BrokenPipeError:
        silence_stdout()
    return 0


#: ``--commit`` with ``--subscription``: manual commits need a program (``consumer.commit()``)
GROUP_COMMIT_MODES = ("auto", "at_most_once")
GROUP_COMMIT_S = 1.0
GROUP_POLL_S = 0.25
#: a bounded run that gets no segment this long (other members hold them all) stops
UNASSIGNED_STOP_S = 5.0
_RETRIED_COMMIT = (
    slipstream.NotAssigned,
    slipstream.StaleGeneration,
    slipstream.UnknownMember,
    slipstream.BrokerUnavailable,
)


class GroupProgress:
    """What a group member printed, and committing it (``auto``): per segment, the offset
    after the last event written out. A commit takes, per held segment, the smaller of that
    and what the consumer handed out under its current grant, so positions printed before a
    reset or a rebalance never overwrite the new ones."""

    def __init__(self, consumer: slipstream.Consumer) -> None:
        self.consumer = consumer
        self.printed: dict[int, int] = {}
        self.events = 0

    def advance(self, rows: Rows) -> None:
        self.events += len(rows)
        for segment, offset in zip(rows.segments, rows.offsets, strict=True):
            self.printed[segment] = offset + 1

    def commit(self) -> None:
        """Commit what was printed; a segment that moved meanwhile is left to its new
        holder, which starts from the last commit (at-least-once)."""
        committed = self.consumer.committed
        positions = {
            segment: position
            for segment, handed in self.consumer.positions().items()
            if segment in self.printed
            and (position := min(handed, self.printed[segment])) != committed.get(segment)
        }
        if positions:
            with contextlib.suppress(*_RETRIED_COMMIT):
                self.consumer.commit(positions)

    def caught_up(self, end: slipstream.StreamCut) -> bool:
        """Every segment held stands at ``end`` (the tail when the command started)."""
        starts = self.consumer.granted
        handed = self.consumer.positions()
        return bool(starts) and all(
            max(start, handed.get(segment, start)) >= end.positions.get(segment, 0)
            for segment, start in starts.items()
        )


def run_group_consume(
    client: slipstream.Client,
    stream: str,
    subscription: str,
    *,
    commit: str,
    follow: bool,
    limit: int | None,
    fmt: str,
    console: Console,
) -> int:
    """Join the subscription's group, print the events of the segments it is given and
    commit them; returns the exit code.

    ``auto``: what was printed is committed about once a second and on every way out
    (at-least-once: after a crash, or a rebalance between two commits, up to a second of
    events is printed again, here or by the member that takes the segment). ``at_most_once``:
    each batch is committed before it is printed (a crash may lose it, never print it twice).
    Without ``follow`` the run ends once its segments stand at the stream's tail as of the
    start (or after a few seconds without any segment: the other members hold them all).
    """
    if commit not in GROUP_COMMIT_MODES:
        raise slipstream.InvalidArgument(
            f"--commit {commit!r}: use auto or at_most_once (manual commits need a program: "
            "consumer.commit() in Python)"
        )
    end = None if follow else client.tail(stream)
    output = make_output(fmt, sys.stdout.buffer, console)
    remaining = limit
    code = 0
    consumer = client.consumer(
        stream, subscription, commit="manual" if commit == "auto" else commit
    )
    if isinstance(consumer, slipstream.QueueConsumer):  # its events need acks: a program's job
        consumer.close()
        raise slipstream.InvalidArgument(
            f"subscription {subscription!r} is a work queue; consume it from a program "
            "(client.consumer(...), event.ack())"
        )
    progress = GroupProgress(consumer)
    last_commit = unassigned_since = time.monotonic()
    try:
        while remaining is None or remaining > 0:
            events = consumer.poll(GROUP_POLL_S)
            if events:
                if remaining is not None:
                    events = events[:remaining]
                    remaining -= len(events)
                rows = Rows.of_events(events)
                output.write(rows)
                progress.advance(rows)
            now = time.monotonic()
            if commit == "auto" and now - last_commit >= GROUP_COMMIT_S:
                progress.commit()
                last_commit = now
            if end is None or events:
                continue
            if consumer.assignment:
                unassigned_since = now
                if progress.caught_up(end):
                    break
            elif now - unassigned_since >= UNASSIGNED_STOP_S:
                sys.stderr.write(
                    f"no segment of {stream} was assigned in {UNASSIGNED_STOP_S:.0f} s: the "
                    f"other members of {subscription!r} hold them all\n"
                )
                break
    except KeyboardInterrupt:
        code = 0 if follow else 130
    except BrokenPipeError:
        silence_stdout()
    finally:
        try:
            if commit == "auto":
                progress.commit()
        finally:
            consumer.close()
    return code
