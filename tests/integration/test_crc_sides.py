"""Each side's CRC32C check alone: the broker refuses a corrupt batch, the reader a corrupt Data.

End to end, the two checks hide each other: a broker that skipped ``verify`` would store a
damaged batch and the reader would still refuse it, and a reader that skipped its check would
never see damage the broker had refused. So each side is tested without the other: the broker
with the raw connection (no client check in the way), the reader against a fake broker built
from the sans-IO codec that serves whatever bytes a test gives it.

The damage is a flipped byte inside an event's value: the Arrow body still decodes, so only
the CRC32C can tell.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from conftest import BrokerProcess
from raw import RawConnection, batch

import slipstream
from slipstream import CorruptData, StreamCut
from slipstream.format import iter_batches, read_body, verify
from slipstream.protocol import (
    PROTOCOL_VERSION,
    Append,
    AppendAck,
    CreateStream,
    Cut,
    Data,
    DescribeStream,
    Done,
    Error,
    Follow,
    FollowEnded,
    Frame,
    FrameDecoder,
    GetCut,
    Hello,
    Message,
    SegmentInfo,
    StreamInfo,
    Unfollow,
    Welcome,
    frame_bytes,
)

VALUE = b"a value that is checked end to end"


def damaged(data: bytes) -> bytes:
    """``data`` with one byte of its first event's value flipped (the CRC left as it was)."""
    out = bytearray(data)
    at = out.index(VALUE) + 5
    out[at] ^= 0x20
    return bytes(out)


def test_the_damage_is_seen_only_by_the_crc() -> None:
    good = batch(3, VALUE)
    bad = damaged(good)
    verify(good)
    with pytest.raises(slipstream.CorruptBatch):
        verify(bad)
    # structurally still a batch whose events decode: nothing but the CRC refuses it
    ((header, view),) = iter_batches(bad, check_crc=False)
    assert header.event_count == 3 and len(view) == len(good)
    assert read_body(view).num_rows == 3


# --- the broker alone --------------------------------------------------------------------------


def test_the_broker_refuses_a_batch_that_fails_its_crc_and_stores_nothing(
    broker: BrokerProcess,
) -> None:
    raw = RawConnection(broker.address)
    assert isinstance(raw.receive().message, Welcome)
    raw.send_frame(CreateStream("crc/broker", 1, None, None), 2)
    assert isinstance(raw.receive().message, StreamInfo)
    raw.send_frame(Append("crc/broker", 0), 3, damaged(batch(3, VALUE)))
    frame = raw.receive()
    assert frame.correlation_id == 3 and isinstance(frame.message, Error), frame.message
    assert frame.message.code == "corrupt_batch"
    # nothing stored and no offset taken: the next good batch is at offset 0 ...
    raw.send_frame(Append("crc/broker", 0), 4, batch(2, b"good"))
    assert raw.receive().message == AppendAck(0, 2)
    # ... and it is all a follow gets, read straight off the wire (no client check involved)
    raw.send_frame(Follow(1, "crc/broker", 0, 0, 2, 1 << 20), 5)
    assert raw.receive().message == Done()
    data = raw.receive()
    assert data.message == Data(1)
    served = list(iter_batches(data.payload))  # checks each served batch's CRC too
    assert [(h.base_offset, h.event_count) for h, _ in served] == [(0, 2)]
    assert raw.receive().message == FollowEnded(1, 2)
    raw.close()


# --- the reader alone ------------------------------------------------------------------------


class FakeBroker:
    """Speaks just enough of the protocol to one client to serve one segment: every Follow
    gets ``served`` (raw bytes, unchecked) in one Data frame, then FollowEnded at its end."""

    def __init__(self, stream: str, served: bytes, next_offset: int) -> None:
        self.stream = stream
        self.served = served
        self.next_offset = next_offset
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: list[Message] = []
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="fake-broker")
        self.thread.start()

    def _serve(self) -> None:
        try:
            connection, _ = self.listener.accept()
            with connection:
                decoder = FrameDecoder()
                while data := connection.recv(65536):
                    decoder.feed(data)
                    while (item := decoder.next_item()) is not None:
                        assert isinstance(item, Frame), item
                        self.requests.append(item.message)
                        for reply, cid, payload in self._answer(item.message, item.correlation_id):
                            connection.sendall(
                                b"".join(bytes(b) for b in frame_bytes(reply, cid, payload))
                            )
        except BaseException as exc:  # reported by close(), not lost on the thread
            self.failure = exc

    def _answer(self, message: Message, cid: int) -> Iterator[tuple[Message, int, list[bytes]]]:
        match message:
            case Hello():
                yield Welcome(PROTOCOL_VERSION, "fake", 8 * 1024 * 1024), cid, []
            case GetCut(stream, "earliest"):
                yield Cut(stream, {0: 0}), cid, []
            case DescribeStream(stream):  # the reader's segment graph: one open segment
                segment = SegmentInfo(0, 0, 0, 2**64 - 1, False, 0, self.next_offset, 0, None, None)
                yield StreamInfo(stream, [segment], None, None, 0), cid, []
            case Follow(sub_id, stream, 0, 0, end_offset) if stream == self.stream:
                yield Done(), cid, []
                yield Data(sub_id), 0, [self.served]
                if end_offset is not None:
                    yield FollowEnded(sub_id, self.next_offset), 0, []
            case Unfollow():
                yield Done(), cid, []
            case _:
                yield Error("protocol", f"the fake broker does not serve {message}"), cid, []

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)
        assert not self.thread.is_alive()
        if self.failure is not None:
            raise self.failure


def read_all_sync(address: str, stream: str) -> list[bytes]:
    with slipstream.connect(address, reconnect_timeout=0) as client:
        end = StreamCut(stream, {0: 3})
        return [event.value for event in client.reader(stream, "earliest", end)]


def read_all_async(address: str, stream: str) -> list[bytes]:
    async def read() -> list[bytes]:
        client = await slipstream.connect_async(address, reconnect_timeout=0)
        try:
            end = StreamCut(stream, {0: 3})
            return [event.value async for event in client.reader(stream, "earliest", end)]
        finally:
            await client.close()

    return asyncio.run(read())


ReadAll = Callable[[str, str], list[bytes]]


@pytest.fixture(params=[read_all_sync, read_all_async], ids=["sync", "async"])
def read_all(request: pytest.FixtureRequest) -> ReadAll:
    return request.param  # type: ignore[no-any-return]


def test_the_reader_takes_an_intact_batch_from_the_fake_broker(read_all: ReadAll) -> None:
    fake = FakeBroker("crc/reader", batch(3, VALUE), 3)
    try:
        assert read_all(fake.address, "crc/reader") == [VALUE] * 3
    finally:
        fake.close()


def test_the_reader_refuses_a_served_batch_that_fails_its_crc(read_all: ReadAll) -> None:
    fake = FakeBroker("crc/reader", damaged(batch(3, VALUE)), 3)
    try:
        with pytest.raises(CorruptData) as raised:
            read_all(fake.address, "crc/reader")
        assert raised.value.details == {"segment": 0, "offset": 0}
        assert any(isinstance(m, Follow) for m in fake.requests)  # it was served, then refused
    finally:
        fake.close()
