"""Real inputs for the fuzz tests, and the mutations applied to them.

Random bytes rarely get past a decoder's first length check; mutated real inputs do (h11's
AFL harness and the published JetStream analyses found their bugs this way). The inputs are
built with the codecs under test: record batches as producers encode them (keys, headers,
compression, idempotent and transactional fields), frame streams as client and broker send
them. ``mutated`` damages a copy: byte flips, overwrites, insertions, deletions, a truncation,
and (where a decoder must cope with well-formed but repeated bytes) a duplicated slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from hypothesis import strategies as st

from slipstream.format import (
    FLAG_TRANSACTIONAL,
    BodyParts,
    binary_array,
    check_event_schema,
    encode_body,
    encode_body_parts,
    encode_header,
    events_of,
    headers_array,
    iter_batches,
    make_record_batch,
    read_body,
    timestamp_array,
)
from slipstream.protocol import (
    PROTOCOL_VERSION,
    Append,
    AppendAck,
    BeginTxn,
    CreateStream,
    Credit,
    Cut,
    Data,
    Done,
    EndTxn,
    Error,
    Follow,
    FollowEnded,
    FollowFailed,
    GetCut,
    Hello,
    InitProducer,
    TxnBegun,
    TxnEnded,
    TxnRange,
    Unfollow,
    Welcome,
    frame_bytes,
)


def _batch(
    count: int,
    *,
    keyed: bool,
    with_headers: bool,
    compression: str | None,
    producer: tuple[int, int, int] = (-1, -1, -1),
    flags: int = 0,
    base_offset: int = 0,
    value_bytes: int = 0,
    event_message: bool = True,
) -> bytes:
    """One batch; ``event_message``: the body form producers send today (one record batch
    message, all-null columns left out, compressed only where it pays), else a whole Arrow IPC
    stream, as earlier producers did and stored data may still hold."""
    keys = [f"key-{i % 3}".encode() if keyed else None for i in range(count)]
    values = [
        f"value {i} ".encode() * (1 + i % 4) + bytes([i % 251]) * value_bytes for i in range(count)
    ]
    stamps = [1_700_000_000_000 + i for i in range(count)]
    headers = (
        headers_array([{"trace": f"t{i}".encode()} if i % 2 else None for i in range(count)])
        if with_headers
        else None
    )
    record = make_record_batch(
        binary_array(keys), binary_array(values), timestamp_array(stamps), headers
    )
    body = (
        encode_body_parts(record, compression)
        if event_message
        else BodyParts([encode_body(record, compression)])
    )
    producer_id, producer_epoch, sequence = producer
    head = encode_header(
        body,
        event_count=count,
        min_timestamp=min(stamps),
        max_timestamp=max(stamps),
        base_offset=base_offset,
        flags=flags,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        sequence=sequence,
    )
    return head + b"".join(bytes(part) for part in body)


@cache
def real_batches() -> tuple[bytes, ...]:
    """Batches of the shapes producers send (built once: Arrow encoding is not free)."""
    return (
        _batch(1, keyed=False, with_headers=False, compression=None),
        _batch(5, keyed=True, with_headers=False, compression=None, base_offset=40),
        _batch(4, keyed=True, with_headers=True, compression=None, producer=(7, 2, 11)),
        _batch(6, keyed=True, with_headers=True, compression="lz4", value_bytes=64),
        _batch(3, keyed=False, with_headers=False, compression="zstd", base_offset=9),
        _batch(
            2,
            keyed=True,
            with_headers=False,
            compression=None,
            producer=(9, 0, 0),
            flags=FLAG_TRANSACTIONAL,
        ),
        # whole Arrow IPC streams, as 0.1.0 producers wrote them
        _batch(3, keyed=True, with_headers=True, compression=None, event_message=False),
        _batch(4, keyed=False, with_headers=False, compression="lz4", event_message=False),
    )


@cache
def large_batch() -> bytes:
    """A batch above the frame decoder's 64 KiB "large frame" size: it is assembled in a
    buffer of its own, the broker's at a chosen alignment."""
    return _batch(40, keyed=True, with_headers=True, compression=None, value_bytes=2048)


def _frames(*frames: tuple[object, int, list[bytes]]) -> bytes:
    return b"".join(
        bytes(part)
        for message, cid, payload in frames
        for part in frame_bytes(message, cid, payload)  # type: ignore[arg-type]
    )


@cache
def client_stream() -> bytes:
    """What a client sends in a short session: handshake, admin, appends, a follow, a txn."""
    b = real_batches()
    return _frames(
        (Hello(PROTOCOL_VERSION, "fuzz"), 1, []),
        # one segment: it owns every key (the batches' keys would not all fit a half)
        (CreateStream("fuzz/orders", 1, 86_400_000, None), 2, []),
        (Append("fuzz/orders", 0), 3, [b[1]]),
        (Append("fuzz/orders", 0), 4, [b[3]]),
        (GetCut("fuzz/orders", "earliest"), 5, []),
        (Follow(1, "fuzz/orders", 0, 0, None, 1 << 20), 6, []),
        (Credit(1, 4096), 0, []),
        (InitProducer("fuzz-txn"), 7, []),
        (BeginTxn(9, 0, 60_000, "fuzz"), 8, []),
        (Append("fuzz/orders", 0, 3), 9, [b[5]]),
        (EndTxn(3, True, b'{"batch": 1}'), 10, []),
        (Unfollow(1), 11, []),
    )


@cache
def broker_stream() -> bytes:
    """What a broker sends back: answers, pushes with batches, errors with details."""
    b = real_batches()
    return _frames(
        (Welcome(PROTOCOL_VERSION, "0.1.0", 8 << 20), 1, []),
        (Done(), 2, []),
        (AppendAck(40, 5), 3, []),
        (Cut("fuzz/orders", {0: 0, 1: 0}), 5, []),
        (Done(), 6, []),
        (Data(1), 0, [b[0], b[1], b[2]]),
        (Error("corrupt_batch", "batch CRC32C mismatch", {"segment": 0, "at": [1, 2]}), 4, []),
        (TxnBegun(3), 8, []),
        (Data(1), 0, [b[4]]),
        (TxnEnded(3, True, [TxnRange("fuzz/orders", 0, 45, 47)]), 10, []),
        (FollowFailed(2, "offset_out_of_range", "below start", {"oldest": 3}), 0, []),
        (FollowEnded(1, 47), 0, []),
    )


@cache
def large_stream() -> bytes:
    """A client sending a large batch between small frames, and a broker pushing it back."""
    return _frames(
        (Append("fuzz/big", 0), 3, [large_batch()]),
        (Credit(1, 4096), 0, []),
        (Data(1), 0, [real_batches()[1], large_batch()]),
        (FollowEnded(1, 45), 0, []),
    )


@dataclass(frozen=True)
class Mutated:
    """Damaged bytes; ``intact`` bytes at the front are the original's (no mutation reached
    them)."""

    data: bytes
    intact: int


MUTATIONS = ("flip", "overwrite", "insert", "delete", "truncate", "duplicate")


@st.composite
def mutated(
    draw: st.DrawFn, original: bytes, max_mutations: int = 4, kinds: tuple[str, ...] = MUTATIONS
) -> Mutated:
    out = bytearray(original)
    intact = len(out)
    for _ in range(draw(st.integers(1, max_mutations), label="mutations")):
        kind = draw(st.sampled_from(kinds))
        at = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "flip":
            if not out:
                continue
            out[at] ^= draw(st.integers(1, 255))
        elif kind == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=16))
            out[at : at + len(chunk)] = chunk
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif kind == "delete":
            del out[at : at + draw(st.integers(1, 64))]
        elif kind == "truncate":
            del out[at:]
        else:  # a slice of the (real) bytes repeated somewhere else
            piece = out[at : at + draw(st.integers(1, 512))]
            at = draw(st.integers(0, len(out)))
            out[at:at] = piece
        intact = min(intact, at)
    return Mutated(bytes(out), intact)


def read_like_a_client(payload: bytes | bytearray | memoryview) -> int:
    """What a reader does with a Data payload (split, CRC, Arrow body, schema, events);
    returns the number of events. Raises only CorruptBatch on damage."""
    events = 0
    for header, view in iter_batches(payload):
        record = read_body(view)
        check_event_schema(record)
        events += len(list(events_of(record, 0, header.base_offset)))
    return events
