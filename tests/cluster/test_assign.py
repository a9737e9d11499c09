"""Assignment of containers to brokers (slipstream/cluster/_assign.py).

The contract under test: every container goes to one live member, counts differ by at most one,
a live holder keeps what it holds up to its share, only the containers that must move do (when
a member joins, leaves, or in general), the answer is a fixed point and does not depend on the
order of the inputs; ``coordinator`` is crc32 modulo the container count.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slipstream.cluster import assign, coordinator

BROKERS = [f"b{n}" for n in range(1, 8)]

containers_st = st.integers(min_value=0, max_value=40)
members_st = st.lists(st.sampled_from(BROKERS), max_size=6, unique=True)


@st.composite
def situations(draw: st.DrawFn) -> tuple[int, list[str], dict[int, str]]:
    """A container count, live members, and holders that may name dead brokers, leave some
    containers unheld and hold containers beyond the count."""
    containers = draw(containers_st)
    members = draw(members_st)
    holders = draw(
        st.dictionaries(
            st.integers(min_value=0, max_value=containers + 2),
            st.sampled_from([*BROKERS, "dead"]),
        )
    )
    return containers, members, holders


def fewest_moves(containers: int, members: list[str], holders: dict[int, str]) -> int:
    """The fewest containers held by a live member that any balanced assignment takes away
    from it: the ``extra`` larger shares go to the members holding the most."""
    if not members:
        return 0
    held = Counter(holders[c] for c in range(containers) if holders.get(c) in members)
    base, extra = divmod(containers, len(members))
    holdings = sorted((held[m] for m in members), reverse=True)
    keepable = sum(min(h, base + 1) for h in holdings[:extra])
    keepable += sum(min(h, base) for h in holdings[extra:])
    return sum(holdings) - keepable


def moved(before: dict[int, str], after: dict[int, str], live: list[str]) -> set[int]:
    """Containers whose live holder lost them."""
    return {c for c, owner in before.items() if owner in live and after.get(c) != owner}


@given(situations())
def test_every_container_goes_to_one_live_member_balanced(
    situation: tuple[int, list[str], dict[int, str]],
) -> None:
    containers, members, holders = situation
    result = assign(containers, members, holders)
    if not members:
        assert result == {}
        return
    assert sorted(result) == list(range(containers))
    assert set(result.values()) <= set(members)
    counts = Counter(result.values())
    loads = [counts[m] for m in members]
    assert max(loads) - min(loads) <= 1


@given(situations())
def test_sticky_fixed_point_and_fewest_moves(
    situation: tuple[int, list[str], dict[int, str]],
) -> None:
    containers, members, holders = situation
    result = assign(containers, members, holders)
    assert assign(containers, members, result) == result
    in_range = {c: h for c, h in holders.items() if c < containers}
    assert len(moved(in_range, result, members)) == fewest_moves(containers, members, holders)
    # A live holder at or under the smaller share keeps everything it holds.
    if members:
        floor_share = containers // len(members)
        held = Counter(in_range.values())
        for member in members:
            if held[member] <= floor_share:
                assert {c for c, h in in_range.items() if h == member} <= {
                    c for c, h in result.items() if h == member
                }


@given(situations(), st.randoms(use_true_random=False))
def test_deterministic_whatever_the_order(
    situation: tuple[int, list[str], dict[int, str]], rng: random.Random
) -> None:
    containers, members, holders = situation
    shuffled = list(members)
    rng.shuffle(shuffled)
    reordered = dict(reversed(list(holders.items())))
    assert assign(containers, shuffled, reordered) == assign(containers, members, holders)
    assert assign(containers, members + members, holders) == assign(containers, members, holders)


@given(containers_st, members_st.filter(bool), st.sampled_from(BROKERS))
def test_a_member_joining_takes_only_what_it_must(
    containers: int, members: list[str], newcomer: str
) -> None:
    if newcomer in members:
        return
    before = assign(containers, members, {})
    after = assign(containers, [*members, newcomer], before)
    taken = moved(before, after, members)
    assert all(after[c] == newcomer for c in taken)
    assert len(taken) == fewest_moves(containers, [*members, newcomer], before)
    assert len(taken) == Counter(after.values())[newcomer]


@given(containers_st, members_st.filter(bool), st.data())
def test_a_member_leaving_moves_only_its_containers(
    containers: int, members: list[str], data: st.DataObject
) -> None:
    leaver = data.draw(st.sampled_from(members))
    stayers = [m for m in members if m != leaver]
    before = assign(containers, members, {})
    after = assign(containers, stayers, before)
    assert moved(before, after, stayers) == set()
    if stayers:
        assert {c for c, owner in after.items() if owner != before[c]} == {
            c for c, owner in before.items() if owner == leaver
        }


def test_examples() -> None:
    assert assign(4, ["b1"], {}) == {0: "b1", 1: "b1", 2: "b1", 3: "b1"}
    # The second broker takes the lowest-numbered containers from the first.
    everything = {c: "b1" for c in range(4)}
    assert assign(4, ["b1", "b2"], everything) == {0: "b2", 1: "b2", 2: "b1", 3: "b1"}
    # A dead broker's containers go to the live ones; the extra container to the one holding most.
    assert assign(5, ["b3", "b1", "b2"], {0: "dead", 1: "b3", 2: "dead"}) == {
        0: "b1",
        1: "b3",
        2: "b1",
        3: "b2",
        4: "b3",
    }
    assert assign(4, [], everything) == {}
    assert assign(0, ["b1"], everything) == {}
    # More members than containers: some serve nothing.
    assert assign(2, ["b1", "b2", "b3"], {1: "b3"}) == {0: "b1", 1: "b3"}
    with pytest.raises(ValueError, match="containers"):
        assign(-1, ["b1"], {})


def test_coordinator_is_crc32_modulo_the_containers() -> None:
    assert coordinator("orders/billing", 4) == zlib.crc32(b"orders/billing") % 4
    assert coordinator("anything", 1) == 0
    assert {coordinator(f"s/g{n}", 4) for n in range(50)} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="containers"):
        coordinator("s/g", 0)
