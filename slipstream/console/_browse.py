"""The message browser's presentation of events: values pretty-printed (JSON, text or hex),
times in ISO 8601, and the StreamCut (JSON) a reader copies to start at an event. The pages
themselves are cut by the service layer (``Service.browse_events``, broker/_browse.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import msgspec

from ..format import Event
from ..streams import StreamCut

if TYPE_CHECKING:
    from ..broker import EventsPage

#: a value longer than this is cut in the page (the position says where to read it whole)
SHOWN_VALUE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class ShownEvent:
    event: Event
    time: str
    key: str
    value: str
    value_kind: str  # "json", "text" or "binary"
    headers: dict[str, str]
    cut: str  # the StreamCut (JSON) a reader starts at to read this event and the page after it


@dataclass(frozen=True, slots=True)
class EventPage:
    events: list[ShownEvent]
    older: dict[int, int] | None  # "before" cut of the previous page; None at the start
    newer: dict[int, int] | None  # "after" cut of the next page; None at the tail
    cut: str  # the StreamCut of the page's first event (or its bound if it is empty)


def shown_page(page: EventsPage) -> EventPage:
    """A page ``Service.browse_events`` cut, for the browser: each event with the StreamCut
    (JSON) that starts at it, and the page's older and newer links."""
    events = [
        _shown(event, StreamCut(page.stream, cut).to_json())
        for event, cut in zip(page.events, page.cuts, strict=True)
    ]
    return EventPage(events, page.older, page.newer, StreamCut(page.stream, page.start).to_json())


def found_page(stream: str, found: list[Event]) -> EventPage:
    """A page of events a find by key returned (any order): shown oldest first, each with the
    cut at its own position (other segments from their first retained event); no paging."""
    shown = sorted(found, key=lambda e: (e.timestamp, e.segment, e.offset))
    events = [_shown(e, StreamCut(stream, {e.segment: e.offset}).to_json()) for e in shown]
    first = events[0].cut if events else StreamCut(stream, {}).to_json()
    return EventPage(events, None, None, first)


def _shown(event: Event, cut: str) -> ShownEvent:
    value, kind = render_value(event.value)
    return ShownEvent(
        event,
        datetime.fromtimestamp(event.timestamp / 1000, UTC).isoformat(timespec="milliseconds"),
        _text(event.key) if event.key is not None else "",
        value,
        kind,
        {name: _text(raw) for name, raw in event.headers.items()},
        cut,
    )


def render_value(value: bytes) -> tuple[str, str]:
    """A value for the page: pretty-printed JSON, else text, else hex; cut past
    SHOWN_VALUE_BYTES."""
    cut = len(value) > SHOWN_VALUE_BYTES
    shown = value[:SHOWN_VALUE_BYTES]
    suffix = f"\n… ({len(value)} bytes in all)" if cut else ""
    if not cut:
        try:
            decoded = msgspec.json.decode(value)
        except msgspec.DecodeError:
            pass
        else:
            return json.dumps(decoded, indent=2, ensure_ascii=False), "json"
    try:
        return shown.decode() + suffix, "text"
    except UnicodeDecodeError:
        return shown.hex(" ") + suffix, "binary"


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "0x" + raw.hex()
