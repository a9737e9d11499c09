"""The message browser: pages of a stream's events across its segments, read through the
service layer (``Service.segment`` and ``Service.read``), merged by time.

A page is bounded by a cut (segment -> offset). Going back ("before" a cut) reads, in every
segment, the newest ``limit`` events below its position and keeps the newest ``limit`` of all
of them; going forward ("after" a cut, also a jump to a time) reads the oldest ``limit`` from
each position and keeps the oldest ``limit``. Either way a segment's shown events are one
contiguous run, so the page's next cuts are exact: "older" starts below each segment's first
shown event, "newer" right after its last, and a segment with nothing shown keeps its place.
Events are shown oldest first, ordered by (timestamp, segment, offset).

Reads cost at most ``limit`` events (and batches of up to ``READ_BYTES``) per segment, for at
most ``MAX_SEGMENTS`` segments: a page never scans a stream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import msgspec

from .._errors import InvalidArgument
from ..format import FLAG_CONTROL, Event, decode_header, events_of, read_body
from ..protocol import SegmentInfo, StreamInfo
from ..streams import StreamCut

if TYPE_CHECKING:
    from ..broker import Caller, Service

READ_BYTES = 1 << 20
MAX_SEGMENTS = 64
MAX_LIMIT = 500
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


def parse_cut(text: str) -> dict[int, int]:
    """``"0:12,1:40"`` (segment:offset, comma separated) -> {0: 12, 1: 40}."""
    try:
        pairs = (item.split(":") for item in text.split(",") if item.strip())
        cut = {int(segment): int(offset) for segment, offset in pairs}
    except ValueError:
        raise InvalidArgument(
            f"a position list is segment:offset pairs like 0:12,1:40, not {text!r}"
        ) from None
    if any(offset < 0 or segment < 0 for segment, offset in cut.items()):
        raise InvalidArgument("segments and offsets are not negative")
    return cut


def format_cut(cut: Mapping[int, int]) -> str:
    return ",".join(f"{segment}:{offset}" for segment, offset in sorted(cut.items()))


async def events_before(
    service: Service,
    caller: Caller,
    info: StreamInfo,
    before: Mapping[int, int] | None,
    limit: int,
) -> EventPage:
    """The newest ``limit`` events below ``before`` (None: the end of every segment)."""
    limit = _check_limit(limit)
    bounds = {s.number: s for s in _segments(info)}
    upper = {
        n: _clamp(s, before.get(n, s.end_offset) if before else s.end_offset)
        for n, s in bounds.items()
    }
    found: list[Event] = []
    for number, segment in bounds.items():
        start = max(segment.start_offset, upper[number] - limit)
        found += await _read(service, caller, info.name, number, start, upper[number])
    found.sort(key=_order)
    shown = found[-limit:]
    older = {n: _first(shown, n, upper[n]) for n in bounds}
    has_older = any(older[n] > s.start_offset for n, s in bounds.items())
    at_tail = all(upper[n] >= s.end_offset for n, s in bounds.items())
    return _page(info.name, shown, upper, older if has_older else None, None if at_tail else upper)


async def events_after(
    service: Service, caller: Caller, info: StreamInfo, after: Mapping[int, int], limit: int
) -> EventPage:
    """The oldest ``limit`` events from ``after`` on (segments it does not name: from their
    first retained event)."""
    limit = _check_limit(limit)
    bounds = {s.number: s for s in _segments(info)}
    lower = {n: _clamp(s, after.get(n, s.start_offset)) for n, s in bounds.items()}
    found: list[Event] = []
    for number, segment in bounds.items():
        end = min(segment.end_offset, lower[number] + limit)
        found += await _read(service, caller, info.name, number, lower[number], end)
    found.sort(key=_order)
    shown = found[:limit]
    upper = {n: _last(shown, n, lower[n]) for n in bounds}
    at_tail = all(upper[n] >= s.end_offset for n, s in bounds.items())
    older = {n: _first(shown, n, lower[n]) for n in bounds}
    has_older = any(older[n] > s.start_offset for n, s in bounds.items())
    return _page(info.name, shown, upper, older if has_older else None, None if at_tail else upper)


def found_page(stream: str, found: list[Event]) -> EventPage:
    """A page of events a find by key returned (any order): shown oldest first, each with the
    cut at its own position (other segments from their first retained event); no paging."""
    shown = sorted(found, key=_order)
    events = [_shown(e, StreamCut(stream, {e.segment: e.offset}).to_json()) for e in shown]
    first = events[0].cut if events else StreamCut(stream, {}).to_json()
    return EventPage(events, None, None, first)


def _segments(info: StreamInfo) -> list[SegmentInfo]:
    """The segments a page reads: those holding events, the newest MAX_SEGMENTS of them."""
    held = [s for s in info.segments if s.end_offset > s.start_offset]
    return sorted(held, key=lambda s: s.number)[-MAX_SEGMENTS:]


def _check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit is 1 to {MAX_LIMIT} events, not {limit}")
    return limit


def _clamp(segment: SegmentInfo, offset: int) -> int:
    return min(max(offset, segment.start_offset), segment.end_offset)


def _order(event: Event) -> tuple[int, int, int]:
    return (event.timestamp, event.segment, event.offset)


def _first(shown: list[Event], segment: int, default: int) -> int:
    return min((e.offset for e in shown if e.segment == segment), default=default)


def _last(shown: list[Event], segment: int, default: int) -> int:
    return max((e.offset + 1 for e in shown if e.segment == segment), default=default)


async def _read(
    service: Service, caller: Caller, stream: str, number: int, start: int, end: int
) -> list[Event]:
    """The events of one segment in [start, end)."""
    events: list[Event] = []
    if start >= end:
        return events
    segment = service.segment(caller, stream, number)
    offset = start
    while offset < end:
        batches = await service.read(caller, segment, offset, READ_BYTES)
        if not batches:
            break
        for batch in batches:
            header = decode_header(batch)
            offset = max(offset, header.next_offset)
            if header.flags & FLAG_CONTROL:
                continue
            for event in events_of(read_body(batch), number, header.base_offset):
                if start <= event.offset < end:
                    events.append(event)
    return events


def _page(
    stream: str,
    shown: list[Event],
    upper: dict[int, int],
    older: dict[int, int] | None,
    newer: dict[int, int] | None,
) -> EventPage:
    # the cut "from this event on": in each segment, its first shown event at or after this
    # one in the page's order, else the end of what the page shows of that segment
    events = []
    after = dict(upper)
    cuts = []
    for event in reversed(shown):
        after[event.segment] = event.offset
        cuts.append(StreamCut(stream, dict(after)).to_json())
    cuts.reverse()
    for event, cut in zip(shown, cuts, strict=True):
        events.append(_shown(event, cut))
    page_cut = cuts[0] if cuts else StreamCut(stream, upper).to_json()
    return EventPage(events, older, newer, page_cut)


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
