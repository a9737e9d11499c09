"""The text form of a cut's positions (``segment:offset,...``, slipstream/streams/_cuts.py)
that the console's and the admin API's page links carry: it round-trips, blanks are ignored,
and anything else (also a negative number) raises InvalidArgument."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import InvalidArgument
from slipstream.streams import format_positions, parse_positions


@settings(max_examples=100)
@given(positions=st.dictionaries(st.integers(0, 2**20), st.integers(0, 2**63 - 1), max_size=8))
def test_positions_round_trip_as_text(positions: dict[int, int]) -> None:
    assert parse_positions(format_positions(positions)) == positions


def test_text_form() -> None:
    assert format_positions({1: 40, 0: 12}) == "0:12,1:40"
    assert parse_positions(" 0:12, 1:40,") == {0: 12, 1: 40}
    assert parse_positions("") == {}


@pytest.mark.parametrize("text", ["0", "0:1:2", "a:1", "0:x", "-1:0", "0:-5", "0;1"])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_positions(text)
