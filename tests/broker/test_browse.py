"""Browsing a stream page by page through the service layer (``Service.browse_events``,
slipstream/broker/_browse.py), as the admin HTTP API and the console call it; an in-process
broker, no sockets in the calls under test.

The contract under test: paging back from the tail ("before" each page's ``older`` cut) and
forward from the start ("after" each page's ``newer`` cut) each show every event of every
segment exactly once, in (timestamp, segment, offset) order, and end with None; a cut given
as text (``0:12,1:40``) pages like the same positions given as a mapping; each event's cut
starts at that event; bad arguments raise InvalidArgument, an unknown stream StreamNotFound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from raw import batch
from test_service import run

from slipstream import InvalidArgument, StreamNotFound
from slipstream.broker import MAX_PAGE_EVENTS, EventsPage, Service
from slipstream.streams import format_positions

EVENTS = {0: 7, 1: 5}  # events per segment


async def fill(service: Service) -> None:
    caller = service.connect("fill")
    await service.create_stream(caller, "s/a", len(EVENTS))
    for segment, count in EVENTS.items():
        for n in range(count):
            future, _ = service.append(caller, "s/a", segment, None, bytearray(batch(1, b"%d" % n)))
            await future


def positions(page: EventsPage) -> list[tuple[int, int]]:
    return [(e.segment, e.offset) for e in page.events]


def check_page(page: EventsPage) -> None:
    order = [(e.timestamp, e.segment, e.offset) for e in page.events]
    assert order == sorted(order)
    assert len(page.cuts) == len(page.events)
    for event, cut in zip(page.events, page.cuts, strict=True):
        assert cut[event.segment] == event.offset
    if page.events:
        assert page.start == page.cuts[0]


def test_pages_back_and_forward_show_every_event_once(tmp_path: Path) -> None:
    everything = sorted((s, o) for s, count in EVENTS.items() for o in range(count))

    async def body(service: Service) -> None:
        await fill(service)
        caller = service.connect("test")
        # back from the tail
        page = await service.browse_events(caller, "s/a", limit=5)
        assert page.newer is None
        seen: list[tuple[int, int]] = []
        for _ in range(len(everything)):  # a page that shows nothing new would loop forever
            check_page(page)
            seen = positions(page) + seen
            if page.older is None:
                break
            page = await service.browse_events(caller, "s/a", before=page.older, limit=5)
        else:
            pytest.fail(f"paging back did not reach the start: {seen}")
        assert sorted(seen) == everything and len(seen) == len(everything)
        # forward from the start, the cuts as the text a link carries
        page = await service.browse_events(caller, "s/a", at="earliest", limit=5)
        assert page.older is None
        seen = []
        for _ in range(len(everything)):
            check_page(page)
            seen += positions(page)
            if page.newer is None:
                break
            text = format_positions(page.newer)
            as_text = await service.browse_events(caller, "s/a", after=text, limit=5)
            page = await service.browse_events(caller, "s/a", after=page.newer, limit=5)
            assert as_text == page
        else:
            pytest.fail(f"paging forward did not reach the tail: {seen}")
        assert sorted(seen) == everything and len(seen) == len(everything)

    run(tmp_path, body)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    async def body(service: Service) -> None:
        await fill(service)
        caller = service.connect("test")
        with pytest.raises(InvalidArgument, match="not both"):
            await service.browse_events(caller, "s/a", before={0: 1}, after={0: 0})
        for limit in (0, MAX_PAGE_EVENTS + 1):
            with pytest.raises(InvalidArgument, match="limit"):
                await service.browse_events(caller, "s/a", limit=limit)
        with pytest.raises(InvalidArgument, match="segment:offset"):
            await service.browse_events(caller, "s/a", before="0-3")
        with pytest.raises(StreamNotFound):
            await service.browse_events(caller, "s/none")

    run(tmp_path, body)
