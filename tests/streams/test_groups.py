"""The assignment of segments to group members (slipstream/streams/_groups.py): balanced,
complete, deterministic, and sticky (a join or leave moves only what balance requires)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from slipstream.streams import assign

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
