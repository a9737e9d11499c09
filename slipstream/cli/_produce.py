"""``slipstream produce``: JSON lines (or raw lines) from stdin to a stream.

Input, one event per line (blank lines are skipped):

* **Envelope**: a JSON object with a ``"value"`` (or ``"value_base64"``) field is an envelope,
  ``{"key": ..., "value": ..., "headers": {...}, "timestamp": ...}``. A string value is sent as
  its UTF-8 text; any other JSON value (object, array, number, true/false/null) is sent as its
  JSON text, exactly as written on the line. ``key`` is a string, or a number sent as its JSON
  text; ``headers`` map names to strings; ``timestamp`` is milliseconds since the epoch or an
  ISO-8601 time with a timezone (default: when the producer batches it). ``key_base64``,
  ``value_base64`` and ``headers_base64`` carry binary data, and the ``time``, ``segment`` and
  ``offset`` fields that ``consume --format json`` adds are ignored, so consume's output is
  valid input. Any other field is an error (a typo like ``"header"`` must not pass silently):
  to send such an object as the value, wrap it in ``{"value": ...}``.
* **Anything else** (an object without ``"value"``, an array, a number, a string) is the value
  itself, as if written ``{"value": <line>}``.
* ``--raw``: the line's bytes, without its line ending, are the value.

``--key-field F`` keys each event by the top-level field ``F`` of the value object (of the
line itself in ``--raw`` mode); an explicit envelope ``key`` wins over it.

Delivery: the command counts an event as produced only when the broker acknowledged it (made
it durable). If events cannot be delivered (the stream was deleted, the broker stayed down
past ``--delivery-timeout``), it stops reading, exits 1 and says how many events were
acknowledged and the first input line whose event was not: running the same command on the
same input with ``--skip`` (that line's number minus one) sends the rest. Events of later
lines in other segments may have been acknowledged already and are then stored twice; the
message counts them.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

import slipstream

from ._common import parse_time_ms

ENVELOPE_FIELDS = frozenset(
    {"key", "key_base64", "value", "value_base64", "headers", "headers_base64", "timestamp"}
)
#: Fields that ``consume --format json`` prints and ``produce`` reads past.
IGNORED_FIELDS = frozenset({"time", "segment", "offset"})
_decode_object = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_any = msgspec.json.Decoder().decode


class BadLine(ValueError):
    """A line that is not a valid event; the message says why, without the line number."""


@dataclass(frozen=True, slots=True)
class LineEvent:
    value: bytes
    key: str | bytes | None = None
    headers: dict[str, bytes] | None = None
    timestamp: int | None = None


def _json_type(obj: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false"}
    return "null" if obj is None else names.get(type(obj), "a number")


def _decode(raw: bytes | msgspec.Raw, what: str) -> Any:
    try:
        return _decode_any(raw)
    except msgspec.DecodeError as exc:
        raise BadLine(f"{what} is not valid JSON ({exc})") from None


def _key_text(obj: Any, what: str) -> str | None:
    if obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int | float):  # bool included: true/false keys are their JSON text
        return msgspec.json.encode(obj).decode()
    raise BadLine(f"{what} must be a string or a number, not {_json_type(obj)}")


def _base64(obj: Any, what: str) -> bytes:
    if not isinstance(obj, str):
        raise BadLine(f"{what} must be a base64 string, not {_json_type(obj)}")
    try:
        return base64.b64decode(obj, validate=True)
    except binascii.Error:
        raise BadLine(f"{what} is not valid base64") from None


class LineParser:
    """Turns one input line into a :class:`LineEvent`; raises :class:`BadLine`."""

    def __init__(self, *, raw: bool = False, key_field: str | None = None) -> None:
        self.raw = raw
        self.key_field = key_field

    def parse(self, line: bytes) -> LineEvent | None:
        """The event of ``line`` (with or without its line ending); None for a blank line."""
        stripped = line.strip()
        if not stripped:
            return None
        if self.raw:
            value = line[:-1] if line.endswith(b"\n") else line
            value = value[:-1] if value.endswith(b"\r") else value
            key = self._field_key(_decode(stripped, "the line")) if self.key_field else None
            return LineEvent(value, key)
        if stripped.startswith(b"{"):
            try:
                fields = _decode_object(stripped)
            except msgspec.DecodeError as exc:
                raise BadLine(f"not valid JSON ({exc})") from None
            if "value" in fields or "value_base64" in fields:
                return self._envelope(fields)
            key = self._raw_field_key(fields) if self.key_field else None
            return LineEvent(stripped, key)
        document = _decode(stripped, "the line")
        if self.key_field:
            raise BadLine(
                f"--key-field {self.key_field}: the line is {_json_type(document)}, not an object"
            )
        return LineEvent(document.encode() if isinstance(document, str) else stripped)

    def _envelope(self, fields: dict[str, msgspec.Raw]) -> LineEvent:
        unknown = fields.keys() - ENVELOPE_FIELDS - IGNORED_FIELDS
        if unknown:
            raise BadLine(
                f"unknown envelope field {', '.join(map(repr, sorted(unknown)))} (an object with "
                '"value" is an envelope: key, value, headers, timestamp); to send the whole '
                'object as the value, wrap it: {"value": {...}}'
            )
        value_doc: Any = None
        if "value_base64" in fields:
            value = _base64(_decode(fields["value_base64"], "value_base64"), "value_base64")
        else:
            value_doc = _decode(fields["value"], "value")
            value = value_doc.encode() if isinstance(value_doc, str) else bytes(fields["value"])
        key: str | bytes | None = None
        if "key_base64" in fields:
            key = _base64(_decode(fields["key_base64"], "key_base64"), "key_base64")
        elif "key" in fields:
            key = _key_text(_decode(fields["key"], "key"), '"key"')
        if key is None and self.key_field:
            if not isinstance(value_doc, dict):
                raise BadLine(
                    f"--key-field {self.key_field}: the value is {_json_type(value_doc)}, "
                    "not an object"
                )
            key = self._field_key(value_doc)
        return LineEvent(value, key, self._headers(fields), self._timestamp(fields))

    def _field_key(self, document: Any) -> str:
        assert self.key_field is not None
        if not isinstance(document, dict):
            raise BadLine(
                f"--key-field {self.key_field}: the line is {_json_type(document)}, not an object"
            )
        if self.key_field not in document:
            raise BadLine(f"--key-field: no field {self.key_field!r}")
        key = _key_text(document[self.key_field], f"field {self.key_field!r}")
        if key is None:
            raise BadLine(f"--key-field: field {self.key_field!r} is null")
        return key

    def _raw_field_key(self, fields: dict[str, msgspec.Raw]) -> str:
        assert self.key_field is not None
        if self.key_field not in fields:
            raise BadLine(f"--key-field: no field {self.key_field!r}")
        return self._field_key({self.key_field: _decode(fields[self.key_field], "the key")})

    @staticmethod
    def _headers(fields: dict[str, msgspec.Raw]) -> dict[str, bytes] | None:
        headers: dict[str, bytes] = {}
        for name, encoded in (("headers", False), ("headers_base64", True)):
            if name not in fields:
                continue
            document = _decode(fields[name], name)
            if document is None:
                continue
            if not isinstance(document, dict):
                raise BadLine(f'"{name}" must be an object, not {_json_type(document)}')
            for header, value in document.items():
                if encoded:
                    headers[header] = _base64(value, f"header {header!r}")
                elif isinstance(value, str):
                    headers[header] = value.encode()
                else:
                    raise BadLine(f"header {header!r} must be a string, not {_json_type(value)}")
        return headers or None

    @staticmethod
    def _timestamp(fields: dict[str, msgspec.Raw]) -> int | None:
        if "timestamp" not in fields:
            return None
        document = _decode(fields["timestamp"], "timestamp")
        if document is None:
            return None
        if isinstance(document, int) and not isinstance(document, bool) and document >= 0:
            return document
        if isinstance(document, str):
            try:
                return parse_time_ms(document)
            except slipstream.InvalidArgument as exc:
                raise BadLine(exc.message) from None
        raise BadLine(
            '"timestamp" must be milliseconds since the epoch or an ISO-8601 time with a '
            f"timezone, not {_json_type(document)}"
        )


# --- the produce loop ---------------------------------------------------------------------------


def plural(count: int, noun: str) -> str:
    """``1 event``, ``2 events``, ``1,000 events``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


class Acknowledgements:
    """Which input lines' events the broker has acknowledged, in input order.

    Receipts wait here, oldest first, until their batch is answered, so at most the producer's
    buffer of unacknowledged events is held. ``in_order`` counts the events acknowledged
    before the oldest one that is not: every line before ``first_unacknowledged_line`` is
    stored, which is where a rerun resumes.
    """

    def __init__(self) -> None:
        self._pending: deque[tuple[int, slipstream.Receipt]] = deque()
        self.in_order = 0
        self.error: BaseException | None = None  # the first failed batch's error

    def add(self, line_number: int, receipt: slipstream.Receipt) -> None:
        self._pending.append((line_number, receipt))

    def collect(self) -> None:
        """Take the acknowledgements that arrived; stop at the first event not acknowledged
        (still waiting, or failed: then ``error`` is set)."""
        pending = self._pending
        while pending:
            receipt = pending[0][1]
            if not receipt.done():
                return
            try:
                receipt.result(0)
            except Exception as exc:  # the batch's typed error; the event was not stored
                if self.error is None:
                    self.error = exc
                return
            pending.popleft()
            self.in_order += 1

    def total(self) -> int:
        """Every acknowledged event, also those after the first one that was not."""
        self.collect()
        later = 0
        for _, receipt in self._pending:
            if receipt.done():
                try:
                    receipt.result(0)
                except Exception:
                    continue
                later += 1
        return self.in_order + later

    def first_unacknowledged_line(self) -> int | None:
        self.collect()
        return self._pending[0][0] if self._pending else None

    def unfinished(self) -> bool:
        """Whether some event is neither acknowledged nor failed (after a close: lost)."""
        return any(not receipt.done() for _, receipt in self._pending)


@dataclass(slots=True)
class ProduceStats:
    stream: str
    events: int = 0  # sent (queued in the producer)
    acknowledged: int = 0
    bytes: int = 0
    skipped: int = 0
    lines: int = 0
    input_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    elapsed: float = 0.0
    resume_line: int | None = None  # after a failure: the first line not acknowledged

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(self.elapsed, 1e-9)
        document = {
            "stream": self.stream,
            "events": self.events,
            "acknowledged": self.acknowledged,
            "bytes": self.bytes,
            "skipped": self.skipped,
            "lines": self.lines,
            "elapsed_s": round(self.elapsed, 6),
            "events_per_s": round(self.acknowledged / elapsed, 1),
            "mb_per_s": round(self.bytes / elapsed / 1e6, 3),
        }
        if self.resume_line is not None:
            document["resume_line"] = self.resume_line
        return document

    def summary(self) -> str:
        d = self.as_dict()
        text = (
            f"produced {plural(self.acknowledged, 'event')} ({self.bytes / 1e6:.2f} MB) to "
            f"{self.stream} in {self.elapsed:.2f} s: {d['events_per_s']:,.0f} events/s, "
            f"{d['mb_per_s']:.2f} MB/s"
        )
        if self.skipped:
            text += f"; skipped {plural(self.skipped, 'bad line')}"
        return text

    def failure_summary(self, acks: Acknowledgements) -> str:
        """After a delivery failure: what was stored and how to send the rest."""
        sent = plural(self.events, "event")
        resume = self.resume_line or self.lines + 1
        text = (
            f"acknowledged {self.acknowledged:,} of the {sent} sent to {self.stream}; every "
            f"line before input line {resume:,} is stored. To send the rest, run the same "
            f"command on the same input with --skip {resume - 1}"
        )
        later = self.acknowledged - acks.in_order
        if later > 0:
            text += (
                f" ({plural(later, 'event')} of later lines {'was' if later == 1 else 'were'} "
                "acknowledged too and will be stored twice)"
            )
        return text


class DeliveryFailed(Exception):
    """Events were not acknowledged: the producer's typed error is the cause."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class StoppedAtBadLine(Exception):
    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.line_number = line_number
        self.reason = reason


class ProgressReport:
    """Progress on stderr: a live rich bar when stderr is a terminal (and stdin is not, so it
    does not garble typing), else a plain line every ``every`` seconds on long inputs."""

    def __init__(self, console: Console, stdin: BinaryIO, every: float = 10.0) -> None:
        self.console = console
        self.every = every
        self.last_line = time.monotonic()
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        interactive_in = _isatty(stdin)
        if console.is_terminal and not interactive_in:
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self.task = self.progress.add_task(
                "producing", total=_input_size(stdin), status="starting"
            )
            self.progress.start()
        self.silent = interactive_in and self.progress is None

    def update(self, stats: ProduceStats) -> None:
        now = time.monotonic()
        elapsed = max(now - stats.started, 1e-9)
        status = (
            f"{stats.acknowledged:,} of {stats.events:,} events acknowledged, "
            f"{stats.bytes / 1e6:.1f} MB sent, {stats.acknowledged / elapsed:,.0f} events/s, "
            f"{stats.bytes / elapsed / 1e6:.2f} MB/s"
        )
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=stats.input_bytes, status=status)
        elif not self.silent and now - self.last_line >= self.every:
            self.last_line = now
            self.console.print(f"producing to {stats.stream}: {status}", highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _isatty(stream: BinaryIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _input_size(stream: BinaryIO) -> int | None:
    """Bytes left in ``stream`` if it is a regular file (so the bar has an end), else None."""
    try:
        fd = stream.fileno()
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            return max(0, info.st_size - os.lseek(fd, 0, os.SEEK_CUR))
    except (AttributeError, OSError, ValueError):
        pass
    return None


def batch_size_hint(exc: slipstream.BatchTooLarge) -> str:
    """The error of an event bigger than a batch, naming the flag that raises the limit."""
    size = int(exc.details.get("size", 0))
    mib = 1 << 20
    suggested = max(2 * mib, -(-(size + 64 * 1024) // mib) * mib)  # MiB, with framing room
    return (
        f"{exc.message}; raise the batch size with --batch-size {suggested // mib}MiB "
        "(the broker's limit is its --max-batch, 8MiB by default)"
    )


def produce_lines(
    producer: slipstream.Producer,
    lines: Iterable[bytes],
    parser: LineParser,
    stats: ProduceStats,
    acks: Acknowledgements,
    *,
    skip_bad: bool,
    report: ProgressReport,
    warn: Console,
    skip_lines: int = 0,
    max_warnings: int = 5,
) -> None:
    """Send every line's event after the first ``skip_lines`` lines; raises StoppedAtBadLine
    (unless ``skip_bad``) and DeliveryFailed as soon as a batch failed (checked every 0.1 s).
    The caller flushes the producer: events before a bad line are still sent and
    acknowledged."""
    next_report = time.monotonic()
    for number, line in enumerate(lines, 1):
        stats.lines = number
        stats.input_bytes += len(line)
        if number <= skip_lines:
            continue
        try:
            event = parser.parse(line)
            if event is None:
                continue
            receipt = producer.send(event.value, event.key, event.headers, event.timestamp)
        except (BadLine, slipstream.BatchTooLarge) as exc:
            reason = batch_size_hint(exc) if isinstance(exc, slipstream.BatchTooLarge) else str(exc)
            if not skip_bad:
                raise StoppedAtBadLine(number, reason) from None
            stats.skipped += 1
            if stats.skipped <= max_warnings:
                warn.print(f"[yellow]skipped line {number}[/]: {escape(reason)}", highlight=False)
            continue
        except slipstream.SlipstreamError as exc:  # the producer gave up before this line
            raise DeliveryFailed(exc) from exc
        acks.add(number, receipt)
        stats.events += 1
        stats.bytes += len(event.value)
        if (now := time.monotonic()) >= next_report:
            next_report = now + 0.1
            acks.collect()
            if acks.error is not None:
                raise DeliveryFailed(acks.error)
            stats.acknowledged = acks.in_order
            report.update(stats)


def stdin_lines() -> BinaryIO:
    return sys.stdin.buffer
