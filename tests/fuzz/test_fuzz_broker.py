"""Fuzz a real broker with mutated real client sessions: it never crashes, never serves garbage.

Each example sends one damaged client session (handshake, stream creation, appends of real
batches, a follow, a transaction) on a fresh connection to one broker process, reads what
comes back until the broker falls quiet or hangs up, and closes. Then, over a clean
connection: the broker still answers, and every stream it holds reads back through the
client's checks (CRC32C, Arrow body, offsets in sequence) with only events that some real
batch carried; and the broker's log gains no traceback. A damaged byte that still passes
a batch's CRC can only sit in what the CRC leaves out (the base offset, which the broker
overwrites) or in the frame around it, so nothing else may ever be stored.
"""

from __future__ import annotations

import socket
import struct

import pytest
from conftest import BrokerProcess
from fuzz_inputs import client_stream, mutated, read_like_a_client, real_batches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw import RawConnection

import slipstream
from slipstream.format import iter_batches, read_body
from slipstream.protocol import KIND_OF, CreateStream, Error, Welcome


def sent_values() -> set[bytes | None]:
    values: set[bytes | None] = set()
    for batch in real_batches():
        for _, view in iter_batches(batch):
            values.update(read_body(view).column("value").to_pylist())
    return values


QUIET_SECONDS = 0.2  # no answer for this long: the broker is done with the session


def send_and_drain(address: str, data: bytes) -> None:
    """Send ``data`` on a new connection and read until the broker falls quiet or closes.
    (Closing at once would cancel the session's requests before they ran: less coverage.)"""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.settimeout(QUIET_SECONDS)
            while sock.recv(65536):
                pass
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            pass  # the broker closed first (a fatal protocol error): that is allowed


def check_everything_stored(client: slipstream.Client, values: set[bytes | None]) -> int:
    events = 0
    for info in client.list_streams():
        end = client.tail(info.name)
        for event in client.reader(info.name, "earliest", end):
            assert event.value in values, f"{info.name} serves an event no batch carried"
            events += 1
    return events


@pytest.fixture
def fuzzed(broker: BrokerProcess) -> BrokerProcess:
    """A broker with the session's stream (its own CreateStream runs as a task, so the
    appends pipelined right after it could come first)."""
    with broker.client() as client:
        client.create_stream("fuzz/orders", segments=1)
    return broker


def test_the_real_session_is_stored_whole(fuzzed: BrokerProcess) -> None:
    send_and_drain(fuzzed.address, client_stream())
    with fuzzed.client() as client:
        # the two plain appends are stored; the transaction's batch is not (it names a
        # producer and a transaction this session was never granted)
        assert check_everything_stored(client, sent_values()) == sum(
            read_like_a_client(real_batches()[i]) for i in (1, 3)
        )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_mutated_sessions_never_crash_the_broker_or_store_garbage(
    fuzzed: BrokerProcess, data: st.DataObject
) -> None:
    damaged = data.draw(mutated(client_stream()), label="damaged")
    logged = len(fuzzed.log())
    send_and_drain(fuzzed.address, damaged.data)
    assert fuzzed.proc is not None and fuzzed.proc.poll() is None, fuzzed.log()[-4000:]
    with fuzzed.client() as client:
        check_everything_stored(client, sent_values())
    new = fuzzed.log()[logged:]
    assert "Traceback (most recent call last)" not in new, new[-4000:]


def test_invalid_utf8_in_a_request_gets_a_protocol_error(fuzzed: BrokerProcess) -> None:
    raw = RawConnection(fuzzed.address)
    assert isinstance(raw.receive().message, Welcome)
    meta = b"\x94\xa2\xc0x\x01\xc0\xc0"  # CreateStream("\xc0x", 1, nil, nil): not UTF-8
    head = struct.pack("<IHHII", 12 + len(meta), KIND_OF[CreateStream], 0, 7, len(meta))
    raw.sock.sendall(head + meta)
    try:
        frame = raw.receive()
        assert frame.correlation_id == 7 and isinstance(frame.message, Error), frame.message
        assert frame.message.code == "protocol"
    finally:
        raw.close()
