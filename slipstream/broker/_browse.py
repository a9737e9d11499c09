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
``MAX_SEGMENTS`` holding events are not shown. The segments are read at once.

In a cluster the page's bounds are every segment's live ones (``Service.stream_info``) and a
segment another broker serves is read from it with ``ReadSegment``, the request a queue's
coordinator reads with: whole batches, as this broker reads its own. No message of its own:
the merge above needs only each segment's events near a position, the same bytes wherever
they are read, so the page is cut here exactly as on one broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import BrokerUnavailable, InvalidArgument, SlipstreamError
from ..format import FLAG_CONTROL, Event, decode_header, events_of, iter_batches, read_body
from ..protocol import ReadSegment, SegmentData, SegmentInfo, StreamInfo

if TYPE_CHECKING:
    from ._segment import Segment
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
    found = await _read_all(
        service,
        caller,
        info.name,
        [(n, max(s.start_offset, upper[n] - limit), upper[n]) for n, s in bounds.items()],
    )
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
    found = await _read_all(
        service,
        caller,
        info.name,
        [(n, lower[n], min(s.end_offset, lower[n] + limit)) for n, s in bounds.items()],
    )
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


async def _read_all(
    service: Service, caller: Caller, stream: str, ranges: Sequence[tuple[int, int, int]]
) -> list[Event]:
    """The events of each ``(segment, start, end)`` in [start, end), the segments read at
    once (each to its end, even when another fails: then the first error is raised)."""
    parts = await asyncio.gather(
        *(_read(service, caller, stream, n, start, end) for n, start, end in ranges),
        return_exceptions=True,
    )
    found: list[Event] = []
    for part in parts:
        if isinstance(part, BaseException):
            raise part
        found += part
    return found


async def _read(
    service: Service, caller: Caller, stream: str, number: int, start: int, end: int
) -> list[Event]:
    """The events of one segment in [start, end): read here if this broker serves it, else
    from the broker that does (``_read_elsewhere``)."""
    events: list[Event] = []
    if start >= end:
        return events
    served = True
    if service.cluster.enabled:  # the caller may consume: browse_events checked
        segment = service.controller.stream(stream).segment(number)
        served = service.is_served(segment)
    if served:
        segment = service.segment(caller, stream, number)
    offset = start
    while offset < end:
        if served:
            batches = await service.read(caller, segment, offset, READ_BYTES)
        else:
            batches = await _read_elsewhere(service, segment, offset)
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


async def _read_elsewhere(
    service: Service, segment: Segment, offset: int
) -> list[bytes | bytearray | memoryview]:
    """Whole batches of ``segment`` from ``offset``, from the broker serving it
    (``ReadSegment``). WrongBroker if nobody serves it (moving), its broker does not answer
    (``PEER_TIMEOUT_S``) or no longer serves it; its other errors (OffsetOutOfRange,
    CorruptData) as given."""
    cluster = service.cluster
    owner = cluster.owners[segment.container]
    what = f"segment {segment.number} of {segment.stream_name!r}"
    if not owner or owner == cluster.broker_id:
        raise cluster.wrong_broker(segment.container, what)
    try:
        reply, payload = await service.peers.exchange(
            owner, ReadSegment(segment.stream_name, segment.number, offset, READ_BYTES)
        )
    except (BrokerUnavailable, TimeoutError):
        raise cluster.wrong_broker(segment.container, what) from None
    if not isinstance(reply, SegmentData):
        raise SlipstreamError(f"broker {owner!r} answered ReadSegment with {type(reply).__name__}")
    return [batch for _, batch in iter_batches(payload)]


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
