"""StreamCut's JSON form (slipstream/streams/_cuts.py) and the retention units
(slipstream/streams/_units.py).

The contract under test: ``StreamCut.to_json`` / ``from_json`` round-trip, and ``from_json``
raises :class:`InvalidArgument` for anything that is not the documented shape; durations
(``90s``, ``1h30m``) and sizes (``10GiB``) parse to positive integers, and every other input
raises InvalidArgument.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import InvalidArgument
from slipstream.streams import (
    Position,
    StreamCut,
    parse_duration_ms,
    parse_size_bytes,
    relative_time_ms,
)

# --- StreamCut ----------------------------------------------------------------------------------

cuts = st.builds(
    StreamCut,
    stream=st.text(max_size=30),
    positions=st.dictionaries(st.integers(0, 2**20), st.integers(0, 2**63 - 1), max_size=8),
)


@settings(max_examples=100)
@given(cut=cuts)
def test_stream_cut_json_round_trips(cut: StreamCut) -> None:
    assert StreamCut.from_json(cut.to_json()) == cut
    assert StreamCut.from_json(cut.to_json().encode()) == cut


def test_stream_cut_json_is_the_documented_shape() -> None:
    cut = StreamCut("demo/orders", {0: 12, 1: 40})
    assert cut.to_json() == '{"stream":"demo/orders","positions":{"0":12,"1":40}}'
    assert StreamCut.from_json('{"stream": "demo/orders", "positions": {"0": 12, "1": 40}}') == cut


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        "null",
        '"demo/orders"',
        "{}",
        '{"stream": "demo/orders"}',
        '{"positions": {"0": 1}}',
        '{"stream": "demo/orders", "positions": [1, 2]}',
        '{"stream": "demo/orders", "positions": null}',
        '{"stream": "demo/orders", "positions": {"zero": 1}}',
        '{"stream": "demo/orders", "positions": {"0": "twelve"}}',
        '{"stream": "demo/orders", "positions": {"0": null}}',
        '{"stream": "demo/orders", "positions": {"0": {}}}',
        '{"stream": "demo/orders", "positions": {"0": 1e400}}',
        '{"stream": "demo/orders", "positions": {"0": -1}}',
        '{"stream": 7, "positions": {"0": 1}}',
        '{"stream": null, "positions": {}}',
        b'{"stream": "\xff", "positions": {}}',
    ],
)
def test_stream_cut_from_bad_json_raises_invalid_argument(text: str | bytes) -> None:
    with pytest.raises(InvalidArgument):
        StreamCut.from_json(text)


@pytest.mark.parametrize("offset", ["1.9", "true"])
def test_stream_cut_from_json_refuses_non_integer_offsets(offset: str) -> None:
    text = '{"stream": "demo/orders", "positions": {"0": ' + offset + "}}"
    try:
        StreamCut.from_json(text)
    except InvalidArgument:
        return
    raise AssertionError(f"offset {offset} was accepted")


def test_position_and_stream_cut_are_frozen_values() -> None:
    position = Position(segment=1, offset=2)
    with pytest.raises(AttributeError):
        position.offset = 3  # type: ignore[misc]
    assert position == Position(1, 2)
    with pytest.raises(AttributeError):
        StreamCut("a/b", {}).stream = "c/d"  # type: ignore[misc]


# --- durations ----------------------------------------------------------------------------------

SECOND = 1000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
DAY = 24 * HOUR


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("250ms", 250),
        ("90s", 90 * SECOND),
        ("15m", 15 * MINUTE),
        ("12h", 12 * HOUR),
        ("7d", 7 * DAY),
        ("2w", 14 * DAY),
        ("1h30m", HOUR + 30 * MINUTE),
        ("1d12h30m15s500ms", DAY + 12 * HOUR + 30 * MINUTE + 15 * SECOND + 500),
        (" 1h 30m ", HOUR + 30 * MINUTE),
        ("0h1s", SECOND),
        ("0001s", SECOND),
    ],
)
def test_parse_duration_ms(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "0s",
        "0h0m",
        "10",
        "s",
        "h1",
        "1.5h",
        "-1s",
        "+1s",
        "1x",
        "1hh",
        "1H",
        "1M",
        "1 day",
        "1h-30m",
        "1h,30m",
        "1s\t1s",
        "7d!",
    ],
)
def test_parse_duration_ms_refuses_bad_input(text: str) -> None:
    with pytest.raises(InvalidArgument, match="bad duration"):
        parse_duration_ms(text)


UNITS_MS = {"ms": 1, "s": SECOND, "m": MINUTE, "h": HOUR, "d": DAY, "w": 7 * DAY}


@settings(max_examples=100)
@given(
    terms=st.lists(
        st.tuples(st.integers(0, 10_000), st.sampled_from(sorted(UNITS_MS))), min_size=1, max_size=5
    )
)
def test_parse_duration_ms_sums_its_terms(terms: list[tuple[int, str]]) -> None:
    text = "".join(f"{count}{unit}" for count, unit in terms)
    total = sum(count * UNITS_MS[unit] for count, unit in terms)
    if total > 0:
        assert parse_duration_ms(text) == total
    else:
        with pytest.raises(InvalidArgument):
            parse_duration_ms(text)


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("1B", 1),
        ("1KB", 1000),
        ("500MB", 500 * 10**6),
        ("2GB", 2 * 10**9),
        ("1TB", 10**12),
        ("1KiB", 1024),
        ("512MiB", 512 * 2**20),
        ("10GiB", 10 * 2**30),
        ("1TiB", 2**40),
        ("10 GiB", 10 * 2**30),
        ("10gib", 10 * 2**30),
        (" 5mb ", 5 * 10**6),
    ],
)
def test_parse_size_bytes(text: str, size: int) -> None:
    assert parse_size_bytes(text) == size


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "0",
        "0GiB",
        "-1",
        "+1",
        "1.5GiB",
        "GiB",
        "10 XB",
        "1PiB",
        "1e3",
        "1 G",
        "1GiBs",
        "1,024",
    ],
)
def test_parse_size_bytes_refuses_bad_input(text: str) -> None:
    with pytest.raises(InvalidArgument, match="bad size"):
        parse_size_bytes(text)


# --- relative times -----------------------------------------------------------------------------

NOW = 1_800_000_000_000


@pytest.mark.parametrize(
    ("text", "ago"),
    [
        ("-30s", 30 * SECOND),
        ("-15m", 15 * MINUTE),
        ("-1h", HOUR),
        ("-2d", 2 * DAY),
        ("-1w", 7 * DAY),
        ("-1h30m", HOUR + 30 * MINUTE),
        ("-500ms", 500),
        (" -1h ", HOUR),
    ],
)
def test_relative_time_is_that_long_before_now(text: str, ago: int) -> None:
    assert relative_time_ms(text, NOW) == NOW - ago


@pytest.mark.parametrize(
    "text", ["earliest", "latest", "2026-11-21T08:00:00Z", "1h", "", '{"stream": "a/b"}']
)
def test_text_without_a_leading_minus_is_not_relative(text: str) -> None:
    assert relative_time_ms(text, NOW) is None


@pytest.mark.parametrize("text", ["-", "-1", "-1x", "--1h", "-1.5h", "-0s", "-h", "-1 day"])
def test_a_minus_without_a_duration_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="bad relative time"):
        relative_time_ms(text, NOW)


def test_a_relative_time_before_the_epoch_is_the_epoch() -> None:
    assert relative_time_ms("-1d", HOUR) == 0


@settings(max_examples=100)
@given(
    terms=st.lists(
        st.tuples(st.integers(1, 1000), st.sampled_from(sorted(UNITS_MS))), min_size=1, max_size=4
    ),
    now=st.integers(0, 2**62),
)
def test_relative_time_subtracts_the_duration(terms: list[tuple[int, str]], now: int) -> None:
    text = "-" + "".join(f"{count}{unit}" for count, unit in terms)
    ago = sum(count * UNITS_MS[unit] for count, unit in terms)
    assert relative_time_ms(text, now) == max(0, now - ago)
