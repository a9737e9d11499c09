"""Readers and consumer groups across splits and merges, on a real broker: a successor is read
only after every predecessor was read to its end, so each key's events arrive in append order
and complete, for a tail reader opened before the scales, a bounded reader from the earliest
events, a reader starting at a StreamCut taken before the scales, and a consumer group of two
reading while the stream is split and merged.

Every event's value is its key's sequence number, so a key's events as read must be exactly
``0, 1, 2, ...`` (readers) or, per group member once re-deliveries are dropped, increasing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import pytest
from conftest import BrokerProcess

import slipstream
from slipstream import Event, StreamCut
from slipstream.client import _consumer, _reader

KEYS = [f"k{i}" for i in range(40)]
PER_PHASE = 1500


@pytest.fixture(autouse=True)
def _small_credit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few batches of credit per follow, so a segment's events arrive over many pushes:
    a successor followed too early would interleave with its predecessor's rest (with the
    default 32 MiB a predecessor here arrives whole in one push, which hides that bug)."""
    for module in (_reader, _consumer):
        monkeypatch.setattr(module, "CREDIT_BYTES", 48 * 1024)
        monkeypatch.setattr(module, "MIN_SEGMENT_CREDIT", 4 * 1024)


class Appender:
    """Produces events with many keys; each value is its key's sequence number."""

    def __init__(self, client: slipstream.Client, stream: str) -> None:
        self.client, self.stream = client, stream
        self.sent: dict[str, int] = defaultdict(int)

    def produce(self, count: int) -> None:
        with self.client.producer(self.stream, linger_ms=1) as producer:
            for i in range(count):
                key = KEYS[(i * 7 + i // 13) % len(KEYS)]
                producer.send(b"%d" % self.sent[key], key=key)
                self.sent[key] += 1

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def split_split_merge(
    client: slipstream.Client,
    stream: str,
    appender: Appender,
    first_split: threading.Event | None = None,
) -> None:
    """Segments 0, 1 -> split 0 into 2, 3 -> split 1 into 4, 5 -> merge 3 and 4 into 6, with
    events of every key before, between and after."""
    appender.produce(PER_PHASE)
    client.scale_stream(stream, split=0, into=2)
    if first_split is not None:
        first_split.set()
    appender.produce(PER_PHASE)
    client.scale_stream(stream, split=1, into=2)
    appender.produce(PER_PHASE)
    info = client.scale_stream(stream, merge=[3, 4])
    assert [(s.number, s.sealed, s.predecessors) for s in info.segments] == [
        (0, True, []),
        (1, True, []),
        (2, False, [0]),
        (3, True, [0]),
        (4, True, [1]),
        (5, False, [1]),
        (6, False, [3, 4]),
    ]
    appender.produce(PER_PHASE)


def by_key(events: Iterable[Event]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = defaultdict(list)
    for event in events:
        assert event.key is not None
        got[event.key.decode()].append(int(event.value))
    return dict(got)


def check_order_and_completeness(events: list[Event], sent: dict[str, int]) -> None:
    got = by_key(events)
    for key, count in sent.items():
        assert got.get(key) == list(range(count)), f"key {key}: {got.get(key)}"


def read_in_thread(
    broker: BrokerProcess, stream: str, count: int, opened: threading.Event
) -> tuple[threading.Thread, list[Event]]:
    events: list[Event] = []

    def run() -> None:
        with broker.client() as client, client.reader(stream, start="earliest") as reader:
            for event in reader:
                events.append(event)
                opened.set()
                if len(events) >= count:
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events


def test_tail_and_bounded_readers_keep_every_keys_order_across_splits_and_a_merge(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("sr/read", segments=2)
    appender = Appender(client, "sr/read")
    appender.produce(10)
    opened = threading.Event()
    total = 10 + 4 * PER_PHASE
    tail, tailed = read_in_thread(broker, "sr/read", total, opened)
    assert opened.wait(30)  # the tail reader follows segments 0 and 1 before any scale
    split_split_merge(client, "sr/read", appender)
    tail.join(60)
    assert not tail.is_alive(), f"the tail reader got {len(tailed)} of {total} events"
    check_order_and_completeness(tailed, appender.sent)
    with client.reader("sr/read", start="earliest", end=client.tail("sr/read")) as reader:
        bounded = list(reader)
    check_order_and_completeness(bounded, appender.sent)
    assert len(bounded) == total
    # a successor is read only after its predecessors: all of 0 before any of 2 and 3, ...
    first = {s: min(i for i, e in enumerate(bounded) if e.segment == s) for s in range(7)}
    last = {s: max(i for i, e in enumerate(bounded) if e.segment == s) for s in range(7)}
    for successor, predecessors in {2: [0], 3: [0], 4: [1], 5: [1], 6: [3, 4]}.items():
        assert all(last[p] < first[successor] for p in predecessors)


def test_a_stream_cut_taken_before_the_scales_reads_what_came_after_it_in_order(
    client: slipstream.Client,
) -> None:
    client.create_stream("sr/cut", segments=2)
    appender = Appender(client, "sr/cut")
    appender.produce(200)
    before = dict(appender.sent)
    cut = client.tail("sr/cut")
    assert set(cut.positions) == {0, 1}
    split_split_merge(client, "sr/cut", appender)
    later = StreamCut.from_json(cut.to_json())  # as an application would have stored it
    with client.reader("sr/cut", start=later, end=client.tail("sr/cut")) as reader:
        events = list(reader)
    got = by_key(events)
    for key, count in appender.sent.items():
        assert got.get(key, []) == list(range(before.get(key, 0), count)), key
    with client.reader("sr/cut", start=client.tail("sr/cut"), end=client.tail("sr/cut")) as r:
        assert list(r) == []  # the end of every epoch: nothing left


def test_cuts_that_name_only_open_segments_bound_and_start_reads_across_epochs(
    client: slipstream.Client,
) -> None:
    """A cut naming only the segments open at its time (as one stored by an older client):
    as an end, the segments before them are read to their ends; as a start, they are done."""
    client.create_stream("sr/open-cut", segments=2)
    appender = Appender(client, "sr/open-cut")
    split_split_merge(client, "sr/open-cut", appender)
    open_now = {2, 5, 6}
    tail = client.tail("sr/open-cut")
    end = StreamCut("sr/open-cut", {s: p for s, p in tail.positions.items() if s in open_now})
    with client.reader("sr/open-cut", start="earliest", end=end) as reader:
        check_order_and_completeness(list(reader), appender.sent)
    appender.produce(300)
    start = StreamCut("sr/open-cut", dict(end.positions))
    with client.reader("sr/open-cut", start=start, end=client.tail("sr/open-cut")) as reader:
        assert len(list(reader)) == 300  # only what came after the cut


def test_the_asyncio_reader_follows_successors_in_order_too(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("sr/async", segments=2)
    appender = Appender(client, "sr/async")
    appender.produce(10)

    async def read(count: int) -> list[Event]:
        async with slipstream.connect_async(broker.address) as aclient:
            events: list[Event] = []
            async with aclient.reader("sr/async", start="earliest") as reader:
                async for event in reader:  # a tail reader opened before the scales
                    events.append(event)
                    if len(events) == 10:
                        await asyncio.to_thread(split_split_merge, client, "sr/async", appender)
                    if len(events) == count:
                        return events
            return events

    events = asyncio.run(asyncio.wait_for(read(10 + 4 * PER_PHASE), 60))
    check_order_and_completeness(events, appender.sent)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_group_of_two_reads_every_event_in_each_keys_order_while_the_stream_scales(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("sr/group", segments=2)
    client.create_subscription("sr/group", "workers")
    appender = Appender(client, "sr/group")
    with broker.client() as other:
        members = [
            client.consumer("sr/group", "workers", name="a"),
            other.consumer("sr/group", "workers", name="b"),
        ]
        wait_for(lambda: all(len(m.assignment) == 1 for m in members))
        got: list[list[Event]] = [[], []]  # per member
        received: list[Event] = []  # by both, in the order the application took them
        done, first_split = threading.Event(), threading.Event()

        def produce_and_scale() -> None:
            try:
                split_split_merge(client, "sr/group", appender, first_split)
            finally:
                done.set()

        scaler = threading.Thread(target=produce_and_scale, daemon=True)
        scaler.start()
        # the members start taking events once segment 0 is sealed with a backlog, while its
        # successors already receive events: they must wait for 0 to be committed to its end
        assert first_split.wait(60)
        deadline = time.monotonic() + 90
        seen: set[tuple[str, int]] = set()
        while not (done.is_set() and len(seen) >= appender.total):
            assert time.monotonic() < deadline, f"got {len(seen)} of {appender.total}"
            for i, member in enumerate(members):
                events = member.poll(0.02)
                got[i].extend(events)
                received.extend(events)
                seen.update((e.key.decode(), int(e.value)) for e in events if e.key)
        scaler.join(30)
        for member in members:
            member.close()
    assert seen == {(k, n) for k, count in appender.sent.items() for n in range(count)}
    graph_ancestors = {2: {0}, 3: {0}, 4: {1}, 5: {1}, 6: {0, 1, 3, 4}}
    for events in got:
        last: dict[str, tuple[int, int]] = {}  # key -> (segment, sequence)
        for event in events:
            key, sequence = event.key.decode() if event.key else "", int(event.value)
            if key in last:
                segment, previous = last[key]
                assert event.segment not in graph_ancestors.get(segment, set()), (
                    f"key {key}: segment {event.segment} read after its successor {segment}"
                )
                if event.segment != segment:
                    assert sequence > previous, f"key {key}: {sequence} after {previous}"
            last[key] = (event.segment, sequence)
    # A successor is granted only once its predecessors are committed to their ends, and a
    # member commits only what the application took: so, over both members in the order the
    # application took their events, once re-deliveries (a segment granted again from its
    # committed position) are dropped, each key's events come in append order.
    firsts: dict[str, list[int]] = defaultdict(list)
    taken: set[tuple[str, int]] = set()
    for key, sequence in ((e.key.decode() if e.key else "", int(e.value)) for e in received):
        if (key, sequence) not in taken:
            taken.add((key, sequence))
            firsts[key].append(sequence)
    for key, sequences in firsts.items():
        assert sequences == sorted(sequences), f"key {key}: {sequences}"


def test_a_sealed_segment_waits_with_its_backlog_and_is_released_once_committed_to_its_end(
    client: slipstream.Client,
) -> None:
    client.create_stream("sr/backlog", segments=1)
    client.create_subscription("sr/backlog", "app")
    appender = Appender(client, "sr/backlog")
    appender.produce(300)
    client.scale_stream("sr/backlog", split=0, into=2)
    appender.produce(100)

    def rows() -> dict[int, tuple[int, int, int, int]]:
        info = client.describe_subscription("sr/backlog", "app")
        return {
            s.segment: (s.position, s.end_offset, s.backlog_events, s.owner) for s in info.segments
        }

    before = rows()
    assert before[0] == (0, 300, 300, 0)  # the sealed segment: end minus position
    assert before[1][2] + before[2][2] == 100
    with client.consumer("sr/backlog", "app", commit="manual") as consumer:
        wait_for(lambda: consumer.assignment == {0})  # successors wait for 0
        events: list[Event] = []
        while len(events) < 300:
            events.extend(consumer.poll(0.05))
        assert {e.segment for e in events} == {0}
        consumer.commit()  # 0 read to its end: released, its successors granted
        wait_for(lambda: consumer.assignment == {1, 2})
        while len(events) < 400:
            events.extend(consumer.poll(0.05))
        consumer.commit()
    check_order_and_completeness(events, appender.sent)
    after = rows()
    assert after[0] == (300, 300, 0, 0)
    assert all(after[s][2] == 0 for s in (1, 2))


def test_committing_a_released_segment_again_at_its_committed_position_is_a_no_op(
    client: slipstream.Client,
) -> None:
    """Once a sealed segment is committed to its end, the member releases it in its next
    poll; an application's commit racing that release may still name it. Committing it again
    at the position already committed changes nothing, so it is accepted (the rest of the
    commit is stored); moving it anywhere else is still refused: the member does not hold it.
    """
    client.create_stream("sr/again", segments=1)
    client.create_subscription("sr/again", "app")
    appender = Appender(client, "sr/again")
    appender.produce(50)
    client.scale_stream("sr/again", split=0, into=2)
    appender.produce(40)
    with client.consumer("sr/again", "app", commit="manual") as consumer:
        wait_for(lambda: consumer.assignment == {0})
        events: list[Event] = []
        while len(events) < 50:
            events.extend(consumer.poll(0.05))
        consumer.commit()
        wait_for(lambda: consumer.assignment == {1, 2})
        while len(events) < 90:
            events.extend(consumer.poll(0.05))
        ends = {s: max(e.offset for e in events if e.segment == s) + 1 for s in (1, 2)}
        consumer.commit({0: 50, **ends})  # 0 is released, but unchanged: accepted
        with pytest.raises(slipstream.NotAssigned):
            consumer.commit({0: 49})
    rows = {s.segment: s.position for s in client.describe_subscription("sr/again", "app").segments}
    assert rows == {0: 50, **ends}
