"""Key ranges and the segment graph (slipstream/streams/_graph.py).

The contract under test: ``split_range`` covers a range exactly with near-equal successors;
``merge_ranges`` joins neighbours only; a SegmentGraph's epochs each tile the key space, scale
events seal open segments only and open successors that cover exactly what they sealed, a
history replays (also from JSON) to the same graph, and a reader that takes only
``readable`` segments gets every key's events in append order, complete, across any
interleaving of appends, splits, merges, restarts and reads (the state machine at the end).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from slipstream import InvalidArgument, SegmentNotFound
from slipstream.streams import (
    FULL_KEY_RANGE,
    MAX_KEY_HASH,
    KeyRange,
    ScaleEvent,
    SegmentGraph,
    key_hash,
    merge_ranges,
    split_key_space,
    split_range,
)

# --- key ranges -----------------------------------------------------------------------------

key_ranges = st.tuples(st.integers(0, MAX_KEY_HASH), st.integers(0, MAX_KEY_HASH)).map(
    lambda bounds: KeyRange(min(bounds), max(bounds))
)


@settings(max_examples=200)
@given(key_range=key_ranges, parts=st.integers(2, 64))
def test_split_range_covers_the_range_exactly_and_evenly(key_range: KeyRange, parts: int) -> None:
    if parts > key_range.width:
        with pytest.raises(InvalidArgument, match="at most"):
            split_range(key_range, parts)
        return
    pieces = split_range(key_range, parts)
    assert len(pieces) == parts
    assert pieces[0].lo == key_range.lo and pieces[-1].hi == key_range.hi
    assert all(a.precedes(b) for a, b in pairwise(pieces))
    widths = [p.width for p in pieces]
    assert sum(widths) == key_range.width and max(widths) - min(widths) <= 1
    assert merge_ranges(pieces[::-1]) == key_range


def test_split_range_of_the_key_space_matches_the_router() -> None:
    assert [(r.lo, r.hi) for r in split_range(FULL_KEY_RANGE, 7)] == split_key_space(7)


def test_split_range_rejects_fewer_than_two() -> None:
    with pytest.raises(InvalidArgument, match="at least 2"):
        split_range(FULL_KEY_RANGE, 1)
    with pytest.raises(InvalidArgument, match="at most 1"):
        split_range(KeyRange(5, 5), 2)


def test_merge_ranges_joins_neighbours_only() -> None:
    assert merge_ranges([KeyRange(10, 19), KeyRange(0, 9)]) == KeyRange(0, 19)
    with pytest.raises(InvalidArgument, match="not neighbours"):
        merge_ranges([KeyRange(0, 9), KeyRange(11, 19)])  # a gap
    with pytest.raises(InvalidArgument, match="not neighbours"):
        merge_ranges([KeyRange(0, 10), KeyRange(10, 19)])  # an overlap
    with pytest.raises(InvalidArgument, match="at least 2"):
        merge_ranges([KeyRange(0, 9)])


@pytest.mark.parametrize(("lo", "hi"), [(5, 4), (-1, 3), (0, MAX_KEY_HASH + 1)])
def test_bad_key_ranges_raise_invalid_argument(lo: int, hi: int) -> None:
    with pytest.raises(InvalidArgument, match="bad key range"):
        KeyRange(lo, hi)


def test_key_range_membership_and_text() -> None:
    r = KeyRange(16, 31)
    assert 16 in r and 31 in r and 15 not in r and 32 not in r
    assert str(r) == "0000000000000010-000000000000001f"


# --- the graph ------------------------------------------------------------------------------


def split_then_merge() -> SegmentGraph:
    """0,1 (epoch 0) -> 0 splits into 2,3 (epoch 1) -> 3 and 1 merge into 4 (epoch 2)."""
    graph = SegmentGraph.create(2)
    graph = graph.apply(graph.split(0, 2, at_ms=1000))
    return graph.apply(graph.merge([3, 1], at_ms=2000))


def test_a_split_and_a_merge() -> None:
    graph = split_then_merge()
    assert graph.epoch == 2
    assert [n.number for n in graph.open_segments] == [2, 4]
    assert graph.predecessors(2) == (0,) and graph.predecessors(4) == (1, 3)
    assert graph.successors(0) == (2, 3) and graph.successors(1) == (4,)
    assert graph.successors(4) == ()
    assert graph.node(3).opened_epoch == 1 and graph.node(3).sealed_epoch == 2
    assert graph.node(4).opened_ms == 2000
    assert graph.ancestors([4]) == {0, 1, 3}
    assert [[n.number for n in graph.segments_at(e)] for e in range(3)] == [
        [0, 1],
        [2, 3, 1],
        [2, 4],
    ]


def test_a_successor_is_readable_only_after_all_its_predecessors() -> None:
    graph = split_then_merge()
    assert graph.readable(set()) == (0, 1)
    assert graph.readable({0}) == (1, 2, 3)
    assert graph.readable({0, 3}) == (1, 2)  # 4 still waits for 1
    assert graph.readable({0, 1}) == (2, 3)  # ... and for 3
    assert graph.readable({0, 1, 3}) == (2, 4)
    with pytest.raises(InvalidArgument, match="open"):
        graph.readable({2})


def test_owner_by_epoch() -> None:
    graph = split_then_merge()
    high = 2**63 + 5  # in 1, then 1 (3 only splits 0's half), then 4
    low = 5
    assert [graph.owner(high, e) for e in range(3)] == [1, 1, 4]
    assert [graph.owner(low, e) for e in range(3)] == [0, 2, 2]
    assert graph.owner(high) == 4
    with pytest.raises(InvalidArgument, match="epochs 0 to 2"):
        graph.owner(low, 3)
    with pytest.raises(InvalidArgument, match="outside"):
        graph.owner(-1)


def test_scaling_a_sealed_or_unknown_segment_raises() -> None:
    graph = split_then_merge()
    with pytest.raises(InvalidArgument, match=r"segment 0 is sealed .* successors are \[2, 3\]"):
        graph.split(0, 2, at_ms=3000)
    with pytest.raises(InvalidArgument, match="sealed"):
        graph.merge([3, 2], at_ms=3000)
    with pytest.raises(SegmentNotFound):
        graph.split(9, 2, at_ms=3000)
    with pytest.raises(InvalidArgument, match="not neighbours"):
        SegmentGraph.create(3).merge([0, 2], at_ms=1)


def test_an_event_must_cover_exactly_what_it_seals() -> None:
    graph = SegmentGraph.create(2)
    half, other = graph.node(0).key_range, graph.node(1).key_range
    with pytest.raises(InvalidArgument, match="cover exactly"):
        graph.plan([0], [KeyRange(half.lo, half.hi - 10), KeyRange(half.hi - 9, half.hi - 1)], 1)
    with pytest.raises(InvalidArgument, match="cover exactly"):
        graph.plan([0], [*split_range(half, 2), other], 1)
    with pytest.raises(InvalidArgument, match="changes nothing"):
        graph.plan([0], [half], 1)
    with pytest.raises(InvalidArgument, match="twice"):
        graph.plan([0, 0], split_range(half, 2), 1)
    # sealing two non-neighbours and opening successors of each is one valid event
    graph = SegmentGraph.create(3)
    a, c = graph.node(0).key_range, graph.node(2).key_range
    event = graph.plan([2, 0], [*split_range(c, 2), *split_range(a, 3)], 1)
    assert [(n.number, n.predecessors) for n in event.created] == [
        (3, (0,)),
        (4, (0,)),
        (5, (0,)),
        (6, (2,)),
        (7, (2,)),
    ]


def test_apply_refuses_an_event_that_does_not_follow() -> None:
    graph = SegmentGraph.create(2)
    event = graph.split(0, 2, at_ms=5)
    with pytest.raises(InvalidArgument, match="does not follow"):
        graph.apply(msgspec.structs.replace(event, epoch=2))
    renumbered = tuple(msgspec.structs.replace(n, number=n.number + 1) for n in event.created)
    with pytest.raises(InvalidArgument, match="does not follow"):
        graph.apply(msgspec.structs.replace(event, created=renumbered))
    graph = graph.apply(event)
    with pytest.raises(InvalidArgument, match="sealed"):
        graph.apply(event)  # applied twice


def test_history_replays_from_json_to_the_same_graph() -> None:
    graph = split_then_merge()
    stored = msgspec.json.encode(graph.events)
    replayed = SegmentGraph.from_history(
        [KeyRange(lo, hi) for lo, hi in split_key_space(2)],
        msgspec.json.decode(stored, type=list[ScaleEvent]),
    )
    assert replayed.nodes == graph.nodes and replayed.epoch == graph.epoch


def test_initial_ranges_must_tile_the_key_space() -> None:
    with pytest.raises(InvalidArgument, match="cover"):
        SegmentGraph.from_initial([KeyRange(0, 10)])
    with pytest.raises(InvalidArgument, match="1 to 1024"):
        SegmentGraph.create(0)


# --- reading through the graph keeps every key's order --------------------------------------

KEYS = [key_hash(f"key-{i}".encode()) for i in range(12)]


class ReadThroughScaling(RuleBasedStateMachine):
    """Appends with random keys go to the owner of their hash in the current epoch; open
    segments split and merge at random; a broker restart rebuilds the graph from its history
    in JSON; a reader reads any segment the graph says is readable, a few events at a time,
    and marks a sealed segment finished when it reached its end. Each key's events as read
    are always a prefix of the key's events as appended; at the end, all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = SegmentGraph.create(1)
        self.initial = [FULL_KEY_RANGE]
        self.stored: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        self.appended: dict[int, list[int]] = defaultdict(list)
        self.read: dict[int, list[int]] = defaultdict(list)
        self.position: dict[int, int] = defaultdict(int)
        self.finished: set[int] = set()
        self.sequence = 0

    @initialize(count=st.integers(1, 4))
    def create(self, count: int) -> None:
        self.graph = SegmentGraph.create(count)
        self.initial = [n.key_range for n in self.graph.open_segments]

    @rule(key=st.sampled_from(KEYS), times=st.integers(1, 3))
    def append(self, key: int, times: int) -> None:
        for _ in range(times):
            segment = self.graph.owner(key)
            self.stored[segment].append((key, self.sequence, self.graph.epoch))
            self.appended[key].append(self.sequence)
            self.sequence += 1

    @rule(data=st.data(), parts=st.integers(2, 4))
    def split(self, data: st.DataObject, parts: int) -> None:
        node = data.draw(st.sampled_from(self.graph.open_segments))
        self.graph = self.graph.apply(self.graph.split(node.number, parts, self.sequence))

    @precondition(lambda self: len(self.graph.open_segments) >= 2)
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        alive = self.graph.open_segments
        i = data.draw(st.integers(0, len(alive) - 2))
        pair = [alive[i].number, alive[i + 1].number]
        self.graph = self.graph.apply(self.graph.merge(pair, self.sequence))

    @rule()
    def restart(self) -> None:
        stored = msgspec.json.encode(self.graph.events)
        events = msgspec.json.decode(stored, type=list[ScaleEvent])
        self.graph = SegmentGraph.from_history(self.initial, events)

    @rule(data=st.data(), count=st.integers(1, 4))
    def read_some(self, data: st.DataObject, count: int) -> None:
        readable = self.graph.readable(self.finished)
        if readable:
            self.read_segment(data.draw(st.sampled_from(readable)), count)

    def read_segment(self, segment: int, count: int) -> None:
        start = self.position[segment]
        for key, sequence, _ in self.stored[segment][start : start + count]:
            self.read[key].append(sequence)
        self.position[segment] = min(start + count, len(self.stored[segment]))
        if self.graph.node(segment).sealed and self.position[segment] == len(self.stored[segment]):
            self.finished.add(segment)

    @invariant()
    def every_epoch_tiles_the_key_space(self) -> None:
        alive = self.graph.segments_at(self.graph.epoch)
        assert alive[0].key_range.lo == 0 and alive[-1].key_range.hi == MAX_KEY_HASH
        assert all(a.key_range.precedes(b.key_range) for a, b in pairwise(alive))
        assert alive == self.graph.open_segments and not any(n.sealed for n in alive)

    @invariant()
    def every_key_is_read_in_append_order(self) -> None:
        for key, sequences in self.read.items():
            assert sequences == self.appended[key][: len(sequences)], f"key {key:x}"

    def teardown(self) -> None:
        # drain: whatever order readable() allows, every event arrives, in order per key
        while True:
            pending = [
                s
                for s in self.graph.readable(self.finished)
                if self.position[s] < len(self.stored[s])
                or (self.graph.node(s).sealed and s not in self.finished)
            ]
            if not pending:
                break
            self.read_segment(pending[-1], 1_000_000)
        assert dict(self.read) == {k: v for k, v in self.appended.items() if v}
        # and the graph says where each event went in its epoch
        for segment, events in self.stored.items():
            for key, _, epoch in events:
                assert self.graph.owner(key, epoch) == segment


TestReadThroughScaling = ReadThroughScaling.TestCase
TestReadThroughScaling.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
