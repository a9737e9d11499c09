"""Re-splitting a batch refused by a sealed segment (pure): every event exactly once, each key's
order kept, each event to the open segment that owns its key hash."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client._rerouting import KeyRanges, resplit
from slipstream.format import binary_array, make_record_batch, timestamp_array
from slipstream.streams import KEY_SPACE, Router, key_hash


@st.composite
def key_space_tilings(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Open segments as a scale leaves them: contiguous ranges with arbitrary cut points and
    arbitrary (unique, unordered) segment numbers."""
    cuts = sorted(
        draw(st.sets(st.integers(1, KEY_SPACE - 1), max_size=6))
        | draw(st.sets(st.sampled_from([KEY_SPACE // 2, KEY_SPACE // 4, 1, KEY_SPACE - 1])))
    )
    bounds = [0, *cuts, KEY_SPACE]
    numbers = draw(
        st.lists(
            st.integers(0, 500), min_size=len(bounds) - 1, max_size=len(bounds) - 1, unique=True
        )
    )
    return [(numbers[i], bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)]


def _record(keys: list[bytes | None]) -> pa.RecordBatch:
    values = [b"v%d" % i for i in range(len(keys))]  # the value names the row: order is visible
    return make_record_batch(
        binary_array(keys), binary_array(values), timestamp_array(np.arange(len(keys)))
    )


@settings(max_examples=300, deadline=None)
@given(
    tiling=key_space_tilings(),
    keys=st.lists(
        st.one_of(st.none(), st.binary(max_size=6), st.sampled_from([b"a", b"b", b"hot"])),
        min_size=1,
        max_size=80,
    ),
    keyless_pick=st.integers(0, 100),
)
def test_every_event_once_in_order_to_the_segment_owning_its_key(
    tiling: list[tuple[int, int, int]], keys: list[bytes | None], keyless_pick: int
) -> None:
    ranges = KeyRanges(tiling)
    router = Router(tiling)
    keyless = ranges.segments[keyless_pick % len(ranges.segments)]
    record = _record(keys)
    parts = resplit(record, ranges, keyless)

    seen: list[int] = []
    for segment, rows, part in parts:
        assert rows.tolist() == sorted(rows.tolist())  # each part keeps the rows' order
        assert part.num_rows == len(rows)
        assert part.column(1).to_pylist() == [b"v%d" % r for r in rows.tolist()]
        assert part.column(0).to_pylist() == [keys[r] for r in rows.tolist()]
        assert part.column(2).to_pylist() == record.column(2).take(pa.array(rows)).to_pylist()
        for r in rows.tolist():
            key = keys[r]
            assert segment == (keyless if key is None else router.segment_for(key))
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(len(keys)))  # every event exactly once
    assert len({segment for segment, _, _ in parts}) == len(parts)


def test_owner_at_range_edges() -> None:
    tiling = [(7, 0, KEY_SPACE // 2 - 1), (9, KEY_SPACE // 2, KEY_SPACE - 1)]
    ranges = KeyRanges(tiling)
    keys = [b"k%d" % i for i in range(2000)]
    owners = ranges.segments_of(binary_array(keys), keyless=7).tolist()
    expected = [7 if key_hash(k) < KEY_SPACE // 2 else 9 for k in keys]
    assert owners == expected and set(owners) == {7, 9}
