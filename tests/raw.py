"""A hand-driven protocol connection and batch builder, for tests that send exactly the frames
they mean (including what a well-behaved client never would)."""

from __future__ import annotations

import socket

from slipstream.format import (
    binary_array,
    encode_body,
    encode_header,
    make_record_batch,
    timestamp_array,
)
from slipstream.protocol import PROTOCOL_VERSION, Frame, FrameDecoder, Hello, frame_bytes


class RawConnection:
    """A hand-driven protocol connection, to send what a well-behaved client never would."""

    def __init__(
        self,
        address: str,
        version: int = PROTOCOL_VERSION,
        credentials: dict[str, str] | None = None,
    ) -> None:
        host, port = address.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.decoder = FrameDecoder()
        self.send_frame(Hello(version, "raw-test", credentials), 1)

    def send_frame(self, message: object, cid: int, payload: bytes = b"") -> None:
        self.sock.sendall(
            b"".join(bytes(b) for b in frame_bytes(message, cid, [payload] if payload else []))
        )  # type: ignore[arg-type]

    def receive(self) -> Frame:
        while True:
            item = self.decoder.next_item()
            if item is not None:
                assert isinstance(item, Frame)
                return item
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("broker closed the connection")
            self.decoder.feed(data)

    def close(self) -> None:
        self.sock.close()


def batch(
    count: int = 3,
    value: bytes = b"v",
    *,
    producer_id: int = -1,
    producer_epoch: int = -1,
    sequence: int = -1,
) -> bytes:
    """One encoded batch of ``count`` keyless events, optionally from an idempotent producer."""
    record = make_record_batch(
        binary_array([None] * count), binary_array([value] * count), timestamp_array([1] * count)
    )
    body = encode_body(record)
    head = encode_header(
        body,
        event_count=count,
        min_timestamp=1,
        max_timestamp=1,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        sequence=sequence,
    )
    return head + body.to_pybytes()
