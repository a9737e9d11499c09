"""Browsing a stream: pages of its events across its segments, merged by time, for every
protocol that shows events (the admin HTTP API, the console); ``Service.browse_events`` is the
entry point.

A page is bounded by a cut (segment -> offset). Going back ("before" a cut) reads, in every
segment, the newest ``limit`` events below its position and keeps the newest ``limit`` of all
of them; going forward ("after" a cut, also a jump to a time) reads the oldest ``limit`` from
each position and keeps the oldest ``limit``. Either way a segment's shown events are one
contiguous run, so the page's next cuts are exact: "older" starts below each segment's first
shown event, "newer" right after its last, and a segment with nothing shown keeps its place.
Events are in order of (timestamp, segment, offset), oldest first.

Reads cost at most ``limit`` events (and batches of up to ``READ_BYTES``) per segment, for at
most ``MAX_SEGMENTS`` segments: a page never scans a stream. Segments past the newest
``MAX_SEGMENTS`` holding events are not shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import InvalidArgument
from ..format import FLAG_CONTROL, Event, decode_header, events_of, read_body
from ..protocol import SegmentInfo, StreamInfo

if TYPE_CHECKING:
    from ._service import Caller, Service

READ_BYTES = 1 << 20
MAX_SEGMENTS = 64
#: the most events one page holds
MAX_PAGE_EVENTS = 500


@dataclass(frozen=True, slots=True)
class EventsPage:
    """One page of a stream's events, oldest first.

    ``cuts[i]``: the positions a reader starts at to read ``events[i]`` and the rest of the page
    after it (in each segment, its first shown event at or after this one, else the end of what
    the page shows of it). ``start``: the positions of the page's first event (its bound if the
    page is empty). ``older``: the "before" cut of the previous page, None at the start of the
    stream; ``newer``: the "after" cut of the next page, None at the tail."""

    stream: str
    events: list[Event]
    cuts: list[dict[int, int]]
    start: dict[int, int]
    older: dict[int, int] | None
    newer: dict[int, int] | None


async def events_before(
    service: Service,
    caller: Caller,
    info: StreamInfo,
    before: Mapping[int, int] | None,
    limit: int,
) -> EventsPage:
    """The newest ``limit`` events below ``before`` (None or empty: the end of every segment)."""
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
) -> EventsPage:
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


def _segments(info: StreamInfo) -> list[SegmentInfo]:
    """The segments a page reads: those holding events, the newest MAX_SEGMENTS of them."""
    held = [s for s in info.segments if s.end_offset > s.start_offset]
    return sorted(held, key=lambda s: s.number)[-MAX_SEGMENTS:]


def _check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE_EVENTS:
        raise InvalidArgument(f"limit is 1 to {MAX_PAGE_EVENTS} events, not {limit}")
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
) -> EventsPage:
    after = dict(upper)
    cuts = []
    for event in reversed(shown):
        after[event.segment] = event.offset
        cuts.append(dict(after))
    cuts.reverse()
    start = cuts[0] if cuts else dict(upper)
    return EventsPage(stream, shown, cuts, start, older, newer)
