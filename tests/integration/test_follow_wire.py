"""What a bounded Follow puts on the wire, checked frame by frame with the raw connection.

The Python reader trims events at or after its end offset itself, so a broker that sent too
much would pass every reader test; other clients would get extra data and a wrong
``FollowEnded.next_offset``. The rule (docs/protocol.md, "Follows"): a batch is atomic, so
every batch that starts before ``end_offset`` is sent whole, none that starts at or after it,
and ``next_offset`` is the ``next_offset`` of the last batch sent (the follow's start offset if
none was).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import BrokerProcess
from raw import RawConnection, batch

from slipstream.format import iter_batches
from slipstream.protocol import (
    Append,
    AppendAck,
    CreateStream,
    Credit,
    Data,
    Done,
    Follow,
    FollowEnded,
    Frame,
    StreamInfo,
    Welcome,
)

STREAM = "wire/follow"
BATCH_EVENTS = 3
STORED = 4  # batches appended before each follow: offsets [0, 3), [3, 6), [6, 9), [9, 12)
DURABLE_END = STORED * BATCH_EVENTS


class Wire:
    """A raw connection with a stream of ``STORED`` batches of ``BATCH_EVENTS`` events."""

    def __init__(self, address: str) -> None:
        self.raw = RawConnection(address)
        assert isinstance(self.raw.receive().message, Welcome)
        self.cid = 1
        assert isinstance(self.request(CreateStream(STREAM, 1, None, None)), StreamInfo)
        for _ in range(STORED):
            self.append()

    def request(self, message: object, payload: bytes = b"") -> object:
        self.cid += 1
        self.raw.send_frame(message, self.cid, payload)
        frame = self.raw.receive()
        assert frame.correlation_id == self.cid, frame
        return frame.message

    def append(self) -> int:
        ack = self.request(Append(STREAM, 0), batch(BATCH_EVENTS))
        assert isinstance(ack, AppendAck), ack
        return ack.base_offset

    def follow(
        self, sub_id: int, offset: int, end_offset: int, credit: int = 1 << 20
    ) -> tuple[list[list[tuple[int, int]]], int]:
        """Follow to the end: the (base offset, event count) of the batches of each Data
        frame, and FollowEnded's next_offset. With a small ``credit``, each payload's length
        is granted back after it arrives, as a reader does."""
        assert self.request(Follow(sub_id, STREAM, 0, offset, end_offset, credit)) == Done()
        frames: list[list[tuple[int, int]]] = []
        for frame in self.pushes():
            message = frame.message
            if isinstance(message, FollowEnded):
                assert message.sub_id == sub_id
                return frames, message.next_offset
            assert isinstance(message, Data) and message.sub_id == sub_id, message
            frames.append([(h.base_offset, h.event_count) for h, _ in iter_batches(frame.payload)])
            if credit < 1 << 20:
                self.raw.send_frame(Credit(sub_id, len(frame.payload)), 0)
        raise AssertionError("unreachable")

    def pushes(self) -> Iterator[Frame]:
        while True:
            frame = self.raw.receive()
            assert frame.correlation_id == 0, f"not a push: {frame}"
            yield frame


@pytest.fixture
def wire(broker: BrokerProcess) -> Iterator[Wire]:
    connection = Wire(broker.address)
    yield connection
    connection.raw.close()


def batches(*bases: int) -> list[tuple[int, int]]:
    return [(base, BATCH_EVENTS) for base in bases]


@pytest.mark.parametrize(
    ("offset", "end_offset", "sent", "next_offset"),
    [
        (0, 6, batches(0, 3), 6),  # an end at a batch boundary
        (0, 7, batches(0, 3, 6), 9),  # an end inside a batch: that batch goes whole
        (0, 1, batches(0), 3),  # inside the first batch
        (4, 9, batches(3, 6), 9),  # a start inside a batch sends it whole too
        (0, DURABLE_END, batches(0, 3, 6, 9), DURABLE_END),  # the durable end exactly
    ],
    ids=["boundary", "mid-batch", "mid-first-batch", "mid-batch-start", "durable-end"],
)
def test_a_bounded_follow_sends_exactly_the_batches_starting_before_its_end(
    wire: Wire, offset: int, end_offset: int, sent: list[tuple[int, int]], next_offset: int
) -> None:
    frames, ended_at = wire.follow(1, offset, end_offset)
    assert [b for frame in frames for b in frame] == sent
    assert ended_at == next_offset
    # the same, one batch per Data frame: credit of one byte, granted back as it is consumed
    frames, ended_at = wire.follow(2, offset, end_offset, credit=1)
    assert frames == [[b] for b in sent]
    assert ended_at == next_offset


@pytest.mark.parametrize("offset", [0, 5, DURABLE_END])
def test_a_follow_that_starts_at_its_end_sends_nothing(wire: Wire, offset: int) -> None:
    assert wire.follow(1, offset, offset) == ([], offset)


def test_an_end_beyond_the_tail_waits_for_the_batch_that_crosses_it(wire: Wire) -> None:
    end = DURABLE_END + 2  # inside the next batch, not yet appended
    assert wire.request(Follow(1, STREAM, 0, 0, end, 1 << 20)) == Done()
    pushes = wire.pushes()
    first = next(pushes)
    assert isinstance(first.message, Data)
    assert [(h.base_offset, h.event_count) for h, _ in iter_batches(first.payload)] == batches(
        0, 3, 6, 9
    )
    # the pump waits at the durable end; the next append crosses the end and ends the follow
    wire.cid += 1
    wire.raw.send_frame(Append(STREAM, 0), wire.cid, batch(BATCH_EVENTS))
    frames = [wire.raw.receive() for _ in range(3)]
    acks = [f for f in frames if f.correlation_id == wire.cid]
    assert [f.message for f in acks] == [AppendAck(DURABLE_END, BATCH_EVENTS)]
    data, ended = (f for f in frames if f.correlation_id == 0)
    assert isinstance(data.message, Data)
    assert [(h.base_offset, h.event_count) for h, _ in iter_batches(data.payload)] == batches(
        DURABLE_END
    )
    assert ended.message == FollowEnded(1, DURABLE_END + BATCH_EVENTS)
    # the follow is over: a later append is acknowledged and nothing more is pushed to it
    assert wire.append() == DURABLE_END + BATCH_EVENTS
