"""Bad input gets a typed error for that client; the broker keeps serving everyone else."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import msgspec
import pytest
from conftest import BrokerProcess
from raw import RawConnection, batch

import slipstream
from slipstream.protocol import (
    Append,
    Error,
    Frame,
    Welcome,
)


def _error(frame: Frame) -> Error:
    assert isinstance(frame.message, Error), frame.message
    return frame.message


@pytest.fixture
def raw(broker: BrokerProcess, client: slipstream.Client) -> Iterator[RawConnection]:
    client.create_stream("bad/input", segments=1)
    connection = RawConnection(broker.address)
    assert isinstance(connection.receive().message, Welcome)
    yield connection
    connection.close()


def test_unknown_protocol_version_gets_a_typed_error(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    connection = RawConnection(broker.address, version=99)
    error = _error(connection.receive())
    connection.close()
    assert error.code == "unsupported_version"
    assert "protocol 99" in error.message
    assert client.list_streams() == []  # everyone else is still served


def test_malformed_frames_get_errors_and_the_connection_survives(
    raw: RawConnection, client: slipstream.Client
) -> None:
    # unknown message kind
    raw.sock.sendall(struct.pack("<IHHII", 12, 999, 0, 5, 0))
    assert _error(raw.receive()).code == "protocol"
    # meta that is not msgpack of the right shape
    meta = msgspec.msgpack.encode(["only-one-field"])
    raw.sock.sendall(struct.pack("<IHHII", 12 + len(meta), 6, 0, 6, len(meta)) + meta)
    error = _error(raw.receive())
    assert error.code == "protocol" and "Append" in error.message
    # a batch with a broken CRC
    broken = bytearray(batch())
    broken[-1] ^= 0xFF
    raw.send_frame(Append("bad/input", 0), 7, bytes(broken))
    frame = raw.receive()
    assert frame.correlation_id == 7 and _error(frame).code == "corrupt_batch"
    # and the same connection still appends a good batch
    raw.send_frame(Append("bad/input", 0), 8, batch())
    assert raw.receive().correlation_id == 8
    assert client.describe_stream("bad/input").segments[0].end_offset == 3


def test_frame_length_below_minimum_closes_only_that_connection(
    raw: RawConnection, client: slipstream.Client
) -> None:
    raw.sock.sendall(struct.pack("<I", 3) + b"abc")
    assert _error(raw.receive()).code == "protocol"
    with pytest.raises(ConnectionError):
        raw.receive()
    assert [s.name for s in client.list_streams()] == ["bad/input"]


def test_oversized_batch_is_refused_and_nothing_is_stored(
    raw: RawConnection, client: slipstream.Client
) -> None:
    big = batch(count=2, value=b"x" * (5 * 1024 * 1024))
    raw.send_frame(Append("bad/input", 0), 9, big)
    error = _error(raw.receive())
    assert error.code == "batch_too_large" and "8388608" in error.message
    raw.send_frame(Append("bad/input", 0), 10, batch())
    assert raw.receive().correlation_id == 10
    assert client.describe_stream("bad/input").segments[0].end_offset == 3


def test_a_batch_just_over_the_limit_is_refused_though_its_frame_fits(
    raw: RawConnection, client: slipstream.Client
) -> None:
    """Frames may be up to 64 KiB larger than a batch (room for the request's fields), so a
    batch a few KiB over the limit reaches the broker's own batch check, not the frame's."""
    limit = 8 * 1024 * 1024
    over = batch(count=1, value=b"x" * (limit + 8 * 1024))
    assert limit < len(over) < limit + 64 * 1024
    raw.send_frame(Append("bad/input", 0), 11, over)
    error = _error(raw.receive())
    assert error.code == "batch_too_large" and str(limit) in error.message, error
    raw.send_frame(Append("bad/input", 0), 12, batch())
    assert raw.receive().correlation_id == 12
    assert client.describe_stream("bad/input").segments[0].end_offset == 3


def test_client_refuses_an_event_larger_than_a_batch(client: slipstream.Client) -> None:
    client.create_stream("bad/big", segments=1)
    with client.producer("bad/big") as producer, pytest.raises(slipstream.BatchTooLarge):
        producer.send(b"x" * (2 * 1024 * 1024))


def test_unknown_and_deleted_streams(client: slipstream.Client) -> None:
    with pytest.raises(slipstream.StreamNotFound, match="slipstream stream create"):
        client.describe_stream("no/such")
    with pytest.raises(slipstream.StreamNotFound):
        client.producer("no/such")
    client.create_stream("bad/gone", segments=2)
    producer = client.producer("bad/gone")
    client.delete_stream("bad/gone")
    with pytest.raises(slipstream.StreamNotFound):
        producer.send(b"late").result(10)
    with pytest.raises(slipstream.StreamNotFound):
        client.delete_stream("bad/gone")


def test_stream_deleted_under_a_follower(client: slipstream.Client, broker: BrokerProcess) -> None:
    client.create_stream("bad/followed", segments=1)
    with client.producer("bad/followed") as producer:
        producer.send(b"first")
    reader = iter(client.reader("bad/followed", start="earliest"))
    assert next(reader).value == b"first"
    with broker.client() as other:
        other.delete_stream("bad/followed")
    with pytest.raises(slipstream.StreamNotFound):
        next(reader)


@pytest.mark.parametrize(
    "name",
    ["noscope", "Upper/case", "a/b/c", "sp ace/x", "a/" + "x" * 254, "/x", "x/", "../x", "a/.."],
)
def test_bad_stream_names(client: slipstream.Client, name: str) -> None:
    with pytest.raises(slipstream.InvalidName):
        client.create_stream(name)


def test_bad_arguments(client: slipstream.Client) -> None:
    with pytest.raises(slipstream.InvalidArgument, match="segments"):
        client.create_stream("bad/segments", segments=0)
    with pytest.raises(slipstream.InvalidArgument, match="duration"):
        client.create_stream("bad/retention", retention_time="seven days")
    client.create_stream("bad/dup")
    with pytest.raises(slipstream.StreamExists):
        client.create_stream("bad/dup")
    with pytest.raises(slipstream.InvalidArgument, match="ISO-8601"):
        client.reader("bad/dup", start="yesterday")


def test_reading_past_the_end_is_an_error(client: slipstream.Client) -> None:
    client.create_stream("bad/cut", segments=1)
    cut = slipstream.StreamCut("bad/cut", {0: 50})
    with pytest.raises(slipstream.OffsetOutOfRange, match="past its end"):
        list(client.reader("bad/cut", start=cut, end=slipstream.StreamCut("bad/cut", {0: 60})))


def test_no_broker_gives_a_clear_error() -> None:
    with pytest.raises(slipstream.BrokerUnavailable, match="slipstream up"):
        slipstream.connect("127.0.0.1:1", timeout=2)
