"""Pure parts of the client: broker addresses and reader start positions."""

from __future__ import annotations

import datetime as dt

import pytest

import slipstream
from slipstream.client import parse_address
from slipstream.client._reader import parse_start


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7070", ("127.0.0.1", 7070)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:9000", ("::1", 9000)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["7070", "host:", ":7070", "host:port", "host:0", "host:70000"])
def test_bad_addresses_say_what_they_should_look_like(text: str) -> None:
    with pytest.raises(slipstream.InvalidArgument, match=r"127\.0\.0\.1:7070"):
        parse_address(text)


def test_start_positions() -> None:
    assert parse_start("earliest") == ("earliest", None, None)
    assert parse_start("latest") == ("latest", None, None)
    assert parse_start(1_700_000_000_000) == ("time", 1_700_000_000_000, None)
    when = dt.datetime(2026, 11, 21, tzinfo=dt.UTC)
    assert parse_start(when) == ("time", int(when.timestamp() * 1000), None)
    assert parse_start("2026-11-21T00:00Z") == ("time", int(when.timestamp() * 1000), None)
    cut = slipstream.StreamCut("a/b", {0: 3})
    assert parse_start(cut) == ("cut", None, cut)
    assert parse_start(cut.to_json()) == ("cut", None, cut)


@pytest.mark.parametrize(
    "start", ["yesterday", dt.datetime(2026, 1, 1), True, 1.5, '{"stream": 1}']
)
def test_bad_start_positions(start: object) -> None:
    with pytest.raises(slipstream.InvalidArgument):
        parse_start(start)  # type: ignore[arg-type]
