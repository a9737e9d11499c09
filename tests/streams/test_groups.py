"""The assignment of segments to group members (slipstream/streams/_groups.py): balanced,
complete, deterministic, and sticky (a join or leave moves only what balance requires); and on
an elastic stream, ``assignable``: only segments whose predecessors are all committed to their
ends, so a group that reads and commits only those gets each key's events in append order."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.streams import SegmentGraph, SegmentProgress, assign, assignable, key_hash

SEGMENTS = st.lists(st.integers(0, 63), unique=True, max_size=40)
MEMBERS = st.lists(st.sampled_from([f"m{i}" for i in range(12)]), unique=True, max_size=10)


def test_segments_spread_evenly_in_order() -> None:
    assert assign(range(4), ["b", "a"], {}) == {0: "a", 1: "a", 2: "b", 3: "b"}
    assert assign(range(3), ["a"], {}) == {0: "a", 1: "a", 2: "a"}
    assert assign(range(3), [], {0: "a"}) == {}


def test_a_join_moves_only_what_it_must() -> None:
    before = assign(range(6), ["a", "b"], {})
    after = assign(range(6), ["a", "b", "c"], before)
    moved = {s for s in range(6) if after[s] != before[s]}
    assert len(moved) == 2 and all(after[s] == "c" for s in moved)


def test_a_leave_moves_only_the_leavers_segments() -> None:
    before = assign(range(6), ["a", "b", "c"], {})
    after = assign(range(6), ["a", "c"], before)
    assert {s for s in range(6) if after[s] != before[s]} == {
        s for s, m in before.items() if m == "b"
    }


@given(SEGMENTS, MEMBERS, st.dictionaries(st.integers(0, 63), st.sampled_from(["m1", "m3", "x"])))
def test_balanced_complete_and_deterministic(
    segments: list[int], members: list[str], current: dict[int, str]
) -> None:
    target = assign(segments, members, current)
    if not members:
        assert target == {}
        return
    assert set(target) == set(segments) and set(target.values()) <= set(members)
    counts = Counter(target.values())
    loads = [counts.get(m, 0) for m in members]
    assert max(loads) - min(loads) <= 1
    assert assign(reversed(segments), reversed(members), current) == target


@given(SEGMENTS, MEMBERS, st.lists(st.sampled_from(["n1", "n2", "n3"]), unique=True))
def test_on_a_join_only_segments_for_the_newcomers_move(
    segments: list[int], members: list[str], newcomers: list[str]
) -> None:
    before = assign(segments, members, {})
    after = assign(segments, members + newcomers, before)
    moved = [s for s in segments if after.get(s) != before.get(s)]
    if members:  # with no one before, everything is new
        assert all(after[s] in newcomers for s in moved)


# --- the read order on elastic streams -------------------------------------------------------


def test_a_successor_waits_for_every_predecessor_to_be_committed_to_its_end() -> None:
    # 0 split into 2, 3; then 3 and 1 merged into 4 (the example of docs/scaling.md)
    def progress(positions: dict[int, int]) -> dict[int, SegmentProgress]:
        shape = {0: ((), True, 10), 1: ((), True, 5), 2: ((0,), False, 7), 3: ((0,), True, 4)}
        shape[4] = ((1, 3), False, 3)
        return {
            n: SegmentProgress(preds, sealed, positions.get(n, 0), end)
            for n, (preds, sealed, end) in shape.items()
        }

    assert assignable(progress({})) == [0, 1]
    assert assignable(progress({0: 9})) == [0, 1]  # one event short of the end
    assert assignable(progress({0: 10})) == [1, 2, 3]  # 0 is complete: no longer assigned
    assert assignable(progress({0: 10, 3: 4})) == [1, 2]  # 4 still waits for 1
    assert assignable(progress({0: 10, 1: 5, 3: 4})) == [2, 4]
    # an open segment is never complete, even when read to its current end
    assert assignable(progress({0: 10, 1: 5, 2: 7, 3: 4, 4: 3})) == [2, 4]
    # an empty sealed segment is complete only once its own predecessors are
    empty = progress({1: 5})
    empty[3] = SegmentProgress((0,), True, 0, 0)
    assert assignable(empty) == [0]  # not 4: 3 is empty, but 0 is not read yet
    # a predecessor whose record is gone (its data deleted) does not hold its successors back
    gone = progress({0: 10})
    del gone[1]
    assert assignable(gone) == [2, 3]


def _scale(data: st.DataObject, graph: SegmentGraph, at: int) -> SegmentGraph:
    """The graph after a random split or merge of its open segments."""
    neighbours = [(a.number, b.number) for a, b in pairwise(graph.open_segments)]
    if neighbours and data.draw(st.booleans()):
        return graph.apply(graph.merge(list(data.draw(st.sampled_from(neighbours))), at))
    segment = data.draw(st.sampled_from([n.number for n in graph.open_segments]))
    return graph.apply(graph.split(segment, data.draw(st.integers(2, 3)), at))


@settings(max_examples=150)
@given(st.data())
def test_assignable_is_the_graphs_read_order(data: st.DataObject) -> None:
    graph = SegmentGraph.create(data.draw(st.integers(1, 3)))
    for at in range(data.draw(st.integers(0, 5))):
        graph = _scale(data, graph, at)
    progress = {}
    for node in graph.nodes:
        end = data.draw(st.integers(0, 5))
        progress[node.number] = SegmentProgress(
            node.predecessors, node.sealed, data.draw(st.integers(0, end)), end
        )
    complete: set[int] = set()  # sealed, at its end, and so are its predecessors
    for node in graph.nodes:
        one = progress[node.number]
        if one.sealed and one.position >= one.end and set(one.predecessors) <= complete:
            complete.add(node.number)
    assert assignable(progress) == list(graph.readable(complete))


@settings(max_examples=150)
@given(st.data())
def test_a_group_that_reads_only_assignable_segments_keeps_every_keys_order(
    data: st.DataObject,
) -> None:
    """Appends with random keys between scale events, then members reading and committing a
    few events at a time from any assignable segment, in any interleaving: every key's events
    arrive complete and in append order."""
    graph = SegmentGraph.create(data.draw(st.integers(1, 3)))
    logs: dict[int, list[tuple[str, int]]] = defaultdict(list)  # segment -> (key, seq)
    appended: dict[str, list[int]] = defaultdict(list)
    keys = [f"k{i}" for i in range(12)]
    for at in range(data.draw(st.integers(1, 5))):
        for key in data.draw(st.lists(st.sampled_from(keys), max_size=15)):
            appended[key].append(len(appended[key]))
            logs[graph.owner(key_hash(key.encode()))].append((key, appended[key][-1]))
        graph = _scale(data, graph, at)
    committed: dict[int, int] = {}
    delivered: dict[str, list[int]] = defaultdict(list)
    while True:
        progress = {
            node.number: SegmentProgress(
                node.predecessors,
                node.sealed,
                committed.get(node.number, 0),
                len(logs[node.number]),
            )
            for node in graph.nodes
        }
        ready = [n for n in assignable(progress) if committed.get(n, 0) < len(logs[n])]
        if not ready:
            break
        segment = data.draw(st.sampled_from(ready))
        start = committed.get(segment, 0)
        stop = start + data.draw(st.integers(1, 4))
        for key, seq in logs[segment][start:stop]:
            delivered[key].append(seq)
        committed[segment] = min(stop, len(logs[segment]))
    assert dict(delivered) == {k: v for k, v in appended.items() if v}
