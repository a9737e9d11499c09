"""Pure parts of the client: broker addresses, reader start positions, decoding deliveries."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast

import pytest

import slipstream
from slipstream.client import parse_address
from slipstream.client._reader import Delivery, ReaderCore, decode_delivery, parse_start
from slipstream.format import (
    binary_array,
    encode_body,
    encode_header,
    make_record_batch,
    set_base_offset,
    timestamp_array,
)


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


def _batch(base: int, count: int) -> bytearray:
    values = [f"v{base + i}".encode() for i in range(count)]
    body = encode_body(
        make_record_batch(
            binary_array([None] * count), binary_array(values), timestamp_array([1] * count)
        )
    )
    batch = bytearray(encode_header(body, event_count=count, min_timestamp=1, max_timestamp=1))
    batch += body.to_pybytes()
    set_base_offset(batch, base)
    return batch


def _decode(core: ReaderCore, *batches: bytearray) -> list[tuple[int, list[Any]]]:
    payload = bytearray(b"".join(batches))
    return [
        (base, record.column(1).to_pylist())
        for _, base, record in decode_delivery(Delivery(0, payload), core)
    ]


def test_deliveries_are_trimmed_to_the_start_and_must_continue_the_segment() -> None:
    start = slipstream.StreamCut("a/b", {0: 3})
    core = ReaderCore(cast(Any, None), "a/b", start, None, lambda delivery: None)  # no network
    core.starts, core.ends = {0: 3}, {0: 9}
    # the broker sends the whole batch holding offset 3; the reader drops offsets before it
    assert _decode(core, _batch(0, 5), _batch(5, 2)) == [(3, [b"v3", b"v4"]), (5, [b"v5", b"v6"])]
    assert core.positions == {0: 7}
    with pytest.raises(slipstream.CorruptData) as raised:  # offsets 7 and 8 are missing
        _decode(core, _batch(9, 1))
    assert raised.value.details == {"segment": 0, "offset": 7}
    assert "corrupt data in segment 0 of 'a/b' at offset 7" in raised.value.message
    flipped = _batch(7, 3)
    flipped[-20] ^= 0x01
    with pytest.raises(slipstream.CorruptData, match="CRC32C") as raised:
        _decode(core, flipped)
    assert raised.value.details == {"segment": 0, "offset": 7}
    assert _decode(core, _batch(7, 3)) == [(7, [b"v7", b"v8"])]  # trimmed to the end, 9
