"""Pure planning: options, offsets, admission control and partitions (no Spark, no broker)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import InvalidArgument, InvalidName, StreamCut
from slipstream.spark._plan import (
    SegmentSpan,
    cut_to_offset,
    limit_cut,
    offset_to_cut,
    plan_end,
    resolve_end,
    resolve_start,
    source_options,
    split_ranges,
)
from slipstream.streams import SegmentGraph

segments = st.dictionaries(st.integers(0, 7), st.integers(0, 10_000), min_size=1, max_size=8)


@st.composite
def start_and_tail(draw: st.DrawFn) -> tuple[dict[int, int], dict[int, int]]:
    start = draw(segments)
    tail = {s: o + draw(st.integers(0, 5_000)) for s, o in start.items()}
    return start, tail


@given(start_and_tail(), st.none() | st.integers(1, 20_000))
def test_limit_cut_admits_the_budget_in_proportion_to_the_backlog(
    positions: tuple[dict[int, int], dict[int, int]], max_events: int | None
) -> None:
    start, tail = positions
    end = limit_cut(start, tail, max_events)
    taken = {s: end[s] - start[s] for s in start}
    available = {s: tail[s] - start[s] for s in start}
    assert all(0 <= taken[s] <= available[s] for s in start)
    total = sum(taken.values())
    if max_events is None or sum(available.values()) <= max_events:
        assert end == tail
        return
    assert total == max_events  # the budget is used up, never exceeded
    # proportional: each segment's share is within one event of budget * its part of the backlog
    backlog = sum(available.values())
    for s in start:
        assert abs(taken[s] - max_events * available[s] / backlog) < 1


def test_limit_cut_always_advances_and_uses_bytes() -> None:
    assert limit_cut({0: 5}, {0: 10}, None, max_bytes=1, bytes_per_event={0: 100.0}) == {0: 6}
    end = limit_cut({0: 0, 1: 0}, {0: 100, 1: 100}, None, 1000, {0: 100.0, 1: 100.0})
    assert end == {0: 5, 1: 5}
    # both limits: the tighter wins
    assert limit_cut({0: 0}, {0: 100}, 3, 1000, {0: 100.0}) == {0: 3}


@given(segments, st.integers(0, 50_000), st.integers(1, 7_000))
def test_split_ranges_cover_each_offset_once(
    start: dict[int, int], extra: int, per_partition: int
) -> None:
    end = {s: o + extra for s, o in start.items()}
    ranges = split_ranges(start, end, per_partition)
    for segment in start:
        mine = [(lo, hi) for s, lo, hi in ranges if s == segment]
        assert all(0 < hi - lo <= per_partition for lo, hi in mine)
        covered = [o for lo, hi in mine for o in range(lo, hi)] if extra < 2000 else None
        if covered is not None:
            assert covered == list(range(start[segment], end[segment]))
        assert sum(hi - lo for lo, hi in mine) == extra


def test_offsets_round_trip_and_reject_garbage() -> None:
    cut = StreamCut("demo/orders", {1: 40, 0: 12})
    offset = cut_to_offset(cut)
    assert offset == {"stream": "demo/orders", "positions": {"0": 12, "1": 40}}
    assert offset_to_cut(offset) == cut
    for bad in ({}, {"stream": "a/b"}, {"stream": "a/b", "positions": {"x": 1}}):
        with pytest.raises(InvalidArgument, match="not a slipstream offset"):
            offset_to_cut(bad)


def test_source_options_defaults_and_errors() -> None:
    options = source_options({"stream": "demo/orders"})
    assert options.broker == "127.0.0.1:7070"
    assert options.starting_position == "latest"
    assert (options.start, options.end) == ("earliest", "latest")
    assert options.max_events_per_trigger is None
    assert options.mode == "PERMISSIVE"
    assert options.subscription is None
    parsed = source_options(
        {
            "stream": "demo/orders",
            "maxeventspertrigger": "10",
            "broker": "127.0.0.1:1",
            "subscription": "orders-job",
        }
    )
    assert parsed.max_events_per_trigger == 10
    assert parsed.subscription == "orders-job"
    with pytest.raises(InvalidName, match="subscription name"):
        source_options({"stream": "a/b", "subscription": "Orders Job"})
    with pytest.raises(InvalidArgument, match='"stream" is required'):
        source_options({})
    with pytest.raises(InvalidName, match="scope/name"):
        source_options({"stream": "No Such Name"})
    with pytest.raises(InvalidArgument, match="maxEventsPerTrigger must be a positive integer"):
        source_options({"stream": "a/b", "maxeventspertrigger": "-3"})
    with pytest.raises(InvalidArgument, match="maxBytesPerTrigger"):
        source_options({"stream": "a/b", "maxbytespertrigger": "lots"})
    with pytest.raises(InvalidArgument, match="mode must be one of"):
        source_options({"stream": "a/b", "mode": "lenient"})
    with pytest.raises(InvalidArgument):
        source_options({"stream": "a/b", "broker": "nowhere"})


def test_broker_option_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_BROKER", "127.0.0.1:7999")
    assert source_options({"stream": "a/b"}).broker == "127.0.0.1:7999"


# --- scaled streams: batches planned from the segment graph ---------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(st.integers(0, 7), min_size=8, max_size=40)),
        st.tuples(st.just("split"), st.integers(0, 100)),
        st.tuples(st.just("merge"), st.integers(0, 100)),
        st.tuples(st.just("batch"), st.none() | st.integers(1, 25)),
    ),
    min_size=3,
    max_size=40,
)


def _key_hash(key: int) -> int:
    return (key * 0x9E3779B97F4A7C15 + 12345) % 2**64


@settings(max_examples=300)
@given(st.integers(1, 3), operations)
def test_batches_keep_every_key_in_order_across_splits_and_merges(
    initial: int, ops: list[tuple[str, Any]]
) -> None:
    """Appends, splits, merges and micro-batches (each with a random maxEventsPerTrigger) in
    any interleaving: every event is read once, and per key ordering the events by (batch,
    segment, offset) gives append order. A final unlimited batch reads everything."""
    graph = SegmentGraph.create(initial)
    stored: dict[int, list[tuple[int, int]]] = {n.number: [] for n in graph.nodes}
    appended: dict[int, list[int]] = {}
    read: dict[int, list[tuple[int, int, int, int]]] = {}  # key -> (batch, segment, offset, seq)
    seq = 0
    cut: dict[int, int] = {0: 0}  # an old cut: names only segment 0
    batches = 0

    def spans() -> dict[int, SegmentSpan]:
        return {
            n.number: SegmentSpan(0, len(stored[n.number]) if n.sealed else None, n.predecessors)
            for n in graph.nodes
        }

    def run_batch(budget: int | None) -> bool:
        nonlocal cut, batches
        described = spans()
        start = resolve_start(cut, described)
        tail = {n: len(events) for n, events in stored.items()}
        end = plan_end(start, tail, described, budget)
        if budget is not None:
            assert sum(end.values()) - sum(start.values()) <= budget
        for segment in end:
            for offset in range(start[segment], end[segment]):
                key, number = stored[segment][offset]
                read.setdefault(key, []).append((batches, segment, offset, number))
        batches += 1
        moved = end != start
        cut = end
        return moved

    for op, arg in ops:
        if op == "append":
            for key in arg:
                owner = graph.owner(_key_hash(key))
                stored[owner].append((key, seq))
                appended.setdefault(key, []).append(seq)
                seq += 1
        elif op == "split":
            open_segments = graph.open_segments
            graph = graph.apply(graph.split(open_segments[arg % len(open_segments)].number, 2, 0))
        elif op == "merge" and len(graph.open_segments) > 1:
            open_segments = graph.open_segments
            i = arg % (len(open_segments) - 1)
            pair = [open_segments[i].number, open_segments[i + 1].number]
            graph = graph.apply(graph.merge(pair, 0))
        elif op == "batch":
            run_batch(arg)
        for node in graph.nodes:
            stored.setdefault(node.number, [])
    while run_batch(None):
        pass
    for key, events in read.items():
        in_order = [number for *_, number in sorted(events)]
        assert in_order == appended[key], f"key {key}: {sorted(events)}"
    assert {k: len(v) for k, v in read.items()} == {k: len(v) for k, v in appended.items()}


def test_a_successor_waits_for_its_predecessors_ends_within_the_batch() -> None:
    # 0 split into 2, 3; 1 and 3 merged into 4 (docs/scaling.md's example), all sealed but 2, 4
    spans = {
        0: SegmentSpan(0, 10),
        1: SegmentSpan(0, 10),
        2: SegmentSpan(0, None, (0,)),
        3: SegmentSpan(0, 5, (0,)),
        4: SegmentSpan(0, None, (1, 3)),
    }
    tail = {0: 10, 1: 10, 2: 7, 3: 5, 4: 9}
    start = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0}
    assert plan_end(start, tail, spans, None) == tail  # no limit: all, through the graph
    # 15 events: 0 and 1 share them and end nowhere: no successor reads anything
    assert plan_end(start, tail, spans, 15) == {0: 8, 1: 7, 2: 0, 3: 0, 4: 0}
    # 22: 0 and 1 end; 2 is readable and 3 too, sharing the last 2; 4 waits for 3's end
    assert plan_end(start, tail, spans, 22) == {0: 10, 1: 10, 2: 1, 3: 1, 4: 0}
    assert plan_end(start, tail, spans, 32) == {0: 10, 1: 10, 2: 7, 3: 5, 4: 0}
    assert plan_end(start, tail, spans, 33) == {0: 10, 1: 10, 2: 7, 3: 5, 4: 1}
    # a sealed segment at its end contributes nothing; an old cut naming only 4 finished 0..3
    assert resolve_start({4: 2}, spans) == {0: 10, 1: 10, 2: 0, 3: 5, 4: 2}
    # Trigger.AvailableNow's target from before 3 was sealed: 4 never starts
    assert plan_end(start, {0: 10, 1: 10, 2: 7, 3: 4}, spans, None)[4] == 0
    # an empty sealed segment does not let its successor overtake its own predecessor
    chain = {0: SegmentSpan(0, 8), 1: SegmentSpan(0, 0, (0,)), 2: SegmentSpan(0, None, (1,))}
    assert plan_end({0: 0, 1: 0, 2: 0}, {0: 8, 1: 0, 2: 9}, chain, 1) == {0: 1, 1: 0, 2: 0}
    assert plan_end({0: 0, 1: 0, 2: 0}, {0: 8, 1: 0, 2: 9}, chain, 9) == {0: 8, 1: 0, 2: 1}


def test_bounded_reads_resolve_cuts_that_name_some_segments() -> None:
    spans = {0: SegmentSpan(2, 10), 1: SegmentSpan(0, 4, (0,)), 2: SegmentSpan(0, None, (0,))}
    start = resolve_start({0: 5}, spans)  # a cut from before the split
    assert start == {0: 5, 1: 0, 2: 0}
    assert resolve_end(start, {0: 8}, spans) == {0: 8, 1: 0, 2: 0}  # successors: after the cut
    assert resolve_end(start, {1: 3, 2: 6}, spans) == {0: 10, 1: 3, 2: 6}  # 0 precedes them
    assert resolve_start({}, spans) == {0: 2, 1: 0, 2: 0}  # at the first retained offsets
