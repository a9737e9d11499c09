"""What every client command shares: the broker option, consoles, time and size formatting."""

from __future__ import annotations

import base64
import datetime as dt
import os
import sys
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.markup import escape

import slipstream

from .._errors import InvalidArgument

DEFAULT_BROKER = "127.0.0.1:7070"

BrokerOption = Annotated[
    str,
    typer.Option(
        "--broker",
        envvar="SLIPSTREAM_BROKER",
        help=(
            "Broker address host:port, or a cluster's list h1:7070,h2:7070 (default: "
            "$SLIPSTREAM_BROKER, else 127.0.0.1:7070)."
        ),
        show_default=False,
    ),
]

#: Human output (tables, progress, errors) goes to stderr so stdout stays data for pipes,
#: except for listing commands whose whole purpose is the table.
out = Console()
err = Console(stderr=True)
if not out.is_terminal and "COLUMNS" not in os.environ:
    out.width = 200  # tables written to a file or pipe need not squeeze into 80 columns


def connect(broker: str, *, reconnect_timeout: float = 30.0) -> slipstream.Client:
    """Connect or raise BrokerUnavailable, whose message says how to start a broker;
    ``reconnect_timeout``: how long a lost connection is dialled again."""
    return slipstream.connect(broker or DEFAULT_BROKER, reconnect_timeout=reconnect_timeout)


def iso_ms(ms: int | None) -> str:
    """Milliseconds since the epoch -> ``2026-11-21T08:00:00.123Z`` (empty for None)."""
    if ms is None:
        return ""
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time_ms(text: str) -> int:
    """ISO-8601 text with a timezone -> milliseconds since the epoch."""
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgument(
            f"time {text!r} is not ISO-8601; use e.g. 2026-11-21T08:00:00Z"
        ) from None
    if moment.tzinfo is None:
        raise InvalidArgument(f"time {text!r} needs a timezone, e.g. 2026-11-21T08:00:00Z")
    return int(moment.timestamp() * 1000)


def human_duration_ms(ms: int) -> str:
    """604800000 -> ``7d``; the largest units that divide it exactly."""
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size:
            whole, ms = divmod(ms, size)
            parts.append(f"{whole}{unit}")
    if ms or not parts:
        parts.append(f"{ms}ms")
    return "".join(parts)


def text_or_base64(data: bytes) -> tuple[str | None, str | None]:
    """``(text, None)`` if ``data`` is UTF-8, else ``(None, base64)``: JSON output stays
    lossless for binary keys, values and headers."""
    try:
        return data.decode(), None
    except UnicodeDecodeError:
        return None, base64.b64encode(data).decode()


def json_ready(obj: Any) -> Any:
    """msgspec structs (StreamInfo, SegmentInfo) -> plain dicts and lists."""
    import msgspec

    return msgspec.to_builtins(obj)


def examples(*lines: str) -> str:
    """An epilog for --help: the example command lines, one per line."""
    return "[bold]Examples[/]\n\n" + "\n".join(f"  {escape(line)}" for line in lines)


def print_json(document: object) -> None:
    """A document as indented JSON on stdout (for scripts: ``--json``)."""
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(document)).decode() + "\n")
