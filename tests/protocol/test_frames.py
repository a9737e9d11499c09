"""The sans-IO frame codec (slipstream/protocol/_frames.py) and the message kinds it carries.

The contract under test: a frame is laid out as the comment block of _frames.py and
docs/protocol.md say; every message kind round-trips with its correlation id and payload; the
decoder yields the same items however the bytes are split across ``feed`` calls; a frame above
the limit becomes ``Oversized`` (with its correlation id) and is skipped, a frame with a bad kind
or meta becomes ``Malformed``, and both leave the stream usable; only a frame length below 12
raises :class:`ProtocolError`. On arbitrary bytes the decoder yields items or raises
ProtocolError, never anything else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import ProtocolError
from slipstream.client._connection import _pooled
from slipstream.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    KIND_OF,
    KINDS,
    PREFIX_LENGTH,
    PROTOCOL_VERSION,
    AccessDecision,
    AccessRule,
    Append,
    AppendAck,
    AppendAudit,
    ApplyBatch,
    AuditHead,
    BeginTxn,
    BrokerInfo,
    CheckAccess,
    ClaimProducer,
    ClusterInfo,
    CommitPositions,
    CreateStream,
    CreateSubscription,
    CreateToken,
    Credit,
    Cut,
    Data,
    DeleteStream,
    DeleteSubscription,
    DescribeCluster,
    DescribeStream,
    DescribeSubscription,
    Done,
    EndSeal,
    EndTxn,
    Error,
    EventsDelivered,
    EventsFound,
    FetchEvents,
    FindEvents,
    Follow,
    FollowEnded,
    FollowFailed,
    FoundEvent,
    Frame,
    FrameDecoder,
    GetCut,
    GetIdentity,
    GetScaleHistory,
    GrantRule,
    GroupAssignment,
    GroupJoined,
    HandOverIdentity,
    Hello,
    HoldPositions,
    IdentityInfo,
    IdentityList,
    InitProducer,
    JoinGroup,
    LeaveGroup,
    ListIdentities,
    ListQuotas,
    ListRules,
    ListStreams,
    ListSubscriptions,
    ListTokens,
    ListTxns,
    Malformed,
    MemberInfo,
    Message,
    Oversized,
    PollGroup,
    PositionsHeld,
    PrepareSeal,
    ProducerGrant,
    QuotaInfo,
    QuotaList,
    ReadSegment,
    ReleasePositions,
    ResetSubscription,
    RevokeRule,
    RevokeToken,
    RuleList,
    ScaleEventInfo,
    ScaleHistory,
    ScaleStream,
    SealPrepared,
    SegmentData,
    SegmentInfo,
    SetQuota,
    Settled,
    SettleEvents,
    StreamInfo,
    StreamList,
    SubscriptionInfo,
    SubscriptionList,
    SubscriptionSegment,
    TokenInfo,
    TokenIssued,
    TokenList,
    TxnBegun,
    TxnEnded,
    TxnInfo,
    TxnList,
    TxnPositions,
    TxnRange,
    Unfollow,
    UpdateStream,
    Welcome,
    encode_frame,
    frame_bytes,
)

Item = Frame | Oversized | Malformed

U32 = st.integers(0, 2**32 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
OFFSETS = st.integers(0, 2**63 - 1)
TEXT = st.text(max_size=20)
OPTIONAL_I64 = st.none() | I64
DETAILS = st.dictionaries(
    TEXT,
    st.recursive(
        st.none() | st.booleans() | I64 | TEXT | st.floats(allow_nan=False),
        lambda inner: st.lists(inner, max_size=3),
        max_leaves=5,
    ),
    max_size=3,
)

segment_infos = st.builds(
    SegmentInfo,
    number=I64,
    epoch=I64,
    key_lo=st.integers(0, 2**64 - 1),
    key_hi=st.integers(0, 2**64 - 1),
    sealed=st.booleans(),
    start_offset=OFFSETS,
    end_offset=OFFSETS,
    bytes=OFFSETS,
    first_timestamp=OPTIONAL_I64,
    last_timestamp=OPTIONAL_I64,
    predecessors=st.lists(I64, max_size=3),
)
stream_infos = st.builds(
    StreamInfo,
    name=TEXT,
    segments=st.lists(segment_infos, max_size=3),
    retention_ms=OPTIONAL_I64,
    retention_bytes=OPTIONAL_I64,
    created_ms=I64,
    epoch=I64,
    scaling=TEXT,
)

quota_infos = st.builds(
    QuotaInfo,
    scope=TEXT,
    produce_bytes=OPTIONAL_I64,
    consume_bytes=OPTIONAL_I64,
    requests=OPTIONAL_I64,
    connections=OPTIONAL_I64,
)
token_infos = st.builds(
    TokenInfo,
    token_id=TEXT,
    subject=TEXT,
    role=TEXT,
    scope=st.none() | TEXT,
    created_at=I64,
    expires_at=I64,
    revoked=st.booleans(),
)
POSITIONS = st.dictionaries(I64, OFFSETS, max_size=4)
PAIRS = st.lists(st.lists(OFFSETS, min_size=2, max_size=2), max_size=3)
txn_positions = st.builds(
    TxnPositions,
    stream=TEXT,
    subscription=TEXT,
    member_id=I64,
    generation=I64,
    positions=POSITIONS,
)
subscription_infos = st.builds(
    SubscriptionInfo,
    stream=TEXT,
    name=TEXT,
    mode=TEXT,
    generation=I64,
    created_ms=I64,
    segments=st.lists(
        st.builds(
            SubscriptionSegment,
            segment=I64,
            position=OFFSETS,
            end_offset=OFFSETS,
            backlog_events=I64,
            backlog_bytes=I64,
            lag_ms=I64,
            owner=I64,
            in_flight=I64,
            waiting=I64,
            dead_lettered=I64,
        ),
        max_size=2,
    ),
    members=st.lists(
        st.builds(
            MemberInfo,
            member_id=I64,
            name=TEXT,
            peer=TEXT,
            segments=st.lists(I64, max_size=3),
            idle_ms=I64,
        ),
        max_size=2,
    ),
    options=DETAILS,
)

access_rules = st.builds(AccessRule, subject=TEXT, action=TEXT, pattern=TEXT)

MESSAGES: dict[type[Message], st.SearchStrategy[Message]] = {
    CreateSubscription: st.builds(
        CreateSubscription,
        stream=TEXT,
        name=TEXT,
        mode=TEXT,
        at=TEXT,
        timestamp_ms=OPTIONAL_I64,
        positions=st.none() | POSITIONS,
        options=DETAILS,
    ),
    ListSubscriptions: st.builds(ListSubscriptions, stream=TEXT),
    ScaleStream: st.builds(ScaleStream, stream=TEXT, segments=st.lists(I64, max_size=3), into=I64),
    GetScaleHistory: st.builds(GetScaleHistory, stream=TEXT),
    ScaleHistory: st.builds(
        ScaleHistory,
        stream=TEXT,
        events=st.lists(
            st.builds(
                ScaleEventInfo,
                epoch=I64,
                at_ms=I64,
                sealed=POSITIONS,
                created=st.lists(I64, max_size=3),
                reason=TEXT,
            ),
            max_size=2,
        ),
    ),
    DescribeSubscription: st.builds(DescribeSubscription, stream=TEXT, name=TEXT),
    DeleteSubscription: st.builds(DeleteSubscription, stream=TEXT, name=TEXT),
    ResetSubscription: st.builds(
        ResetSubscription,
        stream=TEXT,
        name=TEXT,
        at=TEXT,
        timestamp_ms=OPTIONAL_I64,
        positions=st.none() | POSITIONS,
    ),
    JoinGroup: st.builds(
        JoinGroup,
        stream=TEXT,
        subscription=TEXT,
        mode=TEXT,
        member_name=TEXT,
        session_timeout_ms=I64,
    ),
    PollGroup: st.builds(PollGroup, member_id=I64, released=st.lists(I64, max_size=3), wait_ms=I64),
    CommitPositions: st.builds(
        CommitPositions,
        stream=TEXT,
        subscription=TEXT,
        member_id=I64,
        generation=I64,
        positions=POSITIONS,
    ),
    LeaveGroup: st.builds(LeaveGroup, member_id=I64),
    FetchEvents: st.builds(FetchEvents, member_id=I64, max_events=I64, wait_ms=I64),
    FindEvents: st.builds(
        FindEvents,
        stream=TEXT,
        key=st.none() | st.binary(max_size=8),
        start_ms=OPTIONAL_I64,
        end_ms=OPTIONAL_I64,
        limit=I64,
        newest_first=st.booleans(),
    ),
    SetQuota: st.builds(SetQuota, quota=quota_infos),
    ListQuotas: st.builds(ListQuotas),
    QuotaList: st.builds(QuotaList, quotas=st.lists(quota_infos, max_size=3)),
    CreateToken: st.builds(
        CreateToken,
        subject=TEXT,
        role=TEXT,
        scope=st.none() | TEXT,
        expires_s=I64,
        algorithm=TEXT,
    ),
    RevokeToken: st.builds(RevokeToken, token_id=TEXT),
    ListTokens: st.builds(ListTokens),
    TokenIssued: st.builds(TokenIssued, token=TEXT, info=token_infos),
    TokenList: st.builds(TokenList, tokens=st.lists(token_infos, max_size=3)),
    EventsFound: st.builds(
        EventsFound,
        events=st.lists(
            st.builds(
                FoundEvent,
                segment=I64,
                offset=I64,
                timestamp=I64,
                key=st.none() | st.binary(max_size=8),
                value=st.binary(max_size=8),
                headers=st.dictionaries(TEXT, st.binary(max_size=4), max_size=2),
            ),
            max_size=2,
        ),
        batches_read=I64,
        truncated=st.booleans(),
    ),
    SettleEvents: st.builds(SettleEvents, member_id=I64, acks=PAIRS, nacks=PAIRS, delay_ms=I64),
    SubscriptionInfo: subscription_infos,
    SubscriptionList: st.builds(
        SubscriptionList, subscriptions=st.lists(subscription_infos, max_size=2)
    ),
    GroupJoined: st.builds(GroupJoined, member_id=I64, generation=I64),
    GroupAssignment: st.builds(
        GroupAssignment,
        generation=I64,
        assigned=POSITIONS,
        revoke=st.lists(I64, max_size=3),
    ),
    EventsDelivered: st.builds(
        EventsDelivered, deliveries=st.lists(st.lists(OFFSETS, min_size=3, max_size=3), max_size=3)
    ),
    Settled: st.builds(Settled, unknown=PAIRS),
    GrantRule: st.builds(GrantRule, rule=access_rules),
    RevokeRule: st.builds(RevokeRule, rule=access_rules),
    ListRules: st.builds(ListRules),
    CheckAccess: st.builds(
        CheckAccess,
        subject=TEXT,
        action=TEXT,
        stream=TEXT,
        role=TEXT,
        scope=st.none() | TEXT,
    ),
    RuleList: st.builds(RuleList, rules=st.lists(access_rules, max_size=3)),
    AccessDecision: st.builds(
        AccessDecision, allowed=st.booleans(), rule=st.none() | access_rules, reason=TEXT
    ),
    Hello: st.builds(
        Hello,
        protocol_version=I64,
        client_name=TEXT,
        credentials=st.none() | st.dictionaries(TEXT, TEXT, max_size=2),
    ),
    CreateStream: st.builds(
        CreateStream,
        name=TEXT,
        segments=I64,
        retention_ms=OPTIONAL_I64,
        retention_bytes=OPTIONAL_I64,
        scaling=TEXT,
    ),
    DeleteStream: st.builds(DeleteStream, name=TEXT),
    ListStreams: st.builds(ListStreams, scope=st.none() | TEXT),
    DescribeStream: st.builds(DescribeStream, name=TEXT),
    UpdateStream: st.builds(
        UpdateStream,
        name=TEXT,
        retention_ms=OPTIONAL_I64,
        retention_bytes=OPTIONAL_I64,
        scaling=st.none() | TEXT,
    ),
    Append: st.builds(Append, stream=TEXT, segment=I64, txn=OPTIONAL_I64),
    ApplyBatch: st.builds(ApplyBatch, stream=TEXT, segment=I64, producer_id=I64, epoch=I64),
    HoldPositions: st.builds(
        HoldPositions,
        hold_id=I64,
        txn_id=I64,
        subject=TEXT,
        ttl_ms=I64,
        positions=txn_positions,
    ),
    ReleasePositions: st.builds(ReleasePositions, hold_id=I64, stored=st.sampled_from([-1, 0, 1])),
    PositionsHeld: st.builds(
        PositionsHeld,
        hold_id=I64,
        stream_id=I64,
        generation=I64,
        valid_ms=I64,
        held=st.booleans(),
    ),
    GetCut: st.builds(GetCut, stream=TEXT, at=TEXT, timestamp_ms=OPTIONAL_I64),
    Follow: st.builds(
        Follow,
        sub_id=I64,
        stream=TEXT,
        segment=I64,
        offset=OFFSETS,
        end_offset=st.none() | OFFSETS,
        credit=I64,
    ),
    Credit: st.builds(Credit, sub_id=I64, credit=I64),
    Unfollow: st.builds(Unfollow, sub_id=I64),
    Welcome: st.builds(Welcome, protocol_version=I64, broker_version=TEXT, max_batch_bytes=I64),
    Error: st.builds(Error, code=TEXT, message=TEXT, details=DETAILS),
    Done: st.builds(Done),
    StreamInfo: stream_infos,
    StreamList: st.builds(StreamList, streams=st.lists(stream_infos, max_size=2)),
    AppendAck: st.builds(AppendAck, base_offset=OFFSETS, event_count=I64),
    Cut: st.builds(Cut, stream=TEXT, positions=st.dictionaries(I64, OFFSETS, max_size=4)),
    Data: st.builds(Data, sub_id=I64),
    FollowEnded: st.builds(FollowEnded, sub_id=I64, next_offset=OFFSETS),
    FollowFailed: st.builds(FollowFailed, sub_id=I64, code=TEXT, message=TEXT, details=DETAILS),
    InitProducer: st.builds(InitProducer, transactional_id=st.none() | TEXT),
    ClaimProducer: st.builds(
        ClaimProducer, producer_id=I64, epoch=I64, token=st.binary(max_size=16)
    ),
    BeginTxn: st.builds(BeginTxn, producer_id=I64, epoch=I64, timeout_ms=I64, label=TEXT),
    EndTxn: st.builds(
        EndTxn,
        txn_id=I64,
        commit=st.booleans(),
        metadata=st.binary(max_size=64),
        merge=st.lists(I64, max_size=3),
        operator=st.booleans(),
        positions=st.lists(txn_positions, max_size=2),
    ),
    ListTxns: st.builds(ListTxns),
    GetIdentity: st.builds(GetIdentity, transactional_id=TEXT),
    ProducerGrant: st.builds(
        ProducerGrant, producer_id=I64, epoch=I64, token=st.binary(max_size=16)
    ),
    TxnBegun: st.builds(TxnBegun, txn_id=I64),
    TxnEnded: st.builds(
        TxnEnded,
        txn_id=I64,
        committed=st.booleans(),
        ranges=st.lists(
            st.builds(TxnRange, stream=TEXT, segment=I64, start=OFFSETS, end=OFFSETS), max_size=3
        ),
    ),
    TxnList: st.builds(
        TxnList,
        txns=st.lists(
            st.builds(
                TxnInfo,
                txn_id=I64,
                transactional_id=TEXT,
                producer_id=I64,
                epoch=I64,
                state=TEXT,
                age_ms=I64,
                timeout_ms=I64,
                events=I64,
                bytes=I64,
                segments=I64,
                label=TEXT,
            ),
            max_size=2,
        ),
    ),
    IdentityInfo: st.builds(
        IdentityInfo,
        transactional_id=TEXT,
        producer_id=I64,
        epoch=I64,
        last_txn_id=I64,
        last_metadata=st.binary(max_size=64),
        committed_ms=I64,
    ),
}
MESSAGES[ListIdentities] = st.builds(ListIdentities, prefix=TEXT)
MESSAGES[HandOverIdentity] = st.builds(HandOverIdentity, transactional_id=TEXT, subject=TEXT)
MESSAGES[IdentityList] = st.builds(
    IdentityList, identities=st.lists(MESSAGES[IdentityInfo], max_size=3)
)
MESSAGES[DescribeCluster] = st.builds(DescribeCluster)
_BROKER = st.builds(
    BrokerInfo,
    broker_id=TEXT,
    address=TEXT,
    http_address=TEXT,
    containers=st.lists(st.integers(0, 1023), max_size=4),
    started_ms=I64,
)
MESSAGES[ClusterInfo] = st.builds(
    ClusterInfo,
    containers=st.integers(1, 1024),
    brokers=st.lists(_BROKER, max_size=3),
    owners=st.lists(TEXT, max_size=4),
)
MESSAGES[ReadSegment] = st.builds(
    ReadSegment, stream=TEXT, segment=I64, offset=OFFSETS, max_bytes=I64
)
MESSAGES[SegmentData] = st.builds(
    SegmentData, next_offset=OFFSETS, end_offset=OFFSETS, sealed=st.booleans()
)
MESSAGES[PrepareSeal] = st.builds(
    PrepareSeal,
    stream=TEXT,
    segments=st.lists(I64, max_size=3),
    epoch=I64,
    coordinator=TEXT,
    wait_ms=I64,
    max_rate=st.floats(allow_nan=False),
)
MESSAGES[SealPrepared] = st.builds(
    SealPrepared,
    ends=st.lists(OFFSETS, max_size=3),
    containers=st.lists(I64, max_size=3),
    leases=st.lists(I64, max_size=3),
    deadline_ms=I64,
    rates=st.lists(st.lists(st.floats(allow_nan=False), max_size=9), max_size=3),
)
MESSAGES[EndSeal] = st.builds(
    EndSeal, stream=TEXT, segments=st.lists(I64, max_size=3), epoch=I64, committed=st.booleans()
)
MESSAGES[AppendAudit] = st.builds(
    AppendAudit, broker_id=TEXT, records=st.lists(st.binary(max_size=64), max_size=3)
)
MESSAGES[AuditHead] = st.builds(AuditHead, broker_id=TEXT, seq=OFFSETS, hash=TEXT)
messages = st.one_of(*MESSAGES.values())


class Sent(msgspec.Struct, frozen=True):
    """One frame as a sender writes it."""

    message: Message
    correlation_id: int
    payload: bytes

    def wire(self) -> bytes:
        return b"".join(frame_bytes(self.message, self.correlation_id, [self.payload]))

    def frame_length(self) -> int:
        return len(self.wire()) - 4

    def expected(self, max_frame_bytes: int) -> Item:
        if self.frame_length() > max_frame_bytes:
            return Oversized(self.correlation_id, KIND_OF[type(self.message)], self.frame_length())
        return Frame(self.correlation_id, self.message, bytearray(self.payload))


sent_frames = st.builds(Sent, message=messages, correlation_id=U32, payload=st.binary(max_size=200))


def drain(decoder: FrameDecoder, into: list[Item]) -> None:
    while (item := decoder.next_item()) is not None:
        assert isinstance(item, Frame | Oversized | Malformed)
        into.append(item)


def decode_in_chunks(chunks: list[bytes], max_frame_bytes: int) -> tuple[list[Item], bool]:
    """Feed the chunks one by one, draining after each: the items, and whether it raised
    ProtocolError (after which the connection is closed, so nothing more is fed)."""
    decoder = FrameDecoder(max_frame_bytes)
    items: list[Item] = []
    for chunk in chunks:
        decoder.feed(chunk)
        try:
            drain(decoder, items)
        except ProtocolError:
            return items, True
    return items, False


def one_byte_at_a_time(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[lo:hi] for lo, hi in pairwise(bounds)]


def raw_frame(
    kind: int, correlation_id: int, meta: bytes, payload: bytes = b"", **lie: int
) -> bytes:
    """A frame built field by field, with ``frame_length`` or ``meta_length`` optionally wrong."""
    frame_length = lie.get("frame_length", PREFIX_LENGTH - 4 + len(meta) + len(payload))
    meta_length = lie.get("meta_length", len(meta))
    return (
        struct.pack("<IHHII", frame_length, kind, 0, correlation_id, meta_length) + meta + payload
    )


# --- golden bytes (the examples in docs/protocol.md) ------------------------------------------


def test_hello_frame_is_the_documented_golden_bytes() -> None:
    golden = bytes.fromhex(
        "27000000 0100 0000 01000000 1b000000"  # frame_length 39, kind 1, flags 0, cid 1, meta 27
        "93 01 b7"  # array of 3; protocol_version 1; str of 23
        "736c697073747265616d2d707974686f6e2f302e312e30"  # "slipstream-python/0.1.0"
        "c0"  # credentials nil
    )
    hello = Hello(1, "slipstream-python/0.1.0", None)
    assert bytes(encode_frame(hello, correlation_id=1)) == golden

    decoder = FrameDecoder()
    decoder.feed(golden)
    assert decoder.next_item() == Frame(1, hello, bytearray())
    assert decoder.next_item() is None


def test_append_frame_head_is_the_documented_golden_bytes() -> None:
    golden_head = bytes.fromhex(
        "33040000 0600 0000 07000000 0f000000"  # frame_length 1075 = 12 + 15 + 1048, kind 6
        "93 ab 64656d6f2f6f7264657273 01 c0"  # ["demo/orders", 1, None]: no transaction
    )
    assert bytes(encode_frame(Append("demo/orders", 1), 7, payload_length=1048)) == golden_head


def test_list_identities_and_its_answer_round_trip_as_kinds_43_and_93() -> None:
    request = ListIdentities("spark:")
    wire = bytes(encode_frame(request, correlation_id=5))
    assert wire[4:6] == (43).to_bytes(2, "little")
    assert wire[16:] == bytes.fromhex("91 a6 737061726b3a")  # ["spark:"]
    identity = IdentityInfo("spark:q1", 7, 2, 1042, b'{"batch": 3}', 1_700_000_000_000)
    answer = IdentityList([identity, IdentityInfo("spark:q2", 8, 0, -1, b"", 0)])
    decoder = FrameDecoder()
    decoder.feed(wire + bytes(encode_frame(answer, correlation_id=5)))
    assert decoder.next_item() == Frame(5, request, bytearray())
    assert decoder.next_item() == Frame(5, answer, bytearray())
    assert KIND_OF[IdentityList] == 93
    decoder.feed(bytes(encode_frame(ListIdentities(), correlation_id=6)))  # prefix "" default
    assert decoder.next_item() == Frame(6, ListIdentities(""), bytearray())


def test_kinds_are_a_bijection_covering_every_message() -> None:
    assert {KIND_OF[cls] for cls in KINDS.values()} == set(KINDS)
    assert set(KINDS.values()) == set(MESSAGES)
    # these only travel inside other messages; every other message has a kind of its own
    assert set(Message.__subclasses__()) - set(KINDS.values()) == {
        AccessRule,
        BrokerInfo,
        FoundEvent,
        MemberInfo,
        QuotaInfo,
        ScaleEventInfo,
        SegmentInfo,
        SubscriptionSegment,
        TokenInfo,
        TxnInfo,
        TxnPositions,
        TxnRange,
    }
    assert all(0 < kind < 2**16 for kind in KINDS)
    assert PROTOCOL_VERSION == 1


# --- round trips and splits -------------------------------------------------------------------


@settings(max_examples=200)
@given(sent=sent_frames)
def test_every_message_round_trips_with_its_correlation_id_and_payload(sent: Sent) -> None:
    decoder = FrameDecoder()
    decoder.feed(sent.wire())
    assert decoder.next_item() == Frame(sent.correlation_id, sent.message, bytearray(sent.payload))
    assert decoder.next_item() is None
    assert decoder.buffered == 0


@settings(max_examples=150)
@given(
    frames=st.lists(sent_frames, max_size=6),
    max_frame_bytes=st.sampled_from([60, 150, DEFAULT_MAX_FRAME_BYTES]),
    data=st.data(),
)
def test_frames_split_anywhere_decode_the_same_as_whole(
    frames: list[Sent], max_frame_bytes: int, data: st.DataObject
) -> None:
    stream = b"".join(sent.wire() for sent in frames)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts")
    expected = [sent.expected(max_frame_bytes) for sent in frames]

    assert decode_in_chunks([stream], max_frame_bytes) == (expected, False)
    assert decode_in_chunks(split_at(stream, cuts), max_frame_bytes) == (expected, False)


def test_frames_fed_one_byte_at_a_time_decode_the_same_as_whole() -> None:
    frames = [
        Sent(Hello(1, "c"), 1, b""),
        Sent(Append("demo/orders", 3), 2, b"batch bytes"),
        Sent(Error("stream_not_found", "no", {"stream": "demo/x"}), 3, b""),
    ]
    stream = b"".join(sent.wire() for sent in frames)
    expected = [sent.expected(DEFAULT_MAX_FRAME_BYTES) for sent in frames]
    assert decode_in_chunks(one_byte_at_a_time(stream), DEFAULT_MAX_FRAME_BYTES) == (
        expected,
        False,
    )


def test_a_frame_payload_is_a_private_copy() -> None:
    decoder = FrameDecoder()
    decoder.feed(Sent(Data(1), 0, b"first").wire() + Sent(Data(2), 0, b"second").wire())
    first = decoder.next_item()
    assert isinstance(first, Frame)
    first.payload[:] = b"XXXXX"  # the receiver may patch it in place (set_base_offset)
    second = decoder.next_item()
    assert second == Frame(0, Data(2), bytearray(b"second"))


def test_buffered_counts_the_bytes_not_yet_decoded() -> None:
    wire = Sent(Hello(1, "c"), 9, b"").wire()
    decoder = FrameDecoder()
    decoder.feed(wire[:10])
    assert decoder.next_item() is None
    assert decoder.buffered == 10
    decoder.feed(wire[10:] + wire[:3])
    assert isinstance(decoder.next_item(), Frame)
    assert decoder.buffered == 3


# --- oversized frames -------------------------------------------------------------------------

OVERSIZED = Sent(Append("demo/orders", 0), 7, bytes(range(256)) * 2)
FOLLOWING = Sent(Hello(PROTOCOL_VERSION, "after"), 8, b"")


@pytest.mark.parametrize("feeding", ["whole", "one-byte-at-a-time"])
def test_oversized_frame_is_reported_then_the_next_frame_decodes(feeding: str) -> None:
    stream = OVERSIZED.wire() + FOLLOWING.wire()
    chunks = [stream] if feeding == "whole" else one_byte_at_a_time(stream)
    items, raised = decode_in_chunks(chunks, max_frame_bytes=64)
    assert not raised
    assert items == [
        Oversized(correlation_id=7, kind=KIND_OF[Append], frame_length=OVERSIZED.frame_length()),
        Frame(8, FOLLOWING.message, bytearray()),
    ]


def test_oversized_frame_is_not_buffered() -> None:
    decoder = FrameDecoder(max_frame_bytes=64)
    wire = OVERSIZED.wire()
    decoder.feed(wire[:100])
    assert isinstance(decoder.next_item(), Oversized)
    decoder.feed(wire[100:300])
    assert decoder.buffered == 0
    assert decoder.next_item() is None


def test_frame_of_exactly_the_limit_is_decoded_and_one_more_byte_is_oversized() -> None:
    sent = Sent(Data(5), 4, b"x" * 50)
    at_limit = sent.frame_length()
    assert decode_in_chunks([sent.wire()], at_limit) == ([sent.expected(at_limit)], False)
    assert isinstance(sent.expected(at_limit), Frame)
    assert decode_in_chunks([sent.wire()], at_limit - 1) == (
        [Oversized(4, KIND_OF[Data], at_limit)],
        False,
    )


# --- malformed frames and the one fatal error -------------------------------------------------

HELLO_META = msgspec.msgpack.encode([1, "client", None])


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (raw_frame(999, 5, HELLO_META), "unknown message kind 999"),
        (raw_frame(0, 5, HELLO_META), "unknown message kind 0"),
        (raw_frame(1, 5, HELLO_META, meta_length=len(HELLO_META) + 1), "runs past the frame"),
        (raw_frame(1, 5, msgspec.msgpack.encode([1])), "bad Hello fields"),
        (raw_frame(1, 5, msgspec.msgpack.encode(["one", "client"])), "bad Hello fields"),
        (raw_frame(1, 5, b"\xc1"), "bad Hello fields"),  # 0xc1 is never valid msgpack
        (raw_frame(1, 5, HELLO_META[:-1]), "bad Hello fields"),
        (raw_frame(65, 5, msgspec.msgpack.encode(["c", "m", []])), "bad Error fields"),
    ],
    ids=[
        "unknown-kind",
        "kind-0",
        "meta-past-end",
        "missing-field",
        "wrong-type",
        "invalid-msgpack",
        "truncated-meta",
        "details-not-a-map",
    ],
)
def test_malformed_frame_is_reported_and_the_stream_goes_on(frame: bytes, reason: str) -> None:
    following = FOLLOWING.wire()
    for chunks in ([frame + following], one_byte_at_a_time(frame + following)):
        items, raised = decode_in_chunks(chunks, DEFAULT_MAX_FRAME_BYTES)
        assert not raised
        [malformed, frame_after] = items
        assert isinstance(malformed, Malformed)
        assert malformed.correlation_id == 5
        assert reason in malformed.reason
        assert frame_after == FOLLOWING.expected(DEFAULT_MAX_FRAME_BYTES)


def test_extra_trailing_meta_fields_are_ignored() -> None:
    meta = msgspec.msgpack.encode([1, "client", None, "a field from a later version"])
    decoder = FrameDecoder()
    decoder.feed(raw_frame(1, 5, meta))
    assert decoder.next_item() == Frame(5, Hello(1, "client"), bytearray())


@pytest.mark.parametrize("frame_length", [0, 1, 11])
def test_frame_length_below_12_raises_protocol_error_once_four_bytes_are_in(
    frame_length: int,
) -> None:
    decoder = FrameDecoder()
    decoder.feed(struct.pack("<I", frame_length)[:3])
    assert decoder.next_item() is None
    decoder.feed(struct.pack("<I", frame_length)[3:])
    with pytest.raises(ProtocolError, match="below the minimum 12"):
        decoder.next_item()
    with pytest.raises(ProtocolError):  # the stream can no longer be framed: it stays broken
        decoder.next_item()


def test_frame_length_of_exactly_12_is_a_frame_without_meta() -> None:
    decoder = FrameDecoder()
    decoder.feed(raw_frame(66, 3, b""))
    item = decoder.next_item()
    assert isinstance(item, Malformed)  # Done needs its (empty) msgpack array
    decoder.feed(raw_frame(66, 3, msgspec.msgpack.encode([])))
    assert decoder.next_item() == Frame(3, Done(), bytearray())


def test_deeply_nested_details_are_malformed_not_an_escaping_exception() -> None:
    nested = b"\x91" * 5000 + b"\xc0"  # [[[...[nil]...]]]
    meta = b"\x93" + msgspec.msgpack.encode("code") + msgspec.msgpack.encode("m") + b"\x81\xa1k"
    decoder = FrameDecoder()
    decoder.feed(raw_frame(KIND_OF[Error], 5, meta + nested))
    item = decoder.next_item()
    assert isinstance(item, Malformed)
    assert item.correlation_id == 5


# --- fuzz: items or ProtocolError, never anything else ----------------------------------------


@st.composite
def frame_shaped(draw: st.DrawFn) -> bytes:
    """Bytes that look like a frame to the decoder: a plausible prefix over random meta."""
    kind = draw(st.sampled_from([*KINDS, 0, 11, 999, 2**16 - 1]))
    meta = draw(
        st.binary(max_size=40)
        | st.lists(st.none() | I64 | TEXT | st.binary(max_size=8), max_size=8).map(
            msgspec.msgpack.encode
        )
        | DETAILS.map(lambda details: msgspec.msgpack.encode(["code", "message", details]))
    )
    payload = draw(st.binary(max_size=40))
    lie: dict[str, Any] = draw(
        st.fixed_dictionaries({}, optional={"frame_length": U32, "meta_length": U32})
    )
    return raw_frame(kind, draw(U32), meta, payload, **lie)


fuzz_input = st.lists(
    st.binary(max_size=64) | frame_shaped() | sent_frames.map(Sent.wire), max_size=5
).map(b"".join)


@settings(max_examples=400)
@given(data=fuzz_input, max_frame_bytes=st.sampled_from([12, 64, 256, DEFAULT_MAX_FRAME_BYTES]))
def test_decoder_on_arbitrary_bytes_yields_items_or_raises_protocol_error(
    data: bytes, max_frame_bytes: int
) -> None:
    whole = decode_in_chunks([data], max_frame_bytes)
    bytewise = decode_in_chunks(one_byte_at_a_time(data), max_frame_bytes)
    assert bytewise == whole
    assert decode_as_a_socket(data, [1, 7, 64], max_frame_bytes) == whole


@settings(max_examples=200)
@given(data=st.binary(max_size=400))
def test_decoder_on_random_binary_yields_items_or_raises_protocol_error(data: bytes) -> None:
    whole = decode_in_chunks([data], DEFAULT_MAX_FRAME_BYTES)
    bytewise = decode_in_chunks(one_byte_at_a_time(data), DEFAULT_MAX_FRAME_BYTES)
    assert bytewise == whole


def decode_as_a_socket(
    stream: bytes,
    reads: list[int],
    max_frame_bytes: int,
    allocate: Callable[[int], bytearray | memoryview] = bytearray,
    align_payload: tuple[int, int] | None = None,
) -> tuple[list[Item], bool]:
    """Deliver ``stream`` the way asyncio's BufferedProtocol does: into ``get_buffer`` views,
    at most the given read sizes at a time, then ``buffer_updated``."""
    decoder = FrameDecoder(max_frame_bytes, allocate, align_payload)
    items: list[Item] = []
    at, sizes = 0, iter(reads)
    while at < len(stream):
        target = decoder.get_buffer(-1)
        count = min(len(target), len(stream) - at, next(sizes, len(stream)) or 1)
        target[:count] = stream[at : at + count]
        decoder.buffer_updated(count)
        at += count
        try:
            drain(decoder, items)
        except ProtocolError:
            return items, True
    return items, False


@settings(max_examples=60, deadline=None)
@given(
    payload_sizes=st.lists(st.sampled_from([0, 10, 65_535, 70_000, 300_000]), max_size=5),
    reads=st.lists(st.integers(1, 400_000), max_size=30),
    data=st.data(),
)
def test_large_frames_decode_the_same_through_feed_and_buffers(
    payload_sizes: list[int], reads: list[int], data: st.DataObject
) -> None:
    frames = [
        Sent(Append("demo/big", i), i + 1, bytes([i % 251]) * size)
        for i, size in enumerate(payload_sizes)
    ]
    stream = b"".join(sent.wire() for sent in frames)
    expected = [sent.expected(DEFAULT_MAX_FRAME_BYTES) for sent in frames]
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts")
    assert decode_in_chunks(split_at(stream, cuts), DEFAULT_MAX_FRAME_BYTES) == (expected, False)
    assert decode_as_a_socket(stream, reads, DEFAULT_MAX_FRAME_BYTES) == (expected, False)
    # a large frame's buffer may come uninitialised (the client's pooled memory): every byte
    # of it is written before the frame is decoded
    for allocate in (_dirty, _pooled):
        items, failed = decode_as_a_socket(stream, reads, DEFAULT_MAX_FRAME_BYTES, allocate)
        assert (items, failed) == (expected, False)
        for item in items:  # payloads stay writable, as the broker patches offsets in place
            assert isinstance(item, Frame) and not memoryview(item.payload).readonly
    # the broker asks for large payloads at a given place in a 4 KiB block (for its journal)
    items, failed = decode_as_a_socket(stream, reads, DEFAULT_MAX_FRAME_BYTES, _dirty, (4096, 16))
    assert (items, failed) == (expected, False)
    for item, size in zip(items, payload_sizes, strict=True):
        assert isinstance(item, Frame)
        if size >= 300_000:  # larger than a socket read: assembled in a buffer of its own
            assert _address(item.payload) % 4096 == 16


def _address(buffer: bytearray | memoryview) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _dirty(size: int) -> bytearray:
    return bytearray(b"\xaa") * size
