"""Per-connection bounds: keepalive, idle timeouts, and limits on follows, requests awaiting an
answer and follow credit, each with its typed error, over the raw test connection.

The broker runs in this process (a thread with its own event loop, serving on loopback) so that
a test can give it small limits and look at its sockets; clients talk to it over TCP only.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from raw import RawConnection, batch

import slipstream
from slipstream.broker import Broker, BrokerConfig, ConnectionLimits, ContainerConfig
from slipstream.protocol import (
    Append,
    AppendAck,
    Credit,
    Data,
    Done,
    Error,
    Follow,
    FollowFailed,
    FrameDecoder,
    ListStreams,
    Message,
    StreamList,
    Unfollow,
    frame_bytes,
)

T = TypeVar("T")


class ThreadBroker:
    """A broker serving from a thread of this process, with the given connection limits."""

    def __init__(self, data_dir: Path, limits: ConnectionLimits) -> None:
        self.broker = Broker(
            BrokerConfig(
                data_dir=data_dir,
                port=0,
                containers=1,
                connection=limits,
                container=ContainerConfig(roll_ms=600_000),
            )
        )
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.failure: BaseException | None = None

        def run() -> None:
            try:
                self.loop.run_until_complete(self.broker.serve(lambda _: ready.set()))
            except BaseException as exc:  # reported by the test that waits for it
                self.failure = exc
                ready.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(20) and self.failure is None, self.failure
        assert self.broker.address is not None
        self.address = "{}:{}".format(*self.broker.address)

    def on_loop(self, call: Callable[[], T]) -> T:
        async def run() -> T:
            return call()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.broker.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ThreadBroker]]:
    started: list[ThreadBroker] = []

    def start(**limits: Any) -> ThreadBroker:
        broker = ThreadBroker(tmp_path / f"data{len(started)}", ConnectionLimits(**limits))
        started.append(broker)
        with slipstream.connect(broker.address) as client:
            client.create_stream("lim/s", segments=2)
        return broker

    yield start
    for broker in started:
        broker.stop()


def connect(broker: ThreadBroker) -> RawConnection:
    raw = RawConnection(broker.address)
    raw.receive()  # Welcome
    return raw


def ask(raw: RawConnection, message: Message, cid: int = 7, payload: bytes = b"") -> Message:
    raw.send_frame(message, cid, payload)
    frame = raw.receive()
    assert frame.correlation_id == cid, frame
    return frame.message


def closed_with(raw: RawConnection) -> Error:
    """The error frame the broker sent before it closed the connection (correlation id 0)."""
    frame = raw.receive()
    assert frame.correlation_id == 0 and isinstance(frame.message, Error), frame
    with pytest.raises(ConnectionError):
        raw.receive()
    return frame.message


def test_connections_have_tcp_keepalive(start: Callable[..., ThreadBroker]) -> None:
    broker = start(keepalive_idle=30, keepalive_interval=5, keepalive_count=4)
    raw = connect(broker)

    def options() -> list[tuple[int, ...]]:
        found = []
        for session in broker.broker.sessions:
            assert session.transport is not None
            sock = session.transport.get_extra_info("socket")
            found.append(
                (
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                )
            )
        return found

    assert broker.on_loop(options) == [(1, 30, 5, 4)]
    raw.close()


def test_a_connection_without_hello_is_closed(start: Callable[..., ThreadBroker]) -> None:
    broker = start(hello_timeout=0.2)
    host, port = broker.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        decoder = FrameDecoder()
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        decoder.feed(received)
        frame = decoder.next_item()
    assert frame is not None and isinstance(frame.message, Error)  # type: ignore[union-attr]
    assert frame.message.code == "idle_timeout" and "Hello" in frame.message.message  # type: ignore[union-attr]


def test_a_silent_connection_is_closed_unless_it_follows(
    start: Callable[..., ThreadBroker],
) -> None:
    # the Hello timeout is longer than the wait for the close: the idle rule must apply on its own
    broker = start(idle_timeout=0.3, hello_timeout=60)
    following, silent = connect(broker), connect(broker)
    assert isinstance(ask(following, Follow(1, "lim/s", 0, 0, None, 1 << 20)), Done)
    error = closed_with(silent)
    silent.close()
    assert error.code == "idle_timeout"
    # a tail reader waiting for data is not idle: it still gets an answer afterwards
    assert isinstance(ask(following, ListStreams()), StreamList)
    following.close()


def test_follows_per_connection_are_limited(start: Callable[..., ThreadBroker]) -> None:
    broker = start(max_follows=3)
    raw = connect(broker)
    for sub_id in range(3):
        assert isinstance(ask(raw, Follow(sub_id, "lim/s", 0, 0, None, 1000)), Done)
    error = ask(raw, Follow(3, "lim/s", 1, 0, None, 1000))
    assert isinstance(error, Error) and error.code == "too_many_follows"
    assert error.details == {"limit": 3}
    assert isinstance(ask(raw, Unfollow(0)), Done)
    assert isinstance(ask(raw, Follow(3, "lim/s", 1, 0, None, 1000)), Done)
    with pytest.raises(slipstream.TooManyFollows):
        raise slipstream.errors.error_from_wire(error.code, error.message, error.details)
    raw.close()


def test_follow_credit_is_limited(start: Callable[..., ThreadBroker]) -> None:
    broker = start(max_follow_credit=100_000)
    raw = connect(broker)
    error = ask(raw, Follow(1, "lim/s", 0, 0, None, 100_001))
    assert isinstance(error, Error) and error.code == "credit_limit_exceeded"
    assert isinstance(ask(raw, Follow(1, "lim/s", 0, 0, None, 100_000)), Done)
    raw.send_frame(Credit(1, 1), 0)  # past the limit: the follow fails (Credit has no answer)
    frame = raw.receive()
    assert isinstance(frame.message, FollowFailed) and frame.message.sub_id == 1
    assert frame.message.code == "credit_limit_exceeded"
    # the connection lives on, and the follow is gone: its id may be used again
    assert isinstance(ask(raw, Follow(1, "lim/s", 0, 0, None, 50_000)), Done)
    raw.close()


def test_requests_awaiting_an_answer_are_limited(start: Callable[..., ThreadBroker]) -> None:
    broker = start(max_requests=2)
    raw = connect(broker)
    payload = batch(1)
    count = 40
    # sent at once: the broker reads them faster than it can make them durable
    raw.sock.sendall(
        b"".join(
            bytes(part)
            for cid in range(1, count + 1)
            for part in frame_bytes(Append("lim/s", 0), cid, [payload])
        )
    )
    answers = {}
    while len(answers) < count:
        frame = raw.receive()
        answers[frame.correlation_id] = frame.message
    acked = [m for m in answers.values() if isinstance(m, AppendAck)]
    refused = [m for m in answers.values() if isinstance(m, Error)]
    assert len(acked) + len(refused) == count
    assert acked and refused
    assert {e.code for e in refused} == {"too_many_requests"}
    assert all(e.details == {"limit": 2} for e in refused)
    # nothing refused was stored: the segment holds exactly the acknowledged events
    with slipstream.connect(broker.address) as client:
        assert client.describe_stream("lim/s").segments[0].end_offset == len(acked)
    raw.close()


def test_a_client_that_stops_reading_is_dropped(start: Callable[..., ThreadBroker]) -> None:
    broker = start(write_timeout=0.5)
    with slipstream.connect(broker.address) as client, client.producer("lim/s") as producer:
        for _ in range(40):
            producer.send(os.urandom(1_000_000), key="k")  # incompressible
    with slipstream.connect(broker.address) as client:
        info = client.describe_stream("lim/s")
        segment = max(info.segments, key=lambda s: s.end_offset).number
    raw = connect(broker)  # follows 40 MB and reads none of it
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # no window autotuning
    assert isinstance(ask(raw, Follow(1, "lim/s", segment, 0, None, 64 << 20)), Done)

    def sessions() -> int:
        return broker.on_loop(lambda: len(broker.broker.sessions))

    deadline = time.monotonic() + 30
    while sessions() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions() == 0  # the broker let go of the connection and what it had buffered
    with pytest.raises(ConnectionError):
        while True:
            frame = raw.receive()
            assert isinstance(frame.message, Data)
    raw.close()
