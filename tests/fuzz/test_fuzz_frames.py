"""Fuzz the frame decoder over mutated real frame streams, as client and broker send them.

One invariant, whether the bytes arrive at once, one at a time, or in socket-sized reads into
the decoder's own buffers (as the broker receives them, payloads aligned for its journal): the
decoder yields frames, ``Oversized`` or ``Malformed`` items, or raises ``ProtocolError``, and
nothing else. Besides: every frame that lies wholly before the first damaged byte decodes as it
did undamaged, and every batch payload that decodes goes through a reader's checks (split,
CRC32C, Arrow body, schema, events) raising only ``CorruptBatch``. tests/protocol/test_frames.py
fuzzes random and frame-shaped bytes; these start from real sessions.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
from collections.abc import Callable, Iterable

import pytest
from fuzz_inputs import (
    Mutated,
    broker_stream,
    client_stream,
    large_stream,
    mutated,
    read_like_a_client,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import CorruptBatch, ProtocolError
from slipstream.protocol import (
    KIND_OF,
    Append,
    Data,
    Frame,
    FrameDecoder,
    Hello,
    Malformed,
    Oversized,
)

Item = tuple[object, ...]
Decoded = tuple[list[Item], bool]  # items, and whether ProtocolError ended the stream


def normalised(item: object) -> Item:
    if isinstance(item, Frame):
        return ("frame", item.correlation_id, item.message, bytes(item.payload))
    assert isinstance(item, Oversized | Malformed), f"the decoder produced {item!r}"
    return (type(item).__name__, *(getattr(item, f) for f in item.__struct_fields__))


def drain(decoder: FrameDecoder, items: list[Item], frames: list[Frame]) -> None:
    while (item := decoder.next_item()) is not None:
        items.append(normalised(item))
        if isinstance(item, Frame):
            frames.append(item)


def decode_fed(chunks: Iterable[bytes], max_frame_bytes: int, frames: list[Frame]) -> Decoded:
    decoder = FrameDecoder(max_frame_bytes)
    items: list[Item] = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            drain(decoder, items, frames)
    except ProtocolError:
        return items, True
    return items, False


def decode_received(
    data: bytes,
    read_size: int,
    max_frame_bytes: int,
    allocate: Callable[[int], bytearray | memoryview],
) -> Decoded:
    """Bytes as asyncio's BufferedProtocol hands them over: into ``get_buffer``, then
    ``buffer_updated``, with the broker's payload alignment."""
    decoder = FrameDecoder(max_frame_bytes, allocate, (4096, 16))
    items: list[Item] = []
    at = 0
    try:
        while at < len(data):
            target = decoder.get_buffer(-1)
            count = min(len(target), len(data) - at, read_size)
            target[:count] = data[at : at + count]
            decoder.buffer_updated(count)
            at += count
            drain(decoder, items, [])
    except ProtocolError:
        return items, True
    return items, False


def frame_ends(stream: bytes) -> list[int]:
    """Where each frame of an undamaged stream ends."""
    ends, at = [], 0
    while at < len(stream):
        at += 4 + int.from_bytes(stream[at : at + 4], "little")
        ends.append(at)
    return ends


def check_stream(
    original: bytes,
    damaged: Mutated,
    max_frame_bytes: int,
    read_size: int,
    cuts: list[int] | None = None,
) -> None:
    """``cuts``: where to split the stream into feeds (None: one byte at a time)."""
    frames: list[Frame] = []
    whole = decode_fed([damaged.data], max_frame_bytes, frames)
    if cuts is None:
        cuts = list(range(len(damaged.data)))
    bounds = [0, *sorted(c for c in cuts if c < len(damaged.data)), len(damaged.data)]
    pieces = [damaged.data[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode_fed(pieces, max_frame_bytes, []) == whole
    assert decode_received(damaged.data, read_size, max_frame_bytes, bytearray) == whole

    expected, _ = decode_fed([original], max_frame_bytes, [])
    intact = sum(end <= damaged.intact for end in frame_ends(original))
    assert whole[0][:intact] == expected[:intact], "a frame before the damage changed"

    for frame in frames:
        if isinstance(frame.message, Append | Data) and frame.payload:
            with contextlib.suppress(CorruptBatch):
                read_like_a_client(frame.payload)


LIMITS = st.sampled_from([256, 4096, 8 * 1024 * 1024])
READS = st.sampled_from([1, 7, 100, 65536])


@pytest.mark.parametrize("stream", [client_stream, broker_stream], ids=["client", "broker"])
@settings(max_examples=300, deadline=None)
@given(data=st.data(), max_frame_bytes=LIMITS, read_size=READS)
def test_mutated_sessions_decode_or_raise_protocol_error(
    stream: Callable[[], bytes], data: st.DataObject, max_frame_bytes: int, read_size: int
) -> None:
    original = stream()
    damaged = data.draw(mutated(original), label="damaged")
    check_stream(original, damaged, max_frame_bytes, read_size)


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    max_frame_bytes=st.sampled_from([4096, 8 * 1024 * 1024]),
    read_size=st.sampled_from([1000, 65536, 300_000]),
)
def test_mutated_large_frames_decode_or_raise_protocol_error(
    data: st.DataObject, max_frame_bytes: int, read_size: int
) -> None:
    # frames above 64 KiB take the decoder's other path (a buffer of their own); fed in
    # random pieces rather than byte by byte, to stay fast
    original = large_stream()
    damaged = data.draw(mutated(original), label="damaged")
    cuts = data.draw(
        st.lists(st.integers(0, len(damaged.data)), min_size=1, max_size=8), label="cuts"
    )
    check_stream(original, damaged, max_frame_bytes, read_size, cuts)


def test_the_undamaged_sessions_decode_whole_with_their_batches() -> None:
    # the fuzz above starts from streams that decode cleanly, batches and all
    for stream, count in [(client_stream(), 12), (broker_stream(), 12), (large_stream(), 4)]:
        frames: list[Frame] = []
        items, failed = decode_fed([stream], 8 * 1024 * 1024, frames)
        assert not failed and len(items) == len(frames) == count
        payloads = [f.payload for f in frames if f.payload]
        assert payloads and all(read_like_a_client(p) > 0 for p in payloads)


def test_invalid_utf8_in_meta_is_malformed() -> None:
    meta = b"\x92\x01\xa1\xc0"  # Hello [1, "\xc0"]: a str field that is not UTF-8
    decoder = FrameDecoder()
    decoder.feed(struct.pack("<IHHII", 12 + len(meta), KIND_OF[Hello], 0, 5, len(meta)) + meta)
    item = decoder.next_item()
    assert isinstance(item, Malformed) and item.correlation_id == 5
