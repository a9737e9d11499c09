"""Pure planning: options, offsets, admission control and partitions (no Spark, no broker)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slipstream import InvalidArgument, InvalidName, StreamCut
from slipstream.spark._plan import (
    cut_to_offset,
    limit_cut,
    offset_to_cut,
    source_options,
    split_ranges,
)

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
